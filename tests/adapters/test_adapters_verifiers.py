"""rlf_envs.adapters.verifiers against the real `verifiers` package (its current API, verifiers.v1): `vf-eval
rlf_verifiers` runs rlf envs against an OpenAI-compatible server on loopback (tests/support/servers/fake_openai.py),
through verifiers' own interception server; rewards come from rlf's verifier and the tools run in rlf.
Run by `tox -e adapters`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verifiers.v1")


VF_EVAL = Path(sys.executable).parent / "vf-eval"


def vf_eval(fake: Any, out: Path, env_id: str, *args: str, n: int = 3) -> tuple[subprocess.CompletedProcess[str],
                                                                               list[dict[str, Any]]]:
    cmd = [str(VF_EVAL), "rlf_verifiers", "--env.taskset.env-id", env_id, "--env.agent.runtime.type", "subprocess",
           "-m", "fake", "--client.base-url", fake.url, "-n", str(n), "--no-push", "-o", str(out), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=out.parent,
                       env={**os.environ, "PRIME_API_KEY": "unused-on-loopback"})
    traces = [t for f in out.glob("*/traces.jsonl") for line in f.read_text().splitlines()
              for t in json.loads(line)["traces"]]
    return r, traces


def test_vf_eval_runs_calculator_with_rlf_tools_and_rlf_rewards(chat_server: Any, tmp_path: Path) -> None:
    fake = chat_server(mode="native")
    r, traces = vf_eval(fake, tmp_path / "out", "rlf/Calculator-v0", n=4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(traces) == 4 and fake.requests == 8  # two model turns per episode, all through verifiers
    from rlf_envs.envs.calculator import calculate

    for t in traces:
        assert t["ok"] and t["rewards"]["rlf"]["score"] == 1.0
        assert t["metrics"]["rlf_tool_calls"] == 1.0 and t["info"]["rlf_end_reason"] == "answer"
        msgs = [node["message"] for node in t["nodes"]]
        call = next(m for m in msgs if m.get("tool_calls"))["tool_calls"][0]
        tool = next(m for m in msgs if m["role"] == "tool")
        # the tool message is what rlf's calculator computed for the model's call
        assert tool["content"] == calculate(json.loads(call["arguments"])["expression"])
        assert {s["name"] for s in t["tools"]} == {"calculator"}


def run_in_process(fake: Any, env_id: str, env_kwargs: dict[str, Any], n: int) -> list[Any]:
    """verifiers' own Python entry: load_environment + Env.run_episode inside Env.serving()."""
    import asyncio

    import verifiers.v1 as vf
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    cfg = resolve_env_config({"taskset": {"id": "rlf_verifiers", "env_id": env_id, "env_kwargs": env_kwargs},
                              "agent": {"runtime": {"type": "subprocess"}}})
    env = load_environment(cfg)
    tasks = list(env.taskset.take(n))
    ctx = vf.ModelContext(model="fake", client=vf.EvalClientConfig(base_url=fake.url))

    async def run() -> list[Any]:
        async with env.serving():
            return list(await asyncio.gather(*(env.run_episode(t, ctx) for t in tasks)))

    return asyncio.run(run())


def test_wrong_answers_score_zero_on_search(chat_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Search-R1 tags in text: the search runs in rlf (the next user turn holds its <information>); the
    scripted answer is wrong, and rlf's exact-match verifier gives 0."""
    monkeypatch.setenv("PRIME_API_KEY", "unused-on-loopback")
    fake = chat_server(mode="search_r1")
    episodes = run_in_process(fake, "rlf/Search-v0", {"topk": 1}, n=2)
    assert len(episodes) == 2 and fake.requests == 4
    for ep in episodes:
        assert ep.ok
        t = ep.traces[0]
        assert t.rewards["rlf"].score == 0.0 and t.metrics["rlf_tool_calls"] == 1.0
        users = [n.message.content for n in t.nodes if n.message.role == "user"]
        assert any("<information>Doc 1" in str(u) for u in users)
        assert t.info["rlf_answer"] == "nobody knows"


def test_an_unknown_env_id_fails_with_its_name(chat_server: Any) -> None:
    from rlf_verifiers import RlfTaskset, RlfTasksetConfig

    with pytest.raises(ValueError, match="rlf/Nope-v0"):
        list(RlfTaskset(RlfTasksetConfig(id="rlf_verifiers", env_id="rlf/Nope-v0")).load())
    with pytest.raises(ValueError, match="text mode"):
        list(RlfTaskset(RlfTasksetConfig(id="rlf_verifiers", env_id="rlf/Calculator-v0",
                                         env_kwargs={"tokenizer": "any"})).load())
