"""rlf's AgentExecutor inside OpenRLHF (tox -e openrlhf): loaded by OpenRLHF's own loader, run through whole
episodes against CPU stand-ins of the vLLM actor, and turned into Experiences by OpenRLHF's own code."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from openrlhf_support import openrlhf_modules, read_jsonl, scripted_search_policy, search_config

from rlf_envs.env.tool_env import ToolEnv
from rlf_train.openrlhf import standin
from rlf_train.openrlhf.data import task_from_label, write_prompts
from rlf_train.openrlhf.executor import CONFIG_ENV, RlfAgentExecutor
from rlf_train.openrlhf.launcher import AGENT_FILE
from rlf_train.policy.model import build_tiny_model
from rlf_train.policy.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def setup(bm25_index_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("orl")
    cfg = search_config(bm25_index_dir, run_dir)
    tok = load_tokenizer(cfg.model)
    model = build_tiny_model(cfg.model, len(tok), seed=0, pad_token_id=tok.pad_token_id)
    train, _, _ = write_prompts(cfg, run_dir / "data")
    rows = read_jsonl(train)
    return {"cfg": cfg, "tok": tok, "model": model, "rows": rows,
            "tasks": [task_from_label(r["label"])[0] for r in rows]}


def params(**kw: Any) -> standin.SamplingParams:
    """As OpenRLHF's SamplesGenerator builds them (max_tokens None: dynamic; logprobs when IS-correcting)."""
    base = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": None, "min_tokens": 1,
            "skip_special_tokens": False, "logprobs": None}
    base.update(kw)
    return standin.SamplingParams(**base)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def experience(response: dict[str, Any], max_len: int) -> Any:
    _, samples_generator = openrlhf_modules()
    return samples_generator.SamplesGenerator._process_response_into_experience(None, response, max_len=max_len)


def test_openrlhf_loads_the_shipped_agent_file_by_path(monkeypatch: pytest.MonkeyPatch, setup: dict[str, Any]) -> None:
    from openrlhf.utils.agent import AgentExecutorBase

    vllm_engine, _ = openrlhf_modules()
    monkeypatch.setenv(CONFIG_ENV, setup["cfg"].model_dump_json())
    executor = vllm_engine._load_agent_executor(str(AGENT_FILE))  # OpenRLHF's loader, as its rollout actor calls it
    assert isinstance(executor, AgentExecutorBase) and isinstance(executor, RlfAgentExecutor)
    assert executor.cfg == setup["cfg"]
    monkeypatch.delenv(CONFIG_ENV)
    with pytest.raises(RuntimeError, match=CONFIG_ENV):
        vllm_engine._load_agent_executor(str(AGENT_FILE))


def test_scripted_episodes_rewards_ranges_and_openrlhf_experience(setup: dict[str, Any]) -> None:
    cfg, tok = setup["cfg"], setup["tok"]
    engine = standin.ScriptedEngine(scripted_search_policy(setup["tasks"]), tok)
    ex = RlfAgentExecutor(cfg)
    max_len = cfg.rollout.max_total_tokens

    async def go() -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(ex.execute(r["prompt"], r["label"], params(), max_len, tok, engine)
                                           for r in setup["rows"])))

    responses = run(go())
    assert engine.calls == 2 * len(responses)  # search, then answer
    for r in responses:
        ids, ranges = r["observation_tokens"], r["action_ranges"]
        assert r["reward"] == 1.0 and r["scores"] == 1.0 and r["truncated"] is False
        logs = r["extra_logs"]
        assert logs["rlf_tool_calls"] == 1 and logs["rlf_tool_errors"] == 0 and logs["rlf_turns"] == 2
        assert logs["rlf_end_answer"] == 1 and logs["rlf_success"] == 1 and logs["rlf_episode_error"] == 0
        assert len(ranges) == 2 and all(e > s for s, e in ranges)
        first = tok.decode(ids[ranges[0][0]:ranges[0][1]])
        assert first.endswith("</search>") and "more text" not in first  # stopped at the stop string
        assert tok.decode(ids[:ranges[0][0]]) == r["prompt"]  # the env's prompt ids are the dataset's prompt
        obs = tok.decode(ids[ranges[0][1]:ranges[1][0]])
        assert obs.startswith("\n\n<information>") and obs.endswith("</information>\n\n")
        mask = [0] * len(ids)
        for s, e in ranges:
            mask[s:e] = [1] * (e - s)
        exp = experience(r, max_len)
        assert exp.sequences[0].tolist() == ids
        assert exp.action_mask[0].tolist() == mask[1:]  # OpenRLHF shifts by one: mask[t] is for token t+1
        assert exp.rewards.tolist() == [1.0] and float(exp.info["rlf_tool_calls"][0]) == 1.0


def test_the_env_trajectory_is_what_openrlhf_trains_on(setup: dict[str, Any]) -> None:
    """Token in / token out: the ids and loss mask of the env's own trajectory are the Experience's."""
    cfg, tok = setup["cfg"], setup["tok"]
    ex = RlfAgentExecutor(cfg)
    engine = standin.ScriptedEngine(scripted_search_policy(setup["tasks"]), tok)
    row = setup["rows"][0]
    seen: list[Any] = []
    orig = ToolEnv.astep

    async def spy(self: ToolEnv, action: Any) -> Any:
        out = await orig(self, action)
        seen.append(self)
        return out

    ToolEnv.astep = spy  # type: ignore[method-assign]
    try:
        r = run(ex.execute(row["prompt"], row["label"], params(), 512, tok, engine))
    finally:
        ToolEnv.astep = orig  # type: ignore[method-assign]
    traj = seen[-1].trajectory
    assert r["observation_tokens"] == traj.token_ids
    exp = experience(r, 512)
    assert exp.action_mask[0].tolist() == traj.loss_mask[1:]


def test_model_engine_budgets_and_rollout_logprobs(setup: dict[str, Any]) -> None:
    """A random tiny policy rambles: every turn is cut at the per-turn cap, the episode at max_length, and the
    rollout logprobs are the policy's (temperature-scaled) logprobs of exactly the action tokens, with EOS
    masked at each turn's first token (min_tokens=1, as vLLM does; test_vllm_executor.py beside this checks vLLM)."""
    cfg, tok, model = setup["cfg"], setup["tok"], setup["model"]
    engine = standin.ModelEngine(model, tok, seed=1)
    ex = RlfAgentExecutor(cfg)
    row = setup["rows"][1]
    prompt_len = len(tok.encode(row["prompt"], add_special_tokens=False))
    for max_len in (prompt_len + 20, 512):
        r = run(ex.execute(row["prompt"], row["label"], params(temperature=0.7, logprobs=1), max_len, tok, engine))
        ids, ranges, lps = r["observation_tokens"], r["action_ranges"], r["rollout_log_probs"]
        assert len(ids) <= max_len and len(lps) == len(ids)
        assert ranges and all(e - s <= cfg.rollout.max_new_tokens_per_turn for s, e in ranges)
        assert len(ranges) <= cfg.rollout.max_turns
        exp = experience(r, max_len)
        assert exp.sequences.shape[1] == len(ids)  # nothing for OpenRLHF to cut
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float() / 0.7
        want = torch.log_softmax(logits, -1)
        no_eos = logits.clone()
        no_eos[:, tok.eos_token_id] = -torch.inf
        want_first = torch.log_softmax(no_eos, -1)
        in_action = set()
        for s, e in ranges:
            in_action.update(range(s, e))
            for t in range(s, e):
                expect = want_first if t == s else want
                assert lps[t] == pytest.approx(float(expect[t - 1, ids[t]]), abs=2e-4)
        assert all(lps[t] == 0.0 for t in range(len(ids)) if t not in in_action)
        assert exp.rollout_log_probs[0].tolist() == pytest.approx(lps[1:])
    assert r["extra_logs"]["rlf_invalid_actions"] >= 1  # rambling is invalid: corrective observations


def test_prompt_longer_than_max_length_returns_an_empty_sample(setup: dict[str, Any]) -> None:
    cfg, tok = setup["cfg"], setup["tok"]
    engine = standin.ScriptedEngine(scripted_search_policy(setup["tasks"]), tok)
    row = setup["rows"][0]
    r = run(RlfAgentExecutor(cfg).execute(row["prompt"], row["label"], params(), 8, tok, engine))
    assert engine.calls == 0 and r["action_ranges"] == [] and r["reward"] == 0.0


def test_failures_inside_an_episode_never_escape_execute(setup: dict[str, Any], tmp_path: Path) -> None:
    cfg, tok = setup["cfg"], setup["tok"]
    engine = standin.ScriptedEngine(scripted_search_policy(setup["tasks"]), tok)
    row = setup["rows"][0]
    # a retrieval server that is down: the search fails, the policy reads the error, answers, gets its reward
    down = search_config(Path("."), tmp_path, **{"env.kwargs": {"format": "search_r1", "topk": 1,
                                                                 "retriever": "http://127.0.0.1:9",
                                                                 "request_timeout_s": 2}})
    r = run(RlfAgentExecutor(down).execute(row["prompt"], row["label"], params(), 512, tok, engine))
    assert r["extra_logs"]["rlf_tool_errors"] == 1 and r["extra_logs"]["rlf_episode_error"] == 0
    assert r["reward"] == 1.0
    # a broken env (a bug in a user's env): that sample gets reward 0 and is counted; training goes on
    ex = RlfAgentExecutor(cfg)
    orig = ToolEnv.astep

    async def broken(self: ToolEnv, action: Any) -> Any:
        raise RuntimeError("boom")

    ToolEnv.astep = broken  # type: ignore[method-assign]
    try:
        r = run(ex.execute(row["prompt"], row["label"], params(logprobs=1), 512, tok, engine))
    finally:
        ToolEnv.astep = orig  # type: ignore[method-assign]
    assert r["reward"] == 0.0 and r["extra_logs"]["rlf_episode_error"] == 1
    assert len(r["rollout_log_probs"]) == len(r["observation_tokens"])
    experience(r, 512)  # still a valid sample for OpenRLHF

    # a failing engine is not the env's fault: OpenRLHF sees it (no silent reward-0 samples)
    class DeadEngine:
        async def generate(self, *a: Any, **k: Any) -> Any:
            raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        run(ex.execute(row["prompt"], row["label"], params(), 512, tok, DeadEngine()))


def test_many_episodes_with_a_slow_retriever_never_block_the_actor_loop(setup: dict[str, Any], tmp_path: Path) -> None:
    """64 concurrent `execute` calls on one loop (as `generate_responses` gathers them) against a retrieval
    server that takes 2 s per search: the searches overlap and the loop's heartbeat never stalls for a search.
    (A first round with an instant server fills the executor's env pool, as a rollout actor's first batch
    does; the measured round is the second.)"""
    from aiohttp import web

    tok = setup["tok"]
    delay = {"s": 0.0}
    n = 64
    rows = [setup["rows"][k % len(setup["rows"])] for k in range(n)]
    engine = standin.ScriptedEngine(scripted_search_policy(setup["tasks"]), tok)

    async def retrieve(request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(delay["s"])
        hits = [[{"document": {"id": "1", "contents": "\"Doc\"\nnothing here"}, "score": 1.0}]
                for _ in body["queries"]]
        return web.json_response({"result": hits})

    async def go() -> tuple[float, float, list[dict[str, Any]]]:
        app = web.Application()
        app.router.add_post("/retrieve", retrieve)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        slow = search_config(Path("."), tmp_path, **{"env.kwargs": {
            "format": "search_r1", "topk": 1, "retriever": f"http://127.0.0.1:{port}", "request_timeout_s": 30}})
        ex = RlfAgentExecutor(slow)

        def batch() -> Any:
            return asyncio.gather(*(ex.execute(r["prompt"], r["label"], params(), 512, tok, engine) for r in rows))

        worst = 0.0
        stop = asyncio.Event()

        async def heartbeat() -> None:
            nonlocal worst
            while not stop.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.01)
                worst = max(worst, time.perf_counter() - t - 0.01)

        try:
            await batch()  # warm-up: builds the env pool
            delay["s"] = 2.0
            hb = asyncio.create_task(heartbeat())
            t0 = time.perf_counter()
            out = await batch()
            wall = time.perf_counter() - t0
            stop.set()
            await hb
        finally:
            await runner.cleanup()
        return wall, worst, list(out)

    wall, worst, out = run(go())
    assert all(r["extra_logs"]["rlf_tool_calls"] == 1 and r["extra_logs"]["rlf_tool_errors"] == 0 for r in out)
    assert wall < n * 2.0 / 4, f"searches did not overlap: {wall:.1f}s for {n} x 2 s"
    assert worst < 2.0 * 0.9, f"the loop stalled {worst:.2f}s (a search ran on it)"
