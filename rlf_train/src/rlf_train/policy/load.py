"""`load_policy`: the one way a policy is loaded (the tiny model, a transformers causal LM, a checkpoint, a LoRA
adapter on its base), above the pieces it joins (`model`, `checkpoint`, `lora`); and `export_merged`, which writes a
checkpoint as a Hugging Face model dir."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlf_train.config import ConfigError, ModelConfig, load_config
from rlf_train.policy import lora
from rlf_train.policy.checkpoint import load_weights
from rlf_train.policy.model import build_tiny_model, resolve_device
from rlf_train.policy.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast


def load_policy(
    cfg: ModelConfig, tokenizer: PreTrainedTokenizerFast, seed: int, weights_dir: Path | None = None
) -> PreTrainedModel:
    """The policy on its device, in train mode. `weights_dir` (a checkpoint) overrides the init; a LoRA checkpoint
    (`rlf_train.policy.lora`) gives its base with the saved adapter."""
    if weights_dir is not None and lora.is_adapter_checkpoint(weights_dir):
        return load_policy_from_adapter(cfg, tokenizer, seed, weights_dir)  # type: ignore[no-any-return]
    dtype = getattr(torch, cfg.dtype)
    if cfg.name_or_path == "tiny":
        model = build_tiny_model(cfg, len(tokenizer), seed, tokenizer.pad_token_id)
        if weights_dir is not None:
            load_weights(model, weights_dir)
    else:
        from transformers import AutoModelForCausalLM

        src = str(weights_dir) if weights_dir is not None else cfg.name_or_path
        try:
            model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"model.name_or_path: cannot load a causal LM from {src!r} "
                              f"({' '.join(str(e).split())[:200]}); use `tiny` or a downloaded transformers "
                              "causal LM") from None
    model.to(device=resolve_device(cfg.device), dtype=dtype)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.config.use_cache = True
    return model


def load_policy_from_adapter(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int,
                             ckpt_dir: Path) -> Any:
    """The policy of a LoRA checkpoint: its base (see `base_checkpoint`) with the saved adapter."""
    from safetensors.torch import load_file

    if cfg.lora is None:
        raise ValueError(f"checkpoint {ckpt_dir} holds a LoRA adapter but the config has no model.lora; resume with "
                         "the run's own config.yaml (or set model.lora as it was)")
    base_dir = lora.base_checkpoint(ckpt_dir)
    model = load_policy(cfg.model_copy(update={"lora": None}), tokenizer, seed, weights_dir=base_dir)
    wrapped = lora.attach(model, cfg.lora, seed, base=None if base_dir is None else base_dir.name)
    peft = lora.require_peft()
    sd = load_file(str(Path(ckpt_dir) / lora.ADAPTER_WEIGHTS), device=str(next(model.parameters()).device))
    result = peft.set_peft_model_state_dict(wrapped, sd, adapter_name=lora.ADAPTER)
    bad = [k for k in [*getattr(result, "unexpected_keys", []), *getattr(result, "missing_keys", [])]
           if ".lora_" in k]
    if bad:
        raise ValueError(f"checkpoint {ckpt_dir}: its adapter does not fit model.lora ({bad[:4]} unmatched); resume "
                         "with the run's own config.yaml")
    return wrapped


def export_merged(ckpt_dir: Path, out_dir: Path) -> Path:
    """Write checkpoint `ckpt_dir` (a run's `checkpoints/step_N`, `sft`, ...: LoRA or full) as a Hugging Face model
    dir with the adapter merged: config.json, model.safetensors, the tokenizer. Uses the run's config.yaml."""
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "checkpoint.json").is_file():
        raise FileNotFoundError(f"{ckpt_dir} is not a checkpoint (no checkpoint.json); pass a run's "
                                "checkpoints/step_N (or checkpoints/sft)")
    run_cfg = ckpt_dir.parent.parent / "config.yaml"
    if not run_cfg.is_file():
        raise FileNotFoundError(f"{run_cfg} is missing: export reads the run's config next to its checkpoints")
    cfg = load_config(run_cfg, ["model.device=cpu", "model.gradient_checkpointing=false"])
    tok = load_tokenizer(cfg.model)
    model = load_policy(cfg.model, tok, cfg.seed, weights_dir=ckpt_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lora.save_pretrained_merged(model, out_dir)
    tok.save_pretrained(str(out_dir))
    # the weights get the mode of their siblings (the default umask's; safetensors writes them 0600)
    umask = os.umask(0)
    os.umask(umask)
    for f in out_dir.glob("*.safetensors"):
        f.chmod(0o666 & ~umask)
    return out_dir
