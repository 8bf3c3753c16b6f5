"""Duck-typed tokenizer adapter: a transformers tokenizer or a raw `tokenizers.Tokenizer`.

rlf_envs never imports transformers; anything with the right methods works.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

ENCODE_CACHE_SIZE = 8192  # texts; the cache is emptied when full
MAX_CACHED_CHARS = 4096  # longer texts are encoded every time


class TokenizerAdapter:
    """`encode(text) -> list[int]` without special tokens added, `decode(ids) -> str` verbatim.

    Encodings of short texts are cached: GRPO's samples of one prompt share the prompt and, whenever
    they make the same tool call, the observation. `shared(tokenizer)` gives one adapter (one cache)
    per tokenizer object, so every env built with that tokenizer shares it.
    """

    _shared: ClassVar[dict[int, TokenizerAdapter]] = {}
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # transformers: PreTrainedTokenizerBase has `apply_chat_template`/`convert_tokens_to_ids`
        self.is_hf = hasattr(tokenizer, "convert_tokens_to_ids") and hasattr(tokenizer, "batch_decode")
        if not self.is_hf and not (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")):
            raise TypeError(
                f"tokenizer of type {type(tokenizer).__name__} has no encode/decode; pass a transformers "
                "tokenizer or a tokenizers.Tokenizer"
            )
        self._cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def shared(cls, tokenizer: Any) -> TokenizerAdapter:
        """The process-wide adapter of this tokenizer object (it keeps the tokenizer alive)."""
        with cls._shared_lock:
            a = cls._shared.get(id(tokenizer))
            if a is None or a.tokenizer is not tokenizer:
                a = cls._shared[id(tokenizer)] = cls(tokenizer)
            return a

    @property
    def vocab_size(self) -> int:
        t = self.tokenizer
        if self.is_hf:
            return len(t)
        if hasattr(t, "get_vocab_size"):
            return int(t.get_vocab_size(with_added_tokens=True))
        return int(t.vocab_size)

    def _remember(self, text: str, ids: tuple[int, ...]) -> None:
        if len(text) <= MAX_CACHED_CHARS:
            if len(self._cache) >= ENCODE_CACHE_SIZE:
                self._cache.clear()
            self._cache[text] = ids

    def _encode(self, text: str) -> tuple[int, ...]:
        t = self.tokenizer
        if self.is_hf:
            return tuple(t.encode(text, add_special_tokens=False))
        enc = t.encode(text, add_special_tokens=False)
        return tuple(enc.ids) if hasattr(enc, "ids") else tuple(enc)

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        ids = self._cache.get(text)
        if ids is None:
            ids = self._encode(text)
            self._remember(text, ids)
        return list(ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`[encode(t) for t in texts]`, the uncached ones in one tokenizer call (same ids)."""
        out: list[tuple[int, ...] | None] = [self._cache.get(x) if x else () for x in texts]
        todo = [k for k, ids in enumerate(out) if ids is None]
        if todo:
            for k, ids in zip(todo, self._encode_many([texts[k] for k in todo]), strict=True):
                out[k] = ids
                self._remember(texts[k], ids)
        return [list(ids) for ids in out]  # type: ignore[arg-type]

    def _encode_many(self, texts: list[str]) -> list[tuple[int, ...]]:
        t = self.tokenizer
        if self.is_hf:
            return [tuple(ids) for ids in t(texts, add_special_tokens=False)["input_ids"]]
        if len(texts) == 1 or not hasattr(t, "encode_batch") or getattr(t, "padding", None) is not None:
            # a tokenizer.json with padding enabled pads a batch to its longest text: encode one by one
            return [self._encode(x) for x in texts]
        fast = getattr(t, "encode_batch_fast", None)  # tokenizers >= 0.20: no offsets computed
        return [tuple(e.ids) for e in (fast or t.encode_batch)(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        t = self.tokenizer
        if self.is_hf:
            return str(t.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))
        return str(t.decode(ids, skip_special_tokens=False))
