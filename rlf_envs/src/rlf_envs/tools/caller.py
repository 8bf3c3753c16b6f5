"""The async tool caller: every call of a batch (all calls of all envs of a vector step) at once.

Per-call deadline (covers queueing, execution and every retry: one total budget per call), bounded
retries with exponential backoff for idempotent tools only, per-tool and global concurrency limits,
output truncation with a visible marker, and metrics. Any failure becomes a ToolResult with a non-OK
status and a message the policy reads; `call_batch` never raises for a tool's fault and never waits past the deadlines.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import jsonschema
import pydantic

from rlf_envs.tools.base import InvalidArguments, Tool, ToolCrashed, ToolError
from rlf_envs.tools.deadlines import DeadlineWheel
from rlf_envs.tools.limits import Limiter
from rlf_envs.types import ToolCall, ToolResult, ToolStatus

#: a retry is started only if at least this much of the call's deadline is left after its backoff
MIN_ATTEMPT_S = 0.01


class CallerConfig(pydantic.BaseModel):
    """Limits of the tool caller (YAML-configurable)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    timeout_s: float = pydantic.Field(30.0, gt=0, description="default per-call deadline (all attempts together)")
    max_retries: int = pydantic.Field(
        2, ge=0, le=10, description="extra attempts, idempotent tools only, within the call's deadline"
    )
    retry_backoff_s: float = pydantic.Field(0.05, ge=0)
    max_concurrency: int = pydantic.Field(1024, ge=1, description="calls in flight across all tools")
    max_output_chars: int = pydantic.Field(16_384, ge=64, description="longer outputs are truncated with a marker")
    validate_arguments: bool = True


@dataclass(slots=True)
class ToolStats:
    """Counters for one tool (or the total)."""

    calls: int = 0
    ok: int = 0
    errors: int = 0
    timeouts: int = 0
    invalid_args: int = 0
    unknown_tool: int = 0
    crashed: int = 0
    truncated: int = 0
    retries: int = 0
    latency_total_s: float = 0.0
    latency_max_s: float = 0.0

    @property
    def latency_mean_s(self) -> float:
        return self.latency_total_s / self.calls if self.calls else 0.0

    def add(self, r: ToolResult) -> None:
        self.calls += 1
        s = r.status
        if s is ToolStatus.OK:
            self.ok += 1
        elif s is ToolStatus.TIMEOUT:
            self.timeouts += 1
        elif s is ToolStatus.INVALID_ARGS:
            self.invalid_args += 1
        elif s is ToolStatus.UNKNOWN_TOOL:
            self.unknown_tool += 1
        elif s is ToolStatus.CRASHED:
            self.crashed += 1
        else:
            self.errors += 1
        self.truncated += r.truncated
        self.retries += r.attempts - 1
        self.latency_total_s += r.latency_s
        if r.latency_s > self.latency_max_s:
            self.latency_max_s = r.latency_s

    @property
    def failures(self) -> int:
        return self.calls - self.ok


@dataclass
class CallerMetrics:
    per_tool: dict[str, ToolStats] = field(default_factory=dict)
    total: ToolStats = field(default_factory=ToolStats)

    def add(self, r: ToolResult) -> None:
        self.total.add(r)
        st = self.per_tool.get(r.call.name)
        if st is None:
            st = self.per_tool[r.call.name] = ToolStats()
        st.add(r)


def clean_text(text: str) -> str:
    """`text` as valid UTF-8: a tool's output may hold lone surrogates (JSON `"\\ud800"`), which tokenizers
    and UTF-8 writers refuse. Replaced by `?`."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def truncate(text: str, limit: int) -> tuple[str, bool]:
    """Cut `text` to `limit` characters with a visible marker saying how much was dropped."""
    if len(text) <= limit:
        return text, False
    dropped = len(text) - limit
    return f"{text[:limit]}\n...[truncated: {dropped} more characters]", True


class ToolCaller:
    """Runs tool calls concurrently with deadlines, retries, limits and metrics.

    Must be used from a single event loop (rlf uses the process-wide runtime loop; see runtime.py).
    """

    def __init__(self, tools: Iterable[Tool], config: CallerConfig | None = None) -> None:
        self.config = config or CallerConfig()
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self.tools:
                raise ValueError(
                    f"two tools are named {t.name!r}; tool names must be unique in an env "
                    "(rename one, or give MCP servers a `prefix`)"
                )
            self.tools[t.name] = t
        self.metrics = CallerMetrics()
        self._global = Limiter(self.config.max_concurrency)
        self._deadlines = DeadlineWheel()
        self._validators: dict[str, jsonschema.protocols.Validator] = {}

    def _validate(self, tool: Tool, arguments: object) -> str | None:
        if not isinstance(arguments, dict):
            return f"arguments must be a JSON object, got {type(arguments).__name__}"
        if not self.config.validate_arguments or tool.validates_arguments:
            return None
        v = self._validators.get(tool.name)
        if v is None:
            cls = jsonschema.validators.validator_for(tool.spec.parameters, default=jsonschema.Draft202012Validator)
            v = self._validators[tool.name] = cls(tool.spec.parameters)
        err = jsonschema.exceptions.best_match(v.iter_errors(arguments))
        if err is None:
            return None
        where = ".".join(str(p) for p in err.absolute_path) or "(arguments)"
        return f"{where}: {err.message}"

    async def _attempt(self, tool: Tool, call: ToolCall, deadline: float) -> str:
        sem = tool.concurrency_gate()
        async with self._deadlines.deadline(deadline), self._global:
            if sem is None:
                return await invoke(tool, call)
            async with sem:
                return await invoke(tool, call)

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one call; always returns a ToolResult (never raises for the tool's faults)."""
        t0 = time.perf_counter()
        tool = self.tools.get(call.name)
        attempts = 1
        try:
            if tool is None:
                names = ", ".join(sorted(self.tools)) or "(none)"
                res = ToolResult(call, f"Error: unknown tool {call.name!r}. Available tools: {names}.",
                                 ToolStatus.UNKNOWN_TOOL)
            elif (problem := self._validate(tool, call.arguments)) is not None:
                res = ToolResult(call, f"Error: invalid arguments for {tool.name}: {problem}",
                                 ToolStatus.INVALID_ARGS)
            else:
                budget = tool.timeout_s or self.config.timeout_s  # for all attempts together
                end = t0 + budget
                max_attempts = 1 + (self.config.max_retries if tool.idempotent else 0)
                while True:
                    status = ToolStatus.OK
                    try:
                        content = await self._attempt(tool, call, max(end - time.perf_counter(), 0.0))
                        if not isinstance(content, str):
                            content = str(content)
                    except TimeoutError as e:
                        status = ToolStatus.TIMEOUT
                        content = str(e) if e.args else f"Error: tool {tool.name} timed out after {budget:g}s."
                    except InvalidArguments as e:
                        status, content = ToolStatus.INVALID_ARGS, f"Error: {e}"
                    except ToolCrashed as e:
                        status, content = ToolStatus.CRASHED, f"Error: tool {tool.name} is unavailable ({e})."
                    except ToolError as e:
                        status, content = ToolStatus.ERROR, f"Error: {e}"
                    except asyncio.CancelledError:
                        raise
                    except Exception as e:
                        status, content = ToolStatus.ERROR, f"Error: {tool.name} failed: {type(e).__name__}: {e}"
                    if status in (ToolStatus.TIMEOUT, ToolStatus.CRASHED) and attempts < max_attempts:
                        backoff = self.config.retry_backoff_s * (2 ** (attempts - 1))
                        if end - time.perf_counter() - backoff > MIN_ATTEMPT_S:  # a retry only within the budget
                            await asyncio.sleep(backoff)
                            attempts += 1
                            continue
                    break
                if attempts > 1 and status is not ToolStatus.OK:
                    spent = time.perf_counter() - t0
                    content += f" ({attempts} attempts in {spent:.1f}s; the call's deadline is {budget:g}s in total)"
                res = ToolResult(call, content, status, attempts=attempts)
        except Exception as e:  # e.g. RecursionError validating arguments nested ~1,000 deep
            res = ToolResult(call, f"Error: the call to {call.name} failed: {type(e).__name__}.", ToolStatus.ERROR,
                             attempts=attempts)
        res.content, res.truncated = truncate(clean_text(res.content), self.config.max_output_chars)
        res.latency_s = time.perf_counter() - t0
        self.metrics.add(res)
        return res

    async def call_batch(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run all calls concurrently; results in the order of `calls`."""
        if not calls:
            return []
        if len(calls) == 1:
            return [await self.call(calls[0])]
        return list(await asyncio.gather(*(self.call(c) for c in calls)))


async def invoke(tool: Tool, call: ToolCall) -> str:
    """The tool's call; a tool that takes the env's per-episode context gets the one bound to this call."""
    if tool.takes_context:
        return await tool.call(call.arguments, call.context)  # type: ignore[call-arg]
    return await tool.call(call.arguments)
