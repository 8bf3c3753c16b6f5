"""Kept for one release: the policy's pieces live in `rlf_train.policy` (`load_policy`, `load_tokenizer`, ...) and the
shipped tokenizers are rebuilt by `python -m rlf_train.policy.tokenizer_corpus`; import them from there."""

from __future__ import annotations

from rlf_train.policy.load import load_policy
from rlf_train.policy.model import build_tiny_model, num_parameters, resolve_device
from rlf_train.policy.tokenizer import (
    ASSETS,
    SPECIAL_TOKENS,
    TAG_TOKENS,
    TOKENIZER_FILE,
    TOKENIZER_TEXT,
    build_tiny_tokenizer,
    load_tokenizer,
    tokenizer_file_path,
    train_tokenizer,
    wrap_tokenizer,
)
from rlf_train.policy.tokenizer_corpus import (
    CODE_TOKENIZER_FILE,
    QUICKSTART_INSTRUCTION,
    QUICKSTART_TOKENIZER_FILE,
    SQL_TOKENIZER_FILE,
    WORLDS,
    code_tokenizer_text,
    env_tokenizer_text,
    main,
    quickstart_tokenizer_text,
    sql_tokenizer_text,
    write_tokenizer_text,
)

__all__ = [
    "ASSETS", "CODE_TOKENIZER_FILE", "QUICKSTART_INSTRUCTION", "QUICKSTART_TOKENIZER_FILE", "SPECIAL_TOKENS",
    "SQL_TOKENIZER_FILE", "TAG_TOKENS", "TOKENIZER_FILE", "TOKENIZER_TEXT", "WORLDS", "build_tiny_model",
    "build_tiny_tokenizer", "code_tokenizer_text", "env_tokenizer_text", "load_policy", "load_tokenizer", "main",
    "num_parameters", "quickstart_tokenizer_text", "resolve_device", "sql_tokenizer_text", "tokenizer_file_path",
    "train_tokenizer", "wrap_tokenizer", "write_tokenizer_text",
]

if __name__ == "__main__":
    main()
