"""Gymnasium spaces that really contain rlf's observations and actions."""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces

MAX_TEXT = 1 << 22  # characters


class AnyText(spaces.Text):
    """Any Python string up to `max_length` characters (any Unicode), sampled from alphanumerics.

    Gymnasium's Text only accepts its sampling charset; tool output and model text are arbitrary Unicode.
    """

    def __init__(self, max_length: int = MAX_TEXT, min_length: int = 0, sample_length: int = 64, seed: Any = None):
        super().__init__(max_length=max_length, min_length=min_length, seed=seed)
        self.sample_length = sample_length

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        if mask is None and probability is None:
            n = int(self.np_random.integers(self.min_length, min(self.max_length, self.sample_length) + 1))
            mask = (n, None)
        return super().sample(mask=mask, probability=probability)

    def __repr__(self) -> str:
        return f"AnyText(max_length={self.max_length})"


def token_space(vocab_size: int, seed: Any = None) -> spaces.Sequence:
    """Variable-length arrays of token ids (np.int64)."""
    return spaces.Sequence(spaces.Discrete(vocab_size), stack=True, seed=seed)


def as_token_array(ids: list[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64)
