"""LoRA RL on the local backend (`model.lora`), through `peft`.

What the trainer gets from here:

- `attach(model, settings, seed, base)`: the policy with a LoRA adapter (peft's `get_peft_model`) on the layers of
  `model.lora.target_modules`; every base weight frozen (`requires_grad=False`), so the optimizer is built over
  `trainable(model)` (the adapter only) and holds state for nothing else. The adapter's init is drawn under a
  forked RNG seeded from the run's seed: a fresh run and a resumed one draw the same init, and the trainer's RNG
  streams are untouched. B starts at zero, so the attached policy computes exactly the base's function.
- `AdapterOff(model)` / `reference(ref)`: the KL reference is the policy with the adapter switched off
  (`PeftModel.disable_adapter`): the same tensors, no second copy of any weight (`shares_weights` checks it; the
  CPU benchmark `benchmarks/lora_memory.py` measures it).
- `hf_state(model)`: the policy as a plain transformers state dict, adapter merged (W + scale * B @ A per adapted
  layer, peft's own `get_delta_weight`), without touching the model: what the vLLM engine reloads after each
  update (`rollout.engine: vllm`) and what `export_merged` writes.
- checkpoints (`save_adapter`; `rlf_train.policy.load.load_policy` reads them): an RL checkpoint of a LoRA run holds
  the adapter (`adapter_model.safetensors`, peft's `adapter_config.json`) and `lora_base.json`, which names the
  frozen base: the run's `sft` checkpoint (when a warm start ran) or `model.name_or_path`'s own weights (the tiny
  model rebuilt from the seed). The optimizer, scheduler, RNG and data order go in `trainer_state.pt` as for full
  weights, so a SIGKILLed run resumes bit-identically.
- `save_pretrained_merged(model, out)`: what `python -m rlf_train export --checkpoint CKPT --out DIR` writes
  (`rlf_train.policy.load.export_merged`): a normal Hugging Face model dir that `transformers` and vLLM load.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from rlf_train.config import LoraConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_FILE = "lora_base.json"
ADAPTER = "default"  # peft's adapter name


def require_peft() -> Any:
    try:
        import peft
    except ImportError as e:
        from rlf_envs.extras import pip_install

        raise ImportError(f"model.lora needs peft (>=0.21.2,<0.22): {pip_install('lora', 'rlf-train')}") from e
    return peft


def is_lora(model: Any) -> bool:
    """Whether `model` is a peft model (a policy with an adapter)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def attach(model: PreTrainedModel, settings: LoraConfig, seed: int, base: str | None = None) -> Any:
    """`model` with a fresh LoRA adapter (see the module doc); `base`: what the frozen weights are, as recorded in
    checkpoints ("sft": the run's sft checkpoint; None: model.name_or_path). A peft model is returned as is."""
    if is_lora(model):
        return model
    peft = require_peft()
    conf = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                           target_modules=list(settings.target_modules), bias="none", task_type="CAUSAL_LM")
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in settings.target_modules if t not in names]
    if missing:
        raise ValueError(f"model.lora.target_modules: {missing} name no module of this model (its linear layers "
                         f"include {sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))[:6]}"
                         "...); use layer names such as q_proj, v_proj, down_proj")
    for p in model.parameters():  # gradients left by an earlier stage (SFT) would count in the RL grad-norm clip
        p.grad = None
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft reads transformers' deprecated `is_gradient_checkpointing` (transformers 5.x warns)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(seed + 5)
        wrapped = peft.get_peft_model(model, conf)
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"
    if getattr(model, name, False):
        # reentrant checkpointing needs an input that requires grad; the embedding is frozen now
        wrapped.enable_input_require_grads()
    wrapped.rlf_lora_base = base
    return wrapped


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer gets: all of a full-weight policy, the adapter's of a LoRA one."""
    return [p for p in model.parameters() if p.requires_grad]


class AdapterOff:
    """The KL reference of a LoRA policy: the policy itself with its adapter switched off (`reference` enters
    that state); it holds no weights of its own."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    @contextmanager
    def active(self) -> Iterator[Any]:
        with self.policy.disable_adapter():
            yield self.policy


@contextmanager
def reference(ref: Any) -> Iterator[Any]:
    """A model to compute the reference log-probs with: `ref` itself, or for `AdapterOff` the policy with its adapter
    switched off for the duration of the block."""
    if isinstance(ref, AdapterOff):
        with ref.active() as m:
            yield m
    else:
        yield ref


def shares_weights(policy: torch.nn.Module, ref: Any) -> bool:
    """Whether every tensor the reference computes with is one of the policy's (no copy)."""
    model = ref.policy if isinstance(ref, AdapterOff) else ref
    mine = {p.data_ptr() for p in policy.parameters()}
    return all(p.data_ptr() in mine for p in model.parameters())


def inner_model(model: Any) -> Any:
    """The transformers model under a peft wrapper (adapted layers in place), else `model`."""
    return model.get_base_model() if is_lora(model) else model


def _hf_name(name: str) -> str:
    return name.replace(".base_layer.", ".")


def hf_state(model: torch.nn.Module, *, parameters_only: bool = True) -> dict[str, torch.Tensor]:
    """The policy's weights under the plain transformers names, adapter merged (see the module doc). For a model
    without adapter: its `named_parameters()` (or `state_dict()`), detached. Tensors are fresh for merged layers and
    the model's own (detached) otherwise."""
    if not is_lora(model):
        items = model.named_parameters() if parameters_only else model.state_dict().items()
        return {k: v.detach() for k, v in items}
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    out: dict[str, torch.Tensor] = {}
    items = base.named_parameters() if parameters_only else base.state_dict().items()
    for k, v in items:
        if ".lora_" in k:
            continue
        out[_hf_name(k)] = v.detach()
    with torch.no_grad():
        for name, mod in base.named_modules():
            if isinstance(mod, LoraLayer) and ADAPTER in getattr(mod, "lora_A", {}):
                w = mod.get_base_layer().weight
                out[f"{name}.weight"] = w.detach() + mod.get_delta_weight(ADAPTER).to(w.dtype)
    return out


def merged_copy(model: Any) -> PreTrainedModel:
    """A plain transformers model (a new object) holding `hf_state(model)`; `model` is left as it is."""
    if not is_lora(model):
        return model  # type: ignore[no-any-return]
    import copy

    base = model.get_base_model()
    plain = type(base)(copy.deepcopy(base.config))
    plain.to(dtype=next(base.parameters()).dtype)
    sd = hf_state(model, parameters_only=False)
    missing, unexpected = plain.load_state_dict(sd, strict=False)
    tied = {"lm_head.weight"} if getattr(base.config, "tie_word_embeddings", False) else set()
    if [m for m in missing if m not in tied] or unexpected:
        raise RuntimeError(f"merged LoRA weights do not fit the model: missing {missing[:4]}, unexpected "
                           f"{unexpected[:4]}")
    if tied:
        plain.tie_weights()
    plain.config.use_cache = True
    return plain


def save_pretrained_merged(model: Any, out_dir: Path) -> None:
    """`save_pretrained` of the policy as a plain transformers model, adapter merged (no second model is built: the
    merged tensors are handed to the base model's `save_pretrained`)."""
    if not is_lora(model):
        model.save_pretrained(out_dir)
        return
    model.get_base_model().save_pretrained(out_dir, state_dict=hf_state(model, parameters_only=False))


# ---------------------------------------------------------------- checkpoints
def is_adapter_checkpoint(ckpt_dir: Path) -> bool:
    return (Path(ckpt_dir) / ADAPTER_WEIGHTS).is_file()


def save_adapter(model: Any, out_dir: Path) -> None:
    """The adapter (peft's format: adapter_model.safetensors + adapter_config.json) and `lora_base.json`."""
    model.save_pretrained(str(out_dir))
    (Path(out_dir) / BASE_FILE).write_text(json.dumps({"base_checkpoint": getattr(model, "rlf_lora_base", None)}))


def base_checkpoint(ckpt_dir: Path) -> Path | None:
    """The checkpoint holding the frozen base of an adapter checkpoint (None: model.name_or_path's weights)."""
    f = Path(ckpt_dir) / BASE_FILE
    name = json.loads(f.read_text()).get("base_checkpoint") if f.is_file() else None
    if name is None:
        return None
    base = Path(ckpt_dir).parent / name
    if not base.is_dir():
        raise FileNotFoundError(f"LoRA checkpoint {ckpt_dir} is an adapter on the checkpoint {name!r}, which is "
                                f"missing ({base}); restore that directory to resume or export")
    return base
