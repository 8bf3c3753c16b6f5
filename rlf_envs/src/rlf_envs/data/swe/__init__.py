"""rlf's repository-level repair tasks (SWE-smith style, from real projects): see `generate.py`.

Files (rebuild with `python -m rlf_envs.data.swe.generate`; it needs the package index): `repos/<id>.tar.gz`
(each project's shipped sources, tests and licence), `projects.json` (per project: dist, version, licence, import
root, test paths), `train.jsonl` / `test.jsonl` (SWE-bench field names, plus `bug_patch`).
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent


def split_path(split: str) -> Path:
    """The JSONL file of `split` ("train" or "test")."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return DATA_DIR / f"{split}.jsonl"


__all__ = ["DATA_DIR", "split_path"]
