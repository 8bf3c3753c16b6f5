"""Generic tool-verified reward: call a tool (the env's or the verifier's own) and check its result."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rlf_envs.rewards import ToolCheck, ToolInvoker, ToolsInvoker, build_verifier
from rlf_envs.tools.base import Tool, ToolError, ToolSpec
from rlf_envs.types import Task, ToolCall, ToolResult, ToolStatus, Trajectory


class Calculator(Tool):
    spec = ToolSpec("calc", "evaluate arithmetic", {"type": "object", "properties": {"expr": {"type": "string"}}})

    async def call(self, arguments: dict[str, Any]) -> str:
        expr = arguments["expr"]
        if not set(expr) <= set("0123456789+-*/(). "):
            raise ToolError(f"unsupported characters in {expr!r}")
        return str(eval(expr, {"__builtins__": {}}))  # restricted to arithmetic characters above


class Lookup(Tool):
    spec = ToolSpec("lookup", "look up an entity")
    timeout_s = 0.2

    async def call(self, arguments: dict[str, Any]) -> str:
        if arguments.get("q") == "slow":
            await asyncio.sleep(120)
        if arguments.get("q") == "bug":
            raise KeyError("boom")
        return f"Result for {arguments.get('q')}: capital of France is Paris"


class RecordingInvoker:
    """Stands in for the env's ToolCaller: anything with async call(name, arguments) -> ToolResult."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        self.calls.append((name, arguments))
        return ToolResult(ToolCall(name, arguments), "42", ToolStatus.OK)


def traj(answer: str | None, gold: object = "42", tid: str = "k1") -> Trajectory:
    return Trajectory(Task(tid, "What is 6*7?", gold), "P", [], answer)


async def val(v: ToolCheck, t: Trajectory) -> float:
    return (await v.safe_score(t, t.task)).value


@pytest.mark.asyncio
async def test_tool_check_equals_gold_with_own_tool() -> None:
    v = ToolCheck(tool="calc", arguments={"expr": "{answer}"}, expect="equals_gold", tools=Calculator())
    assert await val(v, traj("6*7")) == 1.0
    assert await val(v, traj("6*8")) == 0.0
    s = await v.score(traj("import os"), traj("import os").task)  # the tool errors -> fail, not crash
    assert s.value == 0.0 and s.info["tool_check/tool_ok"] == 0.0
    assert (await v.score(traj(None), traj(None).task)).info["tool_check/no_answer"] == 1.0


@pytest.mark.asyncio
async def test_tool_check_from_yaml_with_env_invoker() -> None:
    inv = RecordingInvoker()
    assert isinstance(inv, ToolInvoker)
    v = build_verifier({"type": "tool_check", "tool": "python", "expect": "regex", "pattern": r"^\d+$",
                        "arguments": {"code": "print({answer})", "meta": ["{task_id}", "{question}"]}}, tools=inv)
    assert await val(v, traj("6*7")) == 1.0  # type: ignore[arg-type]
    assert inv.calls == [("python", {"code": "print(6*7)", "meta": ["k1", "What is 6*7?"]})]


@pytest.mark.asyncio
async def test_contains_gold_timeouts_and_errors_via_tools_invoker(caplog: pytest.LogCaptureFixture) -> None:
    tools = ToolsInvoker([Calculator(), Lookup()], timeout_s=5)
    v = ToolCheck(tool="lookup", arguments={"q": "{answer}"}, expect="contains_gold", tools=tools)
    assert await val(v, traj("france", gold=["Paris"])) == 1.0
    assert await val(v, traj("france", gold=["Berlin"])) == 0.0
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await val(v, traj("slow", gold=["Paris"])) == 0.0  # the tool's own 0.2 s deadline
    assert loop.time() - t0 < 60  # the deadline fired: the tool sleeps 120 s (a generous bound)
    assert await val(v, traj("bug", gold=["Paris"])) == 0.0
    res = await tools.call("lookup", {"q": "slow"})
    assert res.status is ToolStatus.TIMEOUT
    assert (await tools.call("nope", {})).status is ToolStatus.UNKNOWN_TOOL
    unknown = ToolCheck(tool="nope", tools=tools)
    assert await val(unknown, traj("x")) == 0.0


@pytest.mark.asyncio
async def test_missing_tools_is_logged_fallback_and_bind_fixes_it(caplog: pytest.LogCaptureFixture) -> None:
    v = build_verifier({"type": "tool_check", "tool": "calc", "arguments": {"expr": "{answer}"},
                        "expect": "equals_gold", "fallback": -1})
    assert isinstance(v, ToolCheck)
    t = traj("6*7", tid="unbound-1")
    assert (await v.safe_score(t, t.task)).value == -1
    assert "unbound-1" in caplog.text and "no tools" in caplog.text
    v.bind([Calculator()])
    assert (await v.safe_score(t, t.task)).value == 1.0
