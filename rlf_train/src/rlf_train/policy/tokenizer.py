"""The policy's tokenizer: a model's own (`model.tokenizer` / `model.name_or_path`), or the offline default.

Offline default (`model.name_or_path: tiny`): a small byte-level BPE tokenizer trained with the `tokenizers` library
on the text the project ships (`assets/`). The tool-protocol tags (`<search>`, `</answer>`, ...) are added as single
tokens, so the policy emits a tag in one step and stop strings are one token. The shipped tokenizers are rebuilt by
`python -m rlf_train.policy.tokenizer_corpus`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from rlf_train.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

ASSETS = Path(__file__).parent.parent / "assets"
TOKENIZER_FILE = ASSETS / "tiny_tokenizer.json"
TOKENIZER_TEXT = ASSETS / "tokenizer_text.txt"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAG_TOKENS = [
    "<search>", "</search>", "<answer>", "</answer>", "<information>", "</information>",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
]  # fmt: skip


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> object:
    """Train a byte-level BPE `tokenizers.Tokenizer` on `texts` (deterministic for the same input)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in TAG_TOKENS])
    return tok


def wrap_tokenizer(raw: object) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|endoftext|>", pad_token="<|endoftext|>", bos_token=None
    )
    hf.padding_side = "left"
    return hf


def build_tiny_tokenizer(vocab_size: int, text_file: Path = TOKENIZER_TEXT) -> PreTrainedTokenizerFast:
    """The shipped tokenizer if its vocab size matches, else train one on the shipped text."""
    from tokenizers import Tokenizer

    if TOKENIZER_FILE.is_file():
        raw = Tokenizer.from_file(str(TOKENIZER_FILE))
        if raw.get_vocab_size() <= vocab_size + len(TAG_TOKENS):
            return wrap_tokenizer(raw)
    if not text_file.is_file():
        raise FileNotFoundError(f"tokenizer training text missing: {text_file}")
    lines = [ln for ln in text_file.read_text(encoding="utf-8").splitlines() if ln.strip()]
    return wrap_tokenizer(train_tokenizer(lines, vocab_size))


def tokenizer_file_path(name: str) -> Path:
    """A tokenizer JSON: an existing path as given, else a file of that name in rlf_train's assets."""
    p = Path(name)
    if p.is_file():
        return p
    if (ASSETS / name).is_file():
        return ASSETS / name
    raise FileNotFoundError(f"model.tiny.tokenizer_file: {name!r} is neither a file nor one of rlf_train's assets "
                            f"({', '.join(sorted(f.name for f in ASSETS.glob('*.json')))})")


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerFast:
    if cfg.name_or_path == "tiny" and cfg.tokenizer is None:
        if cfg.tiny.tokenizer_file is not None:
            from tokenizers import Tokenizer

            return wrap_tokenizer(Tokenizer.from_file(str(tokenizer_file_path(cfg.tiny.tokenizer_file))))
        return build_tiny_tokenizer(cfg.tiny.tokenizer_vocab_size)
    from transformers import AutoTokenizer

    path = cfg.tokenizer or cfg.name_or_path
    key = "model.tokenizer" if cfg.tokenizer else "model.name_or_path"
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, KeyError) as e:  # not a dir with a tokenizer, and no hub access (offline)
        local = "a local directory" if Path(path).exists() else "neither a local directory nor a model in the HF cache"
        raise ConfigError(f"{key}: cannot load a tokenizer from {path!r} ({local}: {' '.join(str(e).split())[:200]}); "
                          "use `tiny` (the offline model), or a path/hub id of a transformers causal LM that is "
                          "already downloaded (runs are offline: HF_HUB_OFFLINE)") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok
