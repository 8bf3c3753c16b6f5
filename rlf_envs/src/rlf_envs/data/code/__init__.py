"""rlf/Code-v0's offline tasks: math and data questions whose answers need computation.

Files (regenerate with `python -m rlf_envs.data.code.generate`): `train.jsonl`, `test.jsonl` (rlf task JSONL
with `meta.check`, `meta.program` and, for data questions, `meta.files`) and `sft_demos.jsonl` (scripted
warm-start episodes on train tasks).
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent


def split_path(split: str) -> Path:
    """The task JSONL of `split` ("train" or "test")."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return DATA_DIR / f"{split}.jsonl"


__all__ = ["DATA_DIR", "split_path"]
