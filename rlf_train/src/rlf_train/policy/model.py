"""Build or load the policy and its tokenizer.

Offline default (`model.name_or_path: tiny`): a tiny Qwen3-architecture causal LM built from config
(random init, seeded) and a small byte-level BPE tokenizer trained with the `tokenizers` library on
the text the project ships. The tool-protocol tags (`<search>`, `</answer>`, ...) are added as
single tokens, so the policy emits a tag in one step and stop strings are one token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlf_train.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

log = logging.getLogger(__name__)

ASSETS = Path(__file__).parent / "assets"
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


def resolve_device(spec: str) -> torch.device:
    """`model.device` as a torch device; a device this machine lacks is a ConfigError naming the key."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"model.device: {spec!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ConfigError(f"model.device: {spec!r} but no CUDA GPU is visible here; use model.device=cpu "
                              "(or auto, which picks a GPU when there is one)")
        if dev.index is not None and dev.index >= n:
            raise ConfigError(f"model.device: {spec!r} but only {n} CUDA GPU(s) are visible (cuda:0..cuda:{n - 1})")
    elif dev.type not in ("cpu", "mps", "xpu"):
        raise ConfigError(f"model.device: {spec!r} is not supported; use auto, cpu, cuda or cuda:N")
    return dev


def build_tiny_model(cfg: ModelConfig, vocab_size: int, seed: int, pad_token_id: int | None) -> PreTrainedModel:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    t = cfg.tiny
    qc = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers,
        num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_kv_heads,
        head_dim=t.hidden_size // t.num_heads,
        max_position_embeddings=t.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        eos_token_id=pad_token_id,
        bos_token_id=None,
        initializer_range=0.02,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(qc)
    return model


def load_policy(
    cfg: ModelConfig, tokenizer: PreTrainedTokenizerFast, seed: int, weights_dir: Path | None = None
) -> PreTrainedModel:
    """The policy on its device, in train mode. `weights_dir` (a checkpoint) overrides the init; a LoRA checkpoint
    (`rlf_train.lora`) gives its base with the saved adapter."""
    if weights_dir is not None:
        from rlf_train import lora

        if lora.is_adapter_checkpoint(weights_dir):
            return lora.load_policy_from_adapter(cfg, tokenizer, seed, weights_dir)  # type: ignore[no-any-return]
    dtype = getattr(torch, cfg.dtype)
    if cfg.name_or_path == "tiny":
        model = build_tiny_model(cfg, len(tokenizer), seed, tokenizer.pad_token_id)
        if weights_dir is not None:
            from rlf_train.checkpoint import load_weights

            load_weights(model, weights_dir)
    else:
        from transformers import AutoModelForCausalLM

        src = str(weights_dir) if weights_dir is not None else cfg.name_or_path
        try:
            model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"model.name_or_path: cannot load a causal LM from {src!r} "
                              f"({' '.join(str(e).split())[:200]}); use `tiny` or a downloaded transformers "
                              "causal LM") from None
    model.to(device=resolve_device(cfg.device), dtype=dtype)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.config.use_cache = True
    return model


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def write_tokenizer_text(out: Path = TOKENIZER_TEXT) -> Path:
    """Regenerate the shipped tokenizer training text from rlf_envs' shipped search data and the
    formats' prompt/correction texts (run when those change: `python -m rlf_train.model`)."""
    import json
    from importlib import resources

    from rlf_envs.formats import search_r1

    lines: list[str] = [search_r1.SEARCH_R1_INSTRUCTION.replace("{question}", "").strip(),
                        search_r1.CORRECTION.replace("{why}", "").strip()]
    data = resources.files("rlf_envs") / "data" / "search"
    for name in ("corpus.jsonl", "train.jsonl"):
        for raw in (data / name).read_text(encoding="utf-8").splitlines():
            rec = json.loads(raw)
            if "contents" in rec:
                lines.extend(rec["contents"].splitlines())
            else:
                lines.append(rec["question"])
                lines.extend(f"<answer> {a}</answer>" for a in rec["answers"])
                lines.append(f"<search> {rec['meta']['entity']}</search>")
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


QUICKSTART_TOKENIZER_FILE = ASSETS / "quickstart_tokenizer.json"
# the short instruction of configs/quickstart.yaml (fewer tokens per step on CPU)
QUICKSTART_INSTRUCTION = "Question: {question}\n"


def quickstart_tokenizer_text() -> list[str]:
    """Training text of the quickstart tokenizer: the instruction texts and the generated quickstart world
    (corpus, train questions, answer/search tags), so every answer value is a single token."""
    import json

    from rlf_envs.data.search.generate import world_dir
    from rlf_envs.formats import search_r1

    lines: list[str] = [search_r1.SEARCH_R1_INSTRUCTION.replace("{question}", "").strip(),
                        search_r1.CORRECTION.replace("{why}", "").strip()]
    d = world_dir("quickstart")
    for raw in (d / "corpus.jsonl").read_text(encoding="utf-8").splitlines():
        title, _, text = json.loads(raw)["contents"].partition("\n")
        lines.append(f"<information>Doc 1(Title: {title}) {text}</information>")  # as the env renders a hit
    for raw in (d / "train.jsonl").read_text(encoding="utf-8").splitlines():
        rec = json.loads(raw)
        lines.append(QUICKSTART_INSTRUCTION.format(question=rec["question"]).strip())
        lines.extend(f"<answer> {a}</answer>" for a in rec["answers"])
        lines.append(f"<search> {rec['meta']['entity']}</search>")
    return lines


SQL_TOKENIZER_FILE = ASSETS / "sql_tokenizer.json"
CODE_TOKENIZER_FILE = ASSETS / "code_tokenizer.json"


def env_tokenizer_text(env: Any, demos: Path) -> list[str]:
    """Training text of an env's own tokenizer: its rendered (train) prompts, the shipped warm-start demos, and
    the observations the demos produce when replayed through the env."""
    import json

    lines: list[str] = [env.format.render_prompt(t, env.toolbox.specs, env.system_prompt) for t in env.tasks]
    for raw in demos.read_text(encoding="utf-8").splitlines():
        demo = json.loads(raw)
        env.reset(seed=0, options={"task_index": demo["task_index"]})
        for action in demo["actions"]:
            obs, *_ = env.step(action)
            lines.extend([action, obs])
    env.close()
    return [ln for ln in lines if ln.strip()]


def sql_tokenizer_text() -> list[str]:
    """Training text of the SQL tokenizer (configs/sql_quickstart.yaml), train split only."""
    from rlf_envs.data.sql import DATA_DIR
    from rlf_envs.envs.sql import SqlEnv

    return env_tokenizer_text(SqlEnv(split="train"), DATA_DIR / "sft_demos.jsonl")


def code_tokenizer_text() -> list[str]:
    """Training text of the Code tokenizer (configs/code_quickstart.yaml), train split only."""
    from rlf_envs.data.code import DATA_DIR
    from rlf_envs.envs.code import CodeEnv

    return env_tokenizer_text(CodeEnv(split="train"), DATA_DIR / "sft_demos.jsonl")


WORLDS = {"sql": (sql_tokenizer_text, SQL_TOKENIZER_FILE), "code": (code_tokenizer_text, CODE_TOKENIZER_FILE)}


def main(argv: list[str] | None = None) -> None:
    """Regenerate the shipped tokenizers: `python -m rlf_train.model [--world quickstart|sql|code]`."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--world", choices=("default", "quickstart", *WORLDS), default="default")
    args = ap.parse_args(argv)
    if args.world in WORLDS:
        text_of, out = WORLDS[args.world]
        tok = train_tokenizer(text_of(), 3072)
        tok.save(str(out))  # type: ignore[attr-defined]
        print(f"wrote {out} (vocab {tok.get_vocab_size()})")  # type: ignore[attr-defined]
        return
    if args.world == "quickstart":
        tok = train_tokenizer(quickstart_tokenizer_text(), 3072)
        tok.save(str(QUICKSTART_TOKENIZER_FILE))  # type: ignore[attr-defined]
        print(f"wrote {QUICKSTART_TOKENIZER_FILE} (vocab {tok.get_vocab_size()})")  # type: ignore[attr-defined]
        return
    p = write_tokenizer_text()
    tok = train_tokenizer([ln for ln in p.read_text().splitlines() if ln.strip()], 3072)
    tok.save(str(TOKENIZER_FILE))  # type: ignore[attr-defined]
    print(f"wrote {p} and {TOKENIZER_FILE} (vocab {tok.get_vocab_size()})")  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
