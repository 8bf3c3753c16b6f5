"""The quickstart's data: Search-v0's generated `quickstart` world (deterministic, test people unseen in
train questions, answers readable from the document) and the shipped quickstart tokenizer (every answer
value one token)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from repo_paths import REPO

from rlf_envs.data.search import generate
from rlf_train.config import ConfigError, ModelConfig, TinyModelConfig, load_config
from rlf_train.policy.tokenizer import load_tokenizer, tokenizer_file_path
from rlf_train.policy.tokenizer_corpus import QUICKSTART_INSTRUCTION

ROOT = REPO


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    mp = pytest.MonkeyPatch()
    mp.setenv("RLF_CACHE_DIR", str(tmp_path_factory.mktemp("rlf-cache")))
    try:
        yield generate.world_dir("quickstart")
    finally:
        mp.undo()


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_world_is_deterministic_and_test_people_are_unseen(world: Path) -> None:
    assert generate.world_dir("quickstart") == world  # cached: the second call reuses the directory
    corpus, train, test = (_rows(world / f) for f in ("corpus.jsonl", "train.jsonl", "test.jsonl"))
    again = generate.quickstart_world()
    assert (corpus, train, test) == tuple(list(x) for x in again)
    assert (len(corpus), len(train), len(test)) == (9200, 9000, 200)
    train_people = {r["meta"]["entity"] for r in train}
    test_people = {r["meta"]["entity"] for r in test}
    assert not train_people & test_people
    docs = {d["id"]: d["contents"] for d in corpus}
    for r in test + train:
        rel, ans = r["meta"]["relation"], r["answers"][0]
        assert docs[r["meta"]["docs"][0]].endswith(f"{rel} {ans}.")  # the relation word right before its value


def test_world_option_errors() -> None:
    with pytest.raises(ValueError, match="world must be one of"):
        generate.world_dir("huge")


def test_search_env_world_option(world: Path) -> None:
    pytest.importorskip("bm25s")
    import asyncio

    from rlf_envs.envs.search import SearchEnv

    env = SearchEnv(world="quickstart", split="test", topk=1)
    assert len(env.tasks) == 200
    task = env.tasks[0]

    async def episode() -> float:
        await env.areset(seed=0, options={"task_index": 0})
        _obs, _r, term, _trunc, _info = await env.astep(f"<search> {task.meta['entity']}</search>")
        assert not term
        _obs, r, term, _trunc, _info = await env.astep(f"<answer> {task.gold_answers[0]}</answer>")
        assert term
        return float(r)

    assert asyncio.run(episode()) == 1.0
    with pytest.raises(ValueError, match="world must be one of"):
        SearchEnv(world="nope")


def test_quickstart_tokenizer_single_token_answers() -> None:
    tok = load_tokenizer(ModelConfig(tiny=TinyModelConfig(tokenizer_file="quickstart_tokenizer.json")))
    for values in generate.QUICKSTART_RELATIONS.values():
        for v in values:
            assert len(tok.encode(" " + v, add_special_tokens=False)) == 1, v
    for tag in ("<search>", "</answer>", "<information>"):
        assert len(tok.encode(tag, add_special_tokens=False)) == 1
    prompt = QUICKSTART_INSTRUCTION.format(question="What is the job of Motodram?")
    assert len(tok.encode(prompt, add_special_tokens=False)) < 50
    cfg = load_config(ROOT / "configs" / "quickstart.yaml")
    assert cfg.env.kwargs["format_kwargs"]["instruction"] == QUICKSTART_INSTRUCTION
    assert cfg.env.kwargs["world"] == "quickstart"


def test_tokenizer_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="quickstart_tokenizer.json"):
        tokenizer_file_path("missing.json")
    with pytest.raises(ConfigError, match="tokenizer_file"):
        load_config(None, ["model.tiny.tokenizer_file=[1, 2]"])
