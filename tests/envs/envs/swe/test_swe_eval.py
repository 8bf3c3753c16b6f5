"""`python -m rlf_envs.eval --env rlf/SWE-v0` against a scripted OpenAI-compatible server on loopback: the server
plays a ReAct-style repair agent (run the failing tests, apply the gold fix hunk by hunk with `edit`, submit) on
rlf's held-out split, through native tool calls; the trajectory viewer's records show the commands and outputs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from repo_paths import REPO

from rlf_envs.envs.swe.baseline import hunks
from rlf_envs.envs.swe.tasks import shipped_tasks
from rlf_envs.envs.swe.verify import split_patch
from tests.support.servers.fake_openai import FakeChatServer, RunningServer

pytest.importorskip("openai", reason="rlf_envs.eval needs the openai client (rlf-envs[openai])")


def _skip_without_sessions() -> None:
    if os.geteuid() != 0:
        pytest.skip("the local session backend needs root")
    from rlf_envs.sandbox.sessions.images import debian_test_image

    if debian_test_image() is None:
        pytest.skip("no Debian test image: run `python -m rlf_envs.sandbox.sessions.images build-debian`")


class RepairServer(FakeChatServer):
    """Replies by the number of tool results so far: bash (failing tests), one edit per gold hunk, submit."""

    def reply(self, messages: list[dict[str, Any]], model: str) -> dict[str, Any]:
        first_user = next(m["content"] for m in messages if m["role"] == "user")
        task = next(t for t in shipped_tasks("test") if t.meta["swe"]["problem_statement"] in first_user)
        swe = task.meta["swe"]
        plan: list[tuple[str, dict[str, Any]]] = [("bash", {"command": "python3 -m pytest -q -o addopts= "
                                                            + swe["FAIL_TO_PASS"][0] + " 2>&1 | tail -5"})]
        for _, path, text in split_patch(swe["patch"]):
            plan += [("edit", {"path": path, "old": old, "new": new}) for old, new in hunks(text)]
        plan.append(("submit", {}))
        done = sum(1 for m in messages if m["role"] == "tool")
        name, args = plan[min(done, len(plan) - 1)]
        msg = {"role": "assistant", "content": "Let me look." if done == 0 else None,
               "tool_calls": [{"id": f"call_{self.requests}", "type": "function",
                               "function": {"name": name, "arguments": json.dumps(args)}}]}
        return {"id": f"chatcmpl-{self.requests}", "object": "chat.completion", "created": 0, "model": model,
                "choices": [{"index": 0, "message": msg, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


def test_eval_cli_on_held_out_split_with_scripted_react_server(tmp_path: Path, capsys: Any) -> None:
    _skip_without_sessions()
    from rlf_envs.eval import main
    from rlf_envs.records import read_records, step_path

    fake = RepairServer()
    server = RunningServer(fake)
    try:
        rc = main(["--env", "rlf/SWE-v0", "--base-url", fake.url, "--model", "scripted", "-n", "3",
                   "--concurrency", "3", "--env-kwargs", '{"split": "test"}', "--out", str(tmp_path),
                   "--no-progress", "--request-timeout", "30", "--episode-timeout", "300"])
    finally:
        server.stop()
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["episodes"] == 3 and summary["success_rate"] == 1.0 and summary["policy_errors"] == 0
    assert fake.bodies[0]["tools"][0]["function"]["name"] == "bash"
    recs = read_records(step_path(tmp_path, 0))
    r = recs[0]
    assert r.turns[0].kind == "tool_calls" and r.turns[0].results[0].status == "ok"
    shown = json.dumps(r.model_dump() if hasattr(r, "model_dump") else r.__dict__, default=str)
    assert "pytest" in shown and "[exit code" in shown  # the command and its output are in the record
    assert r.end_reason == "submit" and r.success


def test_react_agent_example_through_the_openai_sdk() -> None:
    """examples/swe_agent/agent.py (what `rollout.agent` trains) against the scripted server: reward 1.0."""
    _skip_without_sessions()
    import asyncio
    import importlib.util

    import openai

    spec = importlib.util.spec_from_file_location("swe_agent", REPO / "examples" / "swe_agent"
                                                  / "agent.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fake = RepairServer()
    server = RunningServer(fake)
    try:
        async def go() -> list[float]:
            client = openai.AsyncOpenAI(base_url=fake.url, api_key="x", timeout=60, max_retries=0)
            try:
                return [await mod.agent(t, client) for t in shipped_tasks("test")[:2]]
            finally:
                await client.close()

        rewards = asyncio.run(go())
    finally:
        server.stop()
    assert rewards == [1.0, 1.0]
    assert any(m.get("role") == "tool" and "[exit code" in (m.get("content") or "") for b in fake.bodies
               for m in b["messages"])
