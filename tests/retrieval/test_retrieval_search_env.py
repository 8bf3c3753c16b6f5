"""rlf/Search-v0 end to end: against a real retrieval server on loopback, and in-process; both formats."""

from __future__ import annotations

import asyncio
import json
import signal
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import rlf_envs  # noqa: F401 - registers the ids
from rlf_envs.envs.search import SearchEnv, search_tasks
from rlf_envs.retrieval import build_index
from rlf_envs.tasks import load_tasks
from rlf_envs.tasks.parquet import load_search_r1_parquet
from rlf_envs.types import Task
from servers.retrieval.process import ROOT, ServerProcess

pytestmark = pytest.mark.timeout(600)  # a hang guard, generous for a loaded machine

CORPUS = ROOT / "rlf_envs" / "src" / "rlf_envs" / "data" / "search" / "corpus.jsonl"


@pytest.fixture(scope="module")
def server(bm25_index_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(bm25_index_dir, ["--max-topk", "5"]) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLF_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "rlf-cache"))


def _single_hop(env: SearchEnv) -> tuple[int, Task]:
    for i, t in enumerate(env.tasks):
        if t.meta["hops"] == 1:
            return i, t
    raise AssertionError("no single-hop task")


def test_search_r1_episode_against_server(server: ServerProcess) -> None:
    env = gym.make("rlf/Search-v0", retriever=server.url, split="test")
    i, task = _single_hop(env.unwrapped)
    obs, info = env.reset(seed=0, options={"task_index": i})
    assert task.question in obs and "<search>" in obs
    obs, reward, term, trunc, info = env.step(
        f"<think>I must look it up.</think><search>{task.meta['entity']}</search>"
    )
    assert (reward, term, trunc) == (0.0, False, False)
    assert obs.startswith("\n\n<information>Doc 1(Title: ") and obs.rstrip().endswith("</information>")
    assert f'Doc 1(Title: "{task.meta["entity"]}")' in obs
    assert task.gold_answers[0] in obs
    assert obs.count("Doc ") == 3  # default topk
    assert info["tool_calls"] == 1 and info["tool_errors"] == 0
    obs, reward, term, trunc, info = env.step(f"<answer> {task.gold_answers[0]} </answer>")
    assert (reward, term, trunc) == (1.0, True, False)
    env.close()


def test_two_hop_episode(server: ServerProcess) -> None:
    env = SearchEnv(retriever=server.url, split="test", max_turns=4)
    i, task = next((i, t) for i, t in enumerate(env.tasks) if t.meta["hops"] == 2)
    env.reset(options={"task_index": i})
    docs = [json.loads(line) for line in CORPUS.read_text().splitlines()]
    first = next(d for d in docs if d["id"] == task.meta["docs"][0])
    second = next(d for d in docs if d["id"] == task.meta["docs"][1])
    obs, *_ = env.step(f"<search>{task.meta['entity']}</search>")
    assert first["contents"].split("\n")[1] in obs
    bridge = second["contents"].split("\n")[0].strip('"')
    assert bridge in obs  # the bridge entity is named in the first document
    obs, *_ = env.step(f"<search>{bridge}</search>")
    assert task.gold_answers[0] in obs
    _, reward, term, _, _ = env.step(f"<answer>{task.gold_answers[0]}</answer>")
    assert reward == 1.0 and term


def test_qwen3_format_with_topk_and_errors(server: ServerProcess) -> None:
    env = SearchEnv(retriever=server.url, split="test", format="qwen3", max_turns=5)
    i, task = _single_hop(env)
    obs, _ = env.reset(options={"task_index": i})
    assert '"name": "search"' in obs and '"topk"' in obs
    call = {"name": "search", "arguments": {"query": task.meta["entity"], "topk": 2}}
    obs, *_ = env.step(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
    assert "<tool_response>" in obs and obs.count("Doc ") == 2 and task.gold_answers[0] in obs
    # the policy asks for more than the tool allows: a clear error observation, the episode goes on
    call["arguments"]["topk"] = 50
    obs, _, term, _, info = env.step(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
    assert "Error" in obs and "topk" in obs and not term and info["tool_errors"] == 1
    _, reward, term, _, _ = env.step(f"<answer>{task.gold_answers[0]}</answer>")
    assert reward == 1.0 and term


def test_server_side_limit_becomes_error_observation(server: ServerProcess) -> None:
    # the tool allows topk 8 but this server was started with --max-topk 5: its 400 message reaches the policy
    env = SearchEnv(retriever=server.url, split="test", format="qwen3", max_topk=8)
    env.reset(options={"task_index": 0})
    call = {"name": "search", "arguments": {"query": "Trosto", "topk": 8}}
    obs, _, _, _, info = env.step(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
    assert "topk: must be between 1 and 5" in obs and info["tool_errors"] == 1


def test_check_env_against_server(server: ServerProcess) -> None:
    env = gym.make("rlf/Search-v0", retriever=server.url)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)
    env.close()


def test_inprocess_default_index_is_built_once_and_matches_server(server: ServerProcess) -> None:
    env = gym.make("rlf/Search-v0", split="train")
    obs, _ = env.reset(seed=3)
    task = env.unwrapped.trajectory.task
    local_obs, *_ = env.step(f"<search>{task.meta['entity']}</search>")
    remote = SearchEnv(retriever=server.url, split="train")
    remote.reset(options={"task": task})
    remote_obs, *_ = remote.step(f"<search>{task.meta['entity']}</search>")
    assert local_obs == remote_obs
    # a second env reuses the same tool (the index is loaded once per process)
    other = SearchEnv(split="test")
    assert other.search_tool is env.unwrapped.search_tool
    assert len(other.tasks) == 200 and len(env.unwrapped.tasks) == 1420


def test_server_down_is_an_error_observation_not_a_crash(tmp_path: Path) -> None:
    out = tmp_path / "bm25"
    build_index(CORPUS, out, kind="bm25", show_progress=False)
    srv = ServerProcess(out).start()
    url = srv.url
    assert srv.stop(signal.SIGTERM) == 0
    env = SearchEnv(
        retriever=url, split="test", request_timeout_s=2.0, caller={"max_retries": 1, "retry_backoff_s": 0.01}
    )
    env.reset(options={"task_index": 0})
    obs, reward, term, trunc, info = env.step("<search>Trosto</search>")
    assert "unavailable" in obs and "cannot reach the retrieval server" in obs
    assert info["tool_errors"] == 1 and not term and not trunc


def _search_many(url: str, asks: list[tuple[str, int]], **kw: Any) -> tuple[list[Any], int]:
    """All searches at once through one HTTP backend: each its rendered hits or its error text; and the requests."""
    from rlf_envs import runtime
    from rlf_envs.envs.search import HTTPBackend, _render

    async def go() -> tuple[list[Any], int]:
        backend = HTTPBackend(url, **kw)
        try:
            found = await asyncio.gather(*(backend.search([q], k) for q, k in asks), return_exceptions=True)
        finally:
            await backend.aclose()
        return [f"{type(r).__name__}: {r}" if isinstance(r, BaseException) else _render(r[0]) for r in found], (
            backend.requests
        )

    return runtime.run(go(), timeout=120)


def test_coalesced_searches_match_one_request_per_search(server: ServerProcess) -> None:
    # rlf's BM25 top-k lists are prefix-consistent: a repeated query searched once with the largest topk and cut
    # to each caller's topk gives what each would have got alone
    tasks = search_tasks("test")
    asks = [(t.meta["entity"], 1 + i % 5) for i, t in enumerate(tasks[:24])] * 2 + [("Trosto", 5), ("Trosto", 1)]
    coalesced, n_coalesced = _search_many(server.url, asks)
    single, n_single = _search_many(server.url, asks, coalesce=False)
    assert coalesced == single and all(r.startswith("Doc 1(Title: ") for r in coalesced)
    assert n_coalesced == 1 and n_single == len(asks)


def test_a_query_over_the_servers_limit_fails_alone(server: ServerProcess) -> None:
    asks = [(t.meta["entity"], 3) for t in search_tasks("test")[:16]]
    asks[6] = ("x" * 5000, 3)  # over the server's max_query_chars (4096): the whole request would be a 400
    asks[9] = (asks[9][0], 8)  # over this server's --max-topk 5
    coalesced, n = _search_many(server.url, asks)
    single, _ = _search_many(server.url, asks, coalesce=False)
    too_long = "ToolError: search rejected: queries.0: 5000 characters exceeds the limit of 4096"
    assert coalesced[6] == single[6] == too_long
    assert coalesced[9] == single[9] == "ToolError: search rejected: topk: must be between 1 and 5, got 8"
    assert coalesced == single and sum(r.startswith("Doc 1(Title: ") for r in coalesced) == 14
    assert n < len(asks)  # split until each bad query stood alone, not one request per search


def test_bad_env_arguments(server: ServerProcess, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="split must be"):
        SearchEnv(retriever=server.url, split="dev")
    with pytest.raises(ValueError, match="retriever must be"):
        SearchEnv(retriever="ftp://x")
    with pytest.raises(ValueError, match="index_dir applies only"):
        SearchEnv(retriever=server.url, index_dir=tmp_path)
    with pytest.raises(ValueError, match="topk must be between"):
        SearchEnv(retriever=server.url, topk=0)
    from rlf_envs.retrieval import RetrievalError

    with pytest.raises(RetrievalError, match="not an index directory"):
        SearchEnv(index_dir=tmp_path)


def test_shipped_tasks_load_through_load_tasks() -> None:
    tasks = search_tasks("test")
    assert len(tasks) == 200
    assert tasks[0].gold_answers and tasks[0].meta["hops"] in (1, 2)


# -- Search-R1 parquet ---------------------------------------------------------------------------------


def _write_search_r1_parquet(path: Path, with_originals: bool = True) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    prefix = "Answer the given question. ... Question: "
    rows = {
        "data_source": ["nq", "hotpotqa"],
        "prompt": [
            [{"content": prefix + "who got the first nobel prize in physics?\n", "role": "user"}],
            [
                {"content": "You are helpful.", "role": "system"},
                {"content": prefix + "which magazine was started first?\n", "role": "user"},
            ],
        ],
        "ability": ["fact-reasoning", "fact-reasoning"],
        "reward_model": [
            {"ground_truth": {"target": ["Wilhelm Conrad Röntgen"]}, "style": "rule"},
            {"ground_truth": {"target": ["Arthur's Magazine", "Arthurs Magazine"]}, "style": "rule"},
        ],
        "extra_info": [{"index": 0, "split": "train"}, {"index": 7, "split": "train"}],
    }
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
            ("ability", pa.string()),
            (
                "reward_model",
                pa.struct([("ground_truth", pa.struct([("target", pa.list_(pa.string()))])), ("style", pa.string())]),
            ),
            ("extra_info", pa.struct([("index", pa.int64()), ("split", pa.string())])),
        ]
    )
    table = pa.Table.from_pydict(rows, schema=schema)
    if with_originals:
        table = table.append_column("id", pa.array(["train_0", "train_7"]))
        table = table.append_column(
            "question", pa.array(["who got the first nobel prize in physics?", "which magazine was started first?"])
        )
    pq.write_table(table, path)


def test_search_r1_parquet_loader(tmp_path: Path) -> None:
    p = tmp_path / "train.parquet"
    _write_search_r1_parquet(p)
    tasks = load_search_r1_parquet(p)
    assert [t.id for t in tasks] == ["train_0", "train_7"]
    t0, t1 = tasks
    assert t0.question.endswith("who got the first nobel prize in physics?\n")
    assert t0.ground_truth == {"target": ["Wilhelm Conrad Röntgen"]}
    assert t0.gold_answers == ["Wilhelm Conrad Röntgen"]
    assert [m.role for m in t1.messages] == ["system", "user"]
    assert t1.meta == {
        "data_source": "hotpotqa",
        "ability": "fact-reasoning",
        "extra_info": {"index": 7, "split": "train"},
        "raw_question": "which magazine was started first?",
        "reward_style": "rule",
    }
    assert load_tasks(p) == tasks  # the generic loader dispatches on .parquet
    assert len(load_search_r1_parquet(p, limit=1)) == 1
    q = tmp_path / "bare.parquet"
    _write_search_r1_parquet(q, with_originals=False)
    assert [t.id for t in load_search_r1_parquet(q)] == ["nq-train-0", "hotpotqa-train-7"]


def test_search_r1_parquet_env_episode(tmp_path: Path, server: ServerProcess) -> None:
    """Real Search-R1 prompts are used verbatim (instruction=None), scored by EM on the targets."""
    p = tmp_path / "train.parquet"
    _write_search_r1_parquet(p)
    env = SearchEnv(retriever=server.url, tasks=str(p), format_kwargs={"instruction": None})
    obs, _ = env.reset(options={"task_index": 1})
    assert obs.endswith("which magazine was started first?\n")
    _, reward, term, _, _ = env.step("<answer>Arthurs Magazine</answer>")
    assert reward == 1.0 and term


def test_parquet_loader_errors(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    with pytest.raises(FileNotFoundError):
        load_search_r1_parquet(tmp_path / "nope.parquet")
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(ValueError, match="not a readable parquet file"):
        load_search_r1_parquet(bad)
    p = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"question": ["q"], "golden_answers": [["a"]]}), p)
    with pytest.raises(ValueError, match=r"lacks the Search-R1 column\(s\) \['prompt', 'reward_model'\]"):
        load_search_r1_parquet(p)
    p2 = tmp_path / "rows.parquet"
    pq.write_table(
        pa.table(
            {
                "prompt": [[{"role": "user", "content": "q"}], [{"role": "user", "content": "q2"}]],
                "reward_model": [{"ground_truth": {"target": ["a"]}}, {"ground_truth": {"other": ["a"]}}],
            }
        ),
        p2,
    )
    with pytest.raises(ValueError, match=r"rows.parquet row 1: 'reward_model.ground_truth.target' is missing"):
        load_search_r1_parquet(p2)
    p3 = tmp_path / "nouser.parquet"
    pq.write_table(
        pa.table(
            {"prompt": [[{"role": "system", "content": "s"}]], "reward_model": [{"ground_truth": {"target": "a"}}]}
        ),
        p3,
    )
    with pytest.raises(ValueError, match="row 0: 'prompt' holds no user message"):
        load_search_r1_parquet(p3)
