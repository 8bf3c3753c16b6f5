"""Checkpoints: model weights as safetensors (a LoRA policy: its adapter, `rlf_train.policy.lora`), trainer state
(optimizer, RNG, data order) alongside.
Each checkpoint is written to a temp dir and renamed into place (atomic); keep-last-N pruning."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rlf_train.config import ConfigError
from rlf_train.policy import lora

WEIGHTS = "model.safetensors"
STATE = "trainer_state.pt"
META = "checkpoint.json"
_STEP_RE = re.compile(r"^(step_|sft_)(\d+)$")


@dataclass
class CheckpointMeta:
    """Which stage and step a checkpoint was written at: what a resumed run continues from."""

    stage: str  # "sft" | "rl"
    step: int  # RL steps completed (or SFT steps for stage sft)
    sft_done: bool
    extra: dict[str, Any] = field(default_factory=dict)


def save_weights(model: torch.nn.Module, path: Path) -> None:
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    # tied embeddings share storage: keep one copy, restore by load_state_dict(strict=False)
    seen: dict[int, str] = {}
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        ptr = v.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen[ptr] = k
        out[k] = v
    save_file(out, str(path))


def load_weights(model: torch.nn.Module, ckpt_dir: Path) -> None:
    f = Path(ckpt_dir) / WEIGHTS
    if not f.is_file():
        raise FileNotFoundError(f"no {WEIGHTS} in checkpoint {ckpt_dir}")
    sd = load_file(str(f))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    bad = [m for m in missing if m not in tied]
    if bad or unexpected:
        raise ValueError(f"checkpoint {ckpt_dir} does not match the model: missing={bad} unexpected={unexpected}")
    if tied and hasattr(model, "tie_weights"):
        model.tie_weights()


def save_checkpoint(run_dir: Path, name: str, model: torch.nn.Module, trainer_state: dict[str, Any],
                    meta: CheckpointMeta, keep_last: int, tokenizer: Any = None) -> Path:
    ckpt_root = run_dir / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / name
    tmp = ckpt_root / f".tmp_{name}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        if lora.is_lora(model):  # the adapter and the name of its frozen base (rlf_train.policy.lora)
            lora.save_adapter(model, tmp)
        else:
            save_weights(model, tmp / WEIGHTS)
        torch.save(trainer_state, tmp / STATE)
        if hasattr(model, "config"):
            (tmp / "config.json").write_text(model.config.to_json_string())
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(str(tmp))
        (tmp / META).write_text(json.dumps(asdict(meta)))
        if final.exists():
            old = ckpt_root / f".old_{name}_{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    latest = ckpt_root / "latest"
    tmp_link = ckpt_root / f".latest_{os.getpid()}"
    tmp_link.write_text(name)
    os.replace(tmp_link, latest)
    _prune(ckpt_root, keep_last)
    return final


def _prune(ckpt_root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` of each series (step_N of RL, sft_N of SFT)."""
    for prefix in ("step_", "sft_"):
        steps = sorted((int(m.group(2)), p) for p in ckpt_root.iterdir()
                       if (m := _STEP_RE.match(p.name)) and m.group(1) == prefix)
        for _, p in steps[:-keep_last]:
            shutil.rmtree(p, ignore_errors=True)


def remove_checkpoints(run_dir: Path, prefix: str) -> None:
    """Delete the numbered checkpoints `<prefix>N` (e.g. SFT's intermediate ones once `sft` is saved)."""
    ckpt_root = Path(run_dir) / "checkpoints"
    if ckpt_root.is_dir():
        for p in ckpt_root.iterdir():
            if (m := _STEP_RE.match(p.name)) and m.group(1) == prefix:
                shutil.rmtree(p, ignore_errors=True)


def prepare_run_dir(run_dir: Path) -> None:
    """Create the run dir and check it is writable (a ConfigError naming logging.run_dir if not)."""
    probe = Path(run_dir) / f".write_test_{os.getpid()}"
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"logging.run_dir: cannot write to {run_dir} ({e.strerror or e}); set logging.run_dir "
                          "(or name) to a writable directory") from None


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpt_root = Path(run_dir) / "checkpoints"
    latest = ckpt_root / "latest"
    if latest.is_file():
        p = ckpt_root / latest.read_text().strip()
        if (p / META).is_file():
            return p
    return None


def read_checkpoint(ckpt_dir: Path) -> tuple[CheckpointMeta, dict[str, Any]]:
    meta = CheckpointMeta(**json.loads((ckpt_dir / META).read_text()))
    state = torch.load(ckpt_dir / STATE, map_location="cpu", weights_only=False)
    return meta, state
