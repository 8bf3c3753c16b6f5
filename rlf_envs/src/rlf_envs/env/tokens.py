"""Duck-typed tokenizer adapter: a transformers tokenizer or a raw `tokenizers.Tokenizer`.

rlf_envs never imports transformers; anything with the right methods works.
"""

from __future__ import annotations

from typing import Any


class TokenizerAdapter:
    """`encode(text) -> list[int]` without special tokens added, `decode(ids) -> str` verbatim."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # transformers: PreTrainedTokenizerBase has `apply_chat_template`/`convert_tokens_to_ids`
        self.is_hf = hasattr(tokenizer, "convert_tokens_to_ids") and hasattr(tokenizer, "batch_decode")
        if not self.is_hf and not (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")):
            raise TypeError(
                f"tokenizer of type {type(tokenizer).__name__} has no encode/decode; pass a transformers "
                "tokenizer or a tokenizers.Tokenizer"
            )

    @property
    def vocab_size(self) -> int:
        t = self.tokenizer
        if self.is_hf:
            return len(t)
        if hasattr(t, "get_vocab_size"):
            return int(t.get_vocab_size(with_added_tokens=True))
        return int(t.vocab_size)

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        t = self.tokenizer
        if self.is_hf:
            return list(t.encode(text, add_special_tokens=False))
        enc = t.encode(text, add_special_tokens=False)
        return list(enc.ids) if hasattr(enc, "ids") else list(enc)

    def decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        t = self.tokenizer
        if self.is_hf:
            return str(t.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))
        return str(t.decode(ids, skip_special_tokens=False))
