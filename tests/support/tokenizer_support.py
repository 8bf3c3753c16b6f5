"""Test helper: a small byte-level BPE tokenizer trained here, offline, on an env's own text."""

from __future__ import annotations

from collections.abc import Iterable

import tokenizers


def train_bpe(texts: Iterable[str], vocab_size: int) -> tokenizers.Tokenizer:
    """A byte-level BPE over `texts` with the Qwen-style chat markers as special tokens."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|im_start|>", "<|im_end|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok
