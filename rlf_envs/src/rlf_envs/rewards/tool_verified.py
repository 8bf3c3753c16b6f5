"""Tool-verified rewards, generic form: call a tool (the env's or the verifier's own) and check its result.

Anything with `async call(name, arguments) -> ToolResult` is a `ToolInvoker` (the env's ToolCaller,
or `ToolsInvoker` wrapping plain `Tool` objects).
"""

from __future__ import annotations

import asyncio
import re
import string
import time
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlf_envs.rewards.base import ToolInvoker
from rlf_envs.rewards.common import ConfiguredVerifier
from rlf_envs.rewards.config import BuildContext, VerifierConfig, register_verifier
from rlf_envs.rewards.normalize import exact_match, normalize_answer
from rlf_envs.tools.base import Tool, ToolError
from rlf_envs.types import Score, Task, ToolCall, ToolResult, ToolStatus, Trajectory

_PLACEHOLDERS = frozenset({"answer", "question", "gold", "task_id"})


class ToolsInvoker:
    """A `ToolInvoker` over plain `Tool` objects, with a per-call deadline (errors become ToolResults)."""

    def __init__(self, tools: Iterable[Tool] | Mapping[str, Tool], *, timeout_s: float = 30.0) -> None:
        items = tools.values() if isinstance(tools, Mapping) else tools
        self.tools: dict[str, Tool] = {t.name: t for t in items}
        self.timeout_s = timeout_s

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        call = ToolCall(name=name, arguments=arguments)
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(call, f"unknown tool {name!r}; have {sorted(self.tools)}", ToolStatus.UNKNOWN_TOOL)
        t0 = time.monotonic()
        deadline = tool.timeout_s or self.timeout_s
        try:
            async with asyncio.timeout(deadline):
                out = await tool.call(arguments)
            status = ToolStatus.OK
        except TimeoutError:
            out, status = f"tool {name!r} timed out after {deadline}s", ToolStatus.TIMEOUT
        except ToolError as e:
            out, status = str(e), ToolStatus.ERROR
        except Exception as e:  # a broken tool is an error result, not a crash
            out, status = f"{type(e).__name__}: {e}", ToolStatus.ERROR
        return ToolResult(call, out, status, latency_s=time.monotonic() - t0)


def as_invoker(tools: ToolInvoker | Tool | Iterable[Tool] | Mapping[str, Tool] | None) -> ToolInvoker | None:
    """Accept an invoker, a single Tool, or a collection of Tools."""
    if tools is None:
        return None
    if isinstance(tools, Tool):  # checked first: a Tool also has a `call` method
        return ToolsInvoker([tools])
    if isinstance(tools, ToolInvoker):
        return tools
    return ToolsInvoker(tools)


def _fill(value: Any, fields: dict[str, str]) -> Any:
    """Substitute {answer}/{question}/{gold}/{task_id} in every string inside a JSON-like value."""
    if isinstance(value, str):
        return value.format(**fields)
    if isinstance(value, list):
        return [_fill(v, fields) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, fields) for k, v in value.items()}
    return value


def _check_templates(value: Any, path: str = "arguments") -> None:
    if isinstance(value, str):
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(value) if f is not None}
        except ValueError as e:
            raise ValueError(f"{path}: bad template ({e}); write literal braces as {{{{ and }}}}") from None
        if names - _PLACEHOLDERS:
            raise ValueError(
                f"{path}: unknown placeholder(s) {sorted(names - _PLACEHOLDERS)}; "
                f"allowed: {sorted(_PLACEHOLDERS)} (write literal braces as {{{{ and }}}})"
            )
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_templates(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_templates(v, f"{path}.{k}")


@register_verifier
class ToolCheckConfig(VerifierConfig):
    """Call `tool` with `arguments` (strings may use {answer}, {question}, {gold}, {task_id}) and check
    the result: `ok` (the call succeeded), `contains_gold` / `equals_gold` (normalised), or `regex`."""

    type: Literal["tool_check"] = "tool_check"
    tool: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=lambda: {"input": "{answer}"})
    expect: Literal["ok", "contains_gold", "equals_gold", "regex"] = "ok"
    pattern: str | None = None
    pass_value: float = 1.0
    fail_value: float = 0.0

    @field_validator("arguments")
    @classmethod
    def _templates(cls, v: dict[str, Any]) -> dict[str, Any]:
        _check_templates(v)
        return v

    @model_validator(mode="after")
    def _pattern(self) -> ToolCheckConfig:
        if self.expect == "regex":
            if not self.pattern:
                raise ValueError("expect: regex needs a 'pattern'")
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"pattern is not a valid regular expression: {e}") from None
        return self

    def build(self, ctx: BuildContext) -> ToolCheck:
        return ToolCheck(self, tools=ctx.tools)


class ToolCheck(ConfiguredVerifier[ToolCheckConfig]):
    """Generic tool-verified reward. `tools` may be given now or bound later with `bind`."""

    config_cls = ToolCheckConfig

    def __init__(
        self,
        config: ToolCheckConfig | None = None,
        *,
        tools: ToolInvoker | Tool | Iterable[Tool] | Mapping[str, Tool] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, **kwargs)
        self.invoker = as_invoker(tools)

    def bind(self, tools: ToolInvoker | Tool | Iterable[Tool] | Mapping[str, Tool]) -> ToolCheck:
        self.invoker = as_invoker(tools)
        return self

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        if self.invoker is None:
            raise RuntimeError(f"tool_check {self.name!r} has no tools; pass tools= to build_verifier or bind()")
        if trajectory.answer is None:
            return self.result(self.cfg.fail_value, {"no_answer": 1.0})
        golds = task.gold_answers
        fields = {
            "answer": trajectory.answer,
            "question": task.question,
            "gold": golds[0] if golds else "",
            "task_id": task.id,
        }
        res = await self.invoker.call(self.cfg.tool, _fill(self.cfg.arguments, fields))
        extra = {"tool_ok": float(res.ok)}
        c = self.cfg
        if not res.ok:
            ok = False
        elif c.expect == "ok":
            ok = True
        elif c.expect == "regex":
            ok = re.search(c.pattern or "", res.content) is not None
        elif c.expect == "equals_gold":
            ok = exact_match(res.content, golds)
        else:
            out = normalize_answer(res.content)
            ok = any(normalize_answer(g) in out for g in golds)
        return self.result(c.pass_value if ok else c.fail_value, extra)
