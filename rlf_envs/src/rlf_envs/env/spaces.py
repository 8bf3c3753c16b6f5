"""Gymnasium spaces that really contain rlf's observations and actions.

`AnyText` also registers its own shared-memory layout with Gymnasium's vector utilities (they are
`functools.singledispatch` functions, Gymnasium's extension point for custom spaces), so
`gymnasium.make_vec(id, n, vectorization_mode="async")` works with its default `shared_memory=True`:
Gymnasium's `Text` layout stores indices into the sampling charset and fails on any other character.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import Any, overload

import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import create_shared_memory, read_from_shared_memory, write_to_shared_memory

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


# Shared memory for AnyText: per env, one int32 length then up to max_length Unicode code points (UTF-32).
@create_shared_memory.register(AnyText)
def _create_anytext_shared_memory(space: AnyText, n: int = 1, ctx: Any = None) -> Any:
    import multiprocessing as mp

    return (ctx or mp).Array(np.dtype(np.int32).char, n * (space.max_length + 1))


class SharedTexts(SequenceABC[str]):
    """The strings in an AnyText shared-memory buffer, decoded when read: a live view, as Gymnasium's
    shared-memory arrays are for numeric spaces (AsyncVectorEnv reads the buffer once, at start-up, and
    returns `deepcopy` of it after each step unless `copy=False`; a deep copy is a plain tuple)."""

    def __init__(self, data: np.ndarray) -> None:
        self._data = data

    def __len__(self) -> int:
        return int(self._data.shape[0])

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[str, ...]: ...
    def __getitem__(self, i: int | slice) -> str | tuple[str, ...]:
        if isinstance(i, slice):
            return tuple(self[k] for k in range(len(self))[i])
        row = self._data[i]
        return row[1 : 1 + int(row[0])].astype("<i4").tobytes().decode("utf-32-le", "surrogatepass")

    def __deepcopy__(self, memo: dict[int, Any]) -> tuple[str, ...]:
        return tuple(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SequenceABC) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"SharedTexts({tuple(self)!r})"


@read_from_shared_memory.register(AnyText)
def _read_anytext_from_shared_memory(space: AnyText, shared_memory: Any, n: int = 1) -> SharedTexts:
    return SharedTexts(np.frombuffer(shared_memory.get_obj(), dtype=np.int32).reshape((n, space.max_length + 1)))


@write_to_shared_memory.register(AnyText)
def _write_anytext_to_shared_memory(space: AnyText, index: int, value: str, shared_memory: Any) -> None:
    if not space.contains(value):
        raise ValueError(f"{space!r} does not contain the value ({type(value).__name__} of length {len(value)})")
    size = space.max_length + 1
    row = np.frombuffer(shared_memory.get_obj(), dtype=np.int32)[index * size : (index + 1) * size]
    codes = np.frombuffer(value.encode("utf-32-le", "surrogatepass"), dtype="<i4")
    row[0] = len(codes)
    row[1 : 1 + len(codes)] = codes


def token_space(vocab_size: int, seed: Any = None) -> spaces.Sequence:
    """Variable-length arrays of token ids (np.int64)."""
    return spaces.Sequence(spaces.Discrete(vocab_size), stack=True, seed=seed)


def as_token_array(ids: list[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64)
