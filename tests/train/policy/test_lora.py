"""LoRA RL on the local backend (`model.lora`, rlf_train.policy.lora, real peft):

- the config key: defaults, a misspelt key lists the allowed ones, the embedding / output layer and async are
  refused by name;
- only the adapter trains: every base weight is frozen and the trainer's optimizer holds state for the adapter
  tensors only;
- the KL reference is the base with the adapter switched off: log-probs equal to the base model's own, and no
  tensor of its own (every weight it computes with is the policy's);
- the merged view (what vLLM reloads and `export` writes) equals peft's own merge, and a plain model holding it
  computes the policy's log-probs; the local sampler samples from base + adapter;
- a run SIGKILLed mid-RL resumes bit-identically (metrics rows and adapter), as the full-weight path does;
- `python -m rlf_train export` writes a Hugging Face dir that transformers loads with the policy's outputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from repo_paths import REPO
from safetensors.torch import load_file

from rlf_train.config import ConfigError, LoraConfig, load_config
from rlf_train.grpo import masked_logprobs
from rlf_train.policy import lora
from rlf_train.policy.model import build_tiny_model
from rlf_train.policy.tokenizer import load_tokenizer
from rlf_train.trainer import Trainer
from tests.train.test_crash_resume import COMMON, STEPS, _run_until_parked_then_kill, rows
from tests.train.test_learning_signal import parity_cfg

pytest.importorskip("peft")
ROOT = REPO
LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


def _tiny(seed: int = 0) -> torch.nn.Module:
    cfg = load_config(None, ["model.tiny.hidden_size=32", "model.tiny.intermediate_size=64"]).model
    return build_tiny_model(cfg, vocab_size=300, seed=seed, pad_token_id=0)


def _logprobs(model: object, ids: torch.Tensor) -> torch.Tensor:
    mask = torch.ones(ids.shape[0], ids.shape[1] - 1)
    return masked_logprobs(model, ids[:, :-1], torch.ones_like(ids[:, :-1]), ids[:, 1:], mask)[0]  # type: ignore[arg-type]


def _perturb(model: torch.nn.Module, seed: int = 1) -> None:
    """Give the adapter non-zero weights (B starts at 0), as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def test_config_key() -> None:
    cfg = load_config(None, ["model.lora={}"])
    assert cfg.model.lora == LoraConfig() and cfg.model.lora.rank == 16 and "down_proj" in cfg.model.lora.target_modules
    assert load_config(None).model.lora is None
    with pytest.raises(ConfigError, match=r"model\.lora\.rnk: unknown key; allowed keys here: alpha, dropout, rank"):
        load_config(None, ["model.lora.rnk=8"])
    with pytest.raises(ConfigError, match=r"model\.lora: .*lm_head"):
        load_config(None, ["model.lora.target_modules=[q_proj, lm_head]"])
    with pytest.raises(ConfigError, match=r"model\.lora with rollout\.mode: async is not supported"):
        load_config(None, ["model.lora={}", "rollout.mode=async"])
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules: \['qkv'\] name no module"):
        lora.attach(_tiny(), LoraConfig(target_modules=["qkv"]), seed=0)


def test_only_the_adapter_trains_and_the_reference_is_the_base_without_a_copy() -> None:
    base = _tiny()
    ids = torch.randint(1, 300, (3, 20), generator=torch.Generator().manual_seed(0))
    want = _logprobs(base, ids)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    policy = lora.attach(base, LoraConfig(rank=4, alpha=8), seed=0)
    again = lora.attach(_tiny(), LoraConfig(rank=4, alpha=8), seed=0)  # the same seed draws the same init
    assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(), again.state_dict().values(),
                                                 strict=True))
    trainable = lora.trainable(policy)
    names = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(trainable) == 2 * 7 * 2  # A and B on 7 linear layers x 2 layers
    assert torch.equal(_logprobs(policy, ids), want)  # B = 0: the attached policy is the base, exactly
    _perturb(policy)
    assert not torch.allclose(_logprobs(policy, ids), want)
    ref = lora.AdapterOff(policy)
    with lora.reference(ref) as m:
        assert torch.equal(_logprobs(m, ids), want)
    assert not torch.allclose(_logprobs(policy, ids), want)  # switched back on after the block
    assert lora.shares_weights(policy, ref) and vars(ref).keys() == {"policy"}  # it holds the policy, nothing else
    # the frozen base is the very tensors of the base model, unchanged
    kept = {k.replace(".base_layer", ""): v for k, v in policy.get_base_model().state_dict().items()
            if ".lora_" not in k}
    assert kept.keys() == before.keys() and all(torch.equal(before[k], v) for k, v in kept.items())


def test_merged_view_is_peft_merge_and_computes_the_policy() -> None:
    policy = lora.attach(_tiny(), LoraConfig(rank=4, alpha=8), seed=0)
    _perturb(policy)
    ids = torch.randint(1, 300, (3, 20), generator=torch.Generator().manual_seed(1))
    state = lora.hf_state(policy)
    plain = _tiny()
    assert set(state) == {n for n, _ in plain.named_parameters()}
    plain2 = lora.merged_copy(policy)
    assert torch.allclose(_logprobs(plain2, ids), _logprobs(policy, ids), atol=1e-5)
    # the policy is untouched (no merge in place) and peft's own merge gives the same tensors
    import copy

    peft_merged = copy.deepcopy(policy).merge_and_unload()
    for k, v in peft_merged.state_dict().items():
        assert torch.equal(v, plain2.state_dict()[k]), k
    assert not policy.get_base_model().model.layers[0].self_attn.q_proj.merged


def test_trainer_optimizer_holds_adapter_state_only_and_samples_from_the_adapter(tmp_path: Path) -> None:
    tr = Trainer(parity_cfg(tmp_path / "run", 2, [*LORA, "algorithm.kl_coef=0.1", "logging.save_every=1"]))
    tr.run()
    assert lora.is_lora(tr.model) and isinstance(tr.ref_model, lora.AdapterOff)
    ckpt = tmp_path / "run" / "checkpoints" / "step_2"
    assert (ckpt / lora.ADAPTER_WEIGHTS).is_file() and not (ckpt / "model.safetensors").exists()
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)["optimizer"]["state"]
    n_adapter = sum(1 for n, _ in tr.model.named_parameters() if ".lora_" in n)
    assert len(state) == n_adapter and all(s["exp_avg"].numel() < 32 * 64 for s in state.values())
    saved = load_file(str(ckpt / lora.ADAPTER_WEIGHTS))
    assert saved and all(".lora_" in k for k in saved) and any(v.abs().sum() > 0 for k, v in saved.items()
                                                                if "lora_B" in k)
    # greedy episodes of the policy (base + adapter in peft's forward) == those of the merged plain model
    from rlf_train.rollout.batch import SamplingParams
    from rlf_train.rollout.local import rollout

    venv = tr.eval_envs()
    params = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=4)
    got = rollout(venv, [0, 1, 2], tr.model, tr.tokenizer, params, seeds=[0, 1, 2], batch_size=8)[0]
    want = rollout(venv, [0, 1, 2], lora.merged_copy(tr.model), tr.tokenizer, params, seeds=[0, 1, 2],
                   batch_size=8)[0]
    assert [t.token_ids for t in got] == [t.token_ids for t in want]


def test_lora_resume_after_sigkill_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    full = tmp_path / "full"
    cfg = parity_cfg(full, STEPS, [*COMMON, *LORA])
    Trainer(cfg).run()
    run = tmp_path / "run"
    at_kill = _run_until_parked_then_kill(run, tmp_path, "step_2",
                                          [*LORA, "logging.save_every=2", "env.kwargs.pause_skip=12"])
    assert at_kill == "step_2" and lora.is_adapter_checkpoint(run / "checkpoints" / "step_2")
    assert json.loads((run / "checkpoints" / "step_2" / lora.BASE_FILE).read_text()) == {"base_checkpoint": "sft"}
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["env"]["kwargs"] = {}
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    from rlf_train.cli import main

    assert main(["--resume", str(run)]) == 0
    assert rows(run) == rows(full)
    a = load_file(str(full / "checkpoints" / f"step_{STEPS}" / lora.ADAPTER_WEIGHTS))
    b = load_file(str(run / "checkpoints" / f"step_{STEPS}" / lora.ADAPTER_WEIGHTS))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r for r in rows(run) if r["stage"] == "rl"][-1]["grad_norm"] > 0
    assert [r for r in rows(run) if r["stage"] == "rl"][-1]["kl"] > 0  # the reference (adapter off) differs


def test_export_writes_a_hf_model_dir_with_the_policys_outputs(tmp_path: Path) -> None:
    run = tmp_path / "run"
    tr = Trainer(parity_cfg(run, 2, [*LORA, "logging.save_every=1"]))
    tr.run()
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "rlf_train", "export", "--checkpoint",
                           str(run / "checkpoints" / "step_2"), "--out", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == len(load_tokenizer(tr.cfg.model))
    ids = torch.randint(1, len(tok), (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(_logprobs(hf, ids), _logprobs(tr.model, ids), atol=1e-5)
    bad = subprocess.run([sys.executable, "-m", "rlf_train", "export", "--checkpoint", str(tmp_path), "--out",
                          str(tmp_path / "x")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "is not a checkpoint" in bad.stderr
