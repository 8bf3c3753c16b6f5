"""rlf's offline search data set: an invented-world corpus with single- and two-hop questions.

Files (regenerate with `python -m rlf_envs.data.search.generate`): `corpus.jsonl` (wiki-18 format),
`train.jsonl` and `test.jsonl` (rlf JSONL task format). See README.md in this directory.
"""

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
CORPUS_PATH = DATA_DIR / "corpus.jsonl"
TRAIN_PATH = DATA_DIR / "train.jsonl"
TEST_PATH = DATA_DIR / "test.jsonl"


def split_path(split: str) -> Path:
    """The JSONL file of `split` ("train" or "test")."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return DATA_DIR / f"{split}.jsonl"


__all__ = ["CORPUS_PATH", "DATA_DIR", "TEST_PATH", "TRAIN_PATH", "split_path"]
