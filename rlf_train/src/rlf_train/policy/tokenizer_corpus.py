"""Regenerating the shipped tokenizers (`python -m rlf_train.policy.tokenizer_corpus [--world quickstart|sql|code]`):
the text each one is trained on, read from rlf_envs' shipped data and envs. Run it when that text changes; training
and loading never do (they read `assets/`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlf_train.policy.tokenizer import ASSETS, TOKENIZER_FILE, TOKENIZER_TEXT, train_tokenizer


def write_tokenizer_text(out: Path = TOKENIZER_TEXT) -> Path:
    """Regenerate the shipped tokenizer training text from rlf_envs' shipped search data and the
    formats' prompt/correction texts (run when those change: `python -m rlf_train.policy.tokenizer_corpus`)."""
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
    """Regenerate the shipped tokenizers (`--world quickstart|sql|code`; default: the search tokenizer and its text)."""
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
