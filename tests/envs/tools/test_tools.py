"""Tools from Python functions and HTTP endpoints, and the async tool caller's guarantees."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest
from aiohttp import web

from rlf_envs import runtime
from rlf_envs.tools import (
    CallerConfig,
    FunctionTool,
    HTTPTool,
    InvalidArguments,
    Tool,
    ToolCaller,
    ToolCrashed,
    ToolError,
    ToolSpec,
    tool,
)
from rlf_envs.tools.limits import Limiter
from rlf_envs.types import ToolCall, ToolStatus


def run(coro: Any) -> Any:
    return runtime.run(coro)


# ---------------------------------------------------------------------------------------------- Python tools
def test_function_tool_schema_from_hints_and_docstring() -> None:
    @tool(idempotent=True)
    def lookup(city: str, limit: int = 3, exact: bool = False) -> list[str]:
        """Find places in a city.

        Args:
            city: the city name
            limit: how many results
                to return at most
        Returns:
            names
        """
        return [city] * limit

    assert isinstance(lookup, FunctionTool)
    spec = lookup.spec
    assert spec.name == "lookup"
    assert spec.description == "Find places in a city."
    props = spec.parameters["properties"]
    assert props["city"] == {"type": "string", "description": "the city name"}
    assert props["limit"] == {"type": "integer", "description": "how many results to return at most"}  # no default (HF)
    assert props["limit"]["description"] == "how many results to return at most"
    assert spec.parameters["required"] == ["city"]
    assert lookup.idempotent
    assert run(lookup.call({"city": "Oslo", "limit": 2})) == '["Oslo", "Oslo"]'
    assert spec.to_openai()["function"]["name"] == "lookup"


def test_function_tool_rejects_bad_arguments_and_signatures() -> None:
    @tool
    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    with pytest.raises(InvalidArguments, match=r"a: Input should be a valid integer"):
        run(add.call({"a": "x", "b": 1}))
    with pytest.raises(InvalidArguments, match=r"b: Field required"):
        run(add.call({"a": 1}))
    with pytest.raises(InvalidArguments, match=r"c: Extra inputs"):
        run(add.call({"a": 1, "b": 2, "c": 3}))

    def untyped(a, b: int) -> int:  # type: ignore[no-untyped-def]
        return b

    with pytest.raises(TypeError, match="parameter 'a' has no type hint"):
        FunctionTool(untyped)

    def star(*args: int) -> int:
        return 0

    with pytest.raises(TypeError, match=r"\*args"):
        FunctionTool(star)


def test_sync_tools_run_off_the_event_loop() -> None:
    seen: list[str] = []

    @tool
    def where() -> str:
        """Report the thread."""
        seen.append(threading.current_thread().name)
        return "ok"

    caller = ToolCaller([where])
    res = run(caller.call(ToolCall("where", {})))
    assert res.ok and seen and seen[0] != "rlf-runtime"


# ---------------------------------------------------------------------------------------------- caller
class Flaky(Tool):
    """Crashes `failures` times, then answers; counts attempts and peak concurrency."""

    def __init__(self, name: str, failures: int = 0, idempotent: bool = False, delay: float = 0.0,
                 max_concurrency: int | None = None, exc: type[Exception] = ToolCrashed) -> None:
        self.spec = ToolSpec(name, "flaky", {"type": "object", "properties": {"x": {"type": "integer"}}})
        self.failures, self.idempotent, self.delay = failures, idempotent, delay
        self.max_concurrency, self.exc = max_concurrency, exc
        self.attempts = self.inflight = self.peak = 0

    async def call(self, arguments: dict[str, Any]) -> str:
        self.attempts += 1
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.attempts <= self.failures:
                raise self.exc("boom")
            return f"x={arguments.get('x')}"
        finally:
            self.inflight -= 1


def test_deadline_holds_and_other_calls_finish() -> None:
    slow = Flaky("slow", delay=120.0)
    fast = Flaky("fast")
    caller = ToolCaller([slow, fast], CallerConfig(timeout_s=2.0))  # fast answers in time on a busy machine
    t0 = time.perf_counter()
    res = run(caller.call_batch([ToolCall("slow", {}), ToolCall("fast", {"x": 1})]))
    elapsed = time.perf_counter() - t0
    assert elapsed < 60.0  # the 0.2 s deadline fired, not the 120 s tool (a generous bound)
    assert res[0].status is ToolStatus.TIMEOUT and "timed out after 2s" in res[0].content
    assert res[1].ok and res[1].content == "x=1"
    assert caller.metrics.total.timeouts == 1 and caller.metrics.per_tool["fast"].ok == 1


def test_retries_only_for_idempotent_tools_and_bounded() -> None:
    cfg = CallerConfig(max_retries=2, retry_backoff_s=0.001)
    ok_after_two = Flaky("idem", failures=2, idempotent=True)
    not_idem = Flaky("once", failures=1, idempotent=False)
    always = Flaky("always", failures=100, idempotent=True)
    caller = ToolCaller([ok_after_two, not_idem, always], cfg)
    r1, r2, r3 = run(caller.call_batch([ToolCall("idem", {}), ToolCall("once", {}), ToolCall("always", {})]))
    assert r1.ok and r1.attempts == 3 and ok_after_two.attempts == 3
    assert r2.status is ToolStatus.CRASHED and not_idem.attempts == 1
    assert r3.status is ToolStatus.CRASHED and always.attempts == 3  # 1 + max_retries, then gives up
    assert caller.metrics.total.retries == 2 + 2


def test_timeouts_are_retried_for_idempotent_tools() -> None:
    class SlowOnce(Flaky):
        async def call(self, arguments: dict[str, Any]) -> str:
            self.attempts += 1
            if self.attempts == 1:
                async with asyncio.timeout(0.1):  # the tool's own, shorter deadline (e.g. an HTTP request's)
                    await asyncio.sleep(5)
            return "second try"

    t = SlowOnce("s", idempotent=True)
    caller = ToolCaller([t], CallerConfig(timeout_s=5, retry_backoff_s=0.001))
    r = run(caller.call(ToolCall("s", {})))
    assert r.ok and r.content == "second try" and r.attempts == 2


def test_retries_share_the_calls_deadline() -> None:
    """An idempotent tool's retries never run past the call's deadline in total (3 x 30 s used to be 90 s), and
    the error says what happened."""

    class Hangs(Flaky):
        async def call(self, arguments: dict[str, Any]) -> str:
            self.attempts += 1
            await asyncio.sleep(60)
            return "never"

    class InnerTimeout(Flaky):
        async def call(self, arguments: dict[str, Any]) -> str:
            self.attempts += 1
            await asyncio.sleep(0.1)
            raise TimeoutError("Error: the backend did not answer within 0.1s.")

    hangs, inner = Hangs("hangs", idempotent=True), InnerTimeout("inner", idempotent=True)
    caller = ToolCaller([hangs, inner], CallerConfig(timeout_s=1.0, max_retries=2, retry_backoff_s=0.01))
    t0 = time.perf_counter()
    r_hang, r_inner = run(caller.call_batch([ToolCall("hangs", {}), ToolCall("inner", {})]))
    assert time.perf_counter() - t0 < 2.5  # not 3 x 1 s
    assert r_hang.status is ToolStatus.TIMEOUT and hangs.attempts == 1 and "timed out after 1s" in r_hang.content
    assert r_inner.status is ToolStatus.TIMEOUT and inner.attempts == 3 and r_inner.attempts == 3
    assert "did not answer within 0.1s" in r_inner.content
    assert "3 attempts in 0." in r_inner.content and "deadline is 1s in total" in r_inner.content


def test_search_timeout_message_states_the_real_deadline_and_attempts(http_server: Any) -> None:
    from rlf_envs.envs.search import HTTPBackend, SearchTool

    url, _ = http_server
    search = SearchTool(HTTPBackend(url + "/hang", timeout_s=0.2))
    caller = ToolCaller([search], CallerConfig(timeout_s=30, max_retries=2, retry_backoff_s=0.01))
    t0 = time.perf_counter()
    (r,) = run(caller.call_batch([ToolCall("search", {"query": "x"})]))
    assert time.perf_counter() - t0 < 10
    assert r.status is ToolStatus.TIMEOUT and r.attempts == 3
    assert "did not answer within 0.2s" in r.content and "30s" not in r.content.split("(")[0], r.content
    assert "3 attempts" in r.content


def test_per_tool_and_global_concurrency_limits() -> None:
    total = {"now": 0, "peak": 0}

    class Counted(Flaky):
        async def call(self, arguments: dict[str, Any]) -> str:
            total["now"] += 1
            total["peak"] = max(total["peak"], total["now"])
            try:
                return await super().call(arguments)
            finally:
                total["now"] -= 1

    limited = Counted("limited", delay=0.02, max_concurrency=2)
    free = Counted("free", delay=0.02)
    caller = ToolCaller([limited, free], CallerConfig(max_concurrency=5))
    calls = [ToolCall("limited", {})] * 10 + [ToolCall("free", {})] * 10
    res = run(caller.call_batch(calls))
    assert all(r.ok for r in res)
    assert limited.peak == 2
    assert total["peak"] == 5


def test_errors_become_observations() -> None:
    class Buggy(Flaky):
        async def call(self, arguments: dict[str, Any]) -> str:
            raise KeyError("missing")

    caller = ToolCaller([Buggy("buggy"), Flaky("clean", failures=1, exc=ToolError)])
    res = run(caller.call_batch([
        ToolCall("buggy", {}),
        ToolCall("clean", {}),
        ToolCall("nope", {}),
        ToolCall("clean", {"x": "not an int"}),
        ToolCall("clean", ["not", "a", "dict"]),  # type: ignore[arg-type]
    ]))
    assert res[0].status is ToolStatus.ERROR and "KeyError" in res[0].content
    assert res[1].status is ToolStatus.ERROR and res[1].content == "Error: boom"
    assert res[2].status is ToolStatus.UNKNOWN_TOOL and "Available tools: buggy, clean" in res[2].content
    assert res[3].status is ToolStatus.INVALID_ARGS and "x: 'not an int' is not of type 'integer'" in res[3].content
    assert res[4].status is ToolStatus.INVALID_ARGS and "JSON object" in res[4].content
    m = caller.metrics.total
    assert (m.calls, m.errors, m.unknown_tool, m.invalid_args) == (5, 2, 1, 2)


def test_oversize_output_is_truncated_with_marker() -> None:
    @tool
    async def big(n: int) -> str:
        """n characters."""
        return "y" * n

    caller = ToolCaller([big], CallerConfig(max_output_chars=100))
    r = run(caller.call(ToolCall("big", {"n": 10_000})))
    assert r.ok and r.truncated
    assert r.content.startswith("y" * 100) and r.content.endswith("[truncated: 9900 more characters]")
    assert caller.metrics.total.truncated == 1


def test_duplicate_tool_names_rejected() -> None:
    with pytest.raises(ValueError, match="two tools are named 'a'"):
        ToolCaller([Flaky("a"), Flaky("a")])


def test_limiter_fifo_and_cancellation() -> None:
    async def scenario() -> list[int]:
        lim = Limiter(1)
        order: list[int] = []

        async def worker(i: int) -> None:
            async with lim:
                order.append(i)
                await asyncio.sleep(0.01)

        await lim.acquire()
        tasks = [asyncio.create_task(worker(i)) for i in range(4)]
        await asyncio.sleep(0.01)
        tasks[1].cancel()  # a cancelled waiter must not leak the slot
        lim.release()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert lim.inflight == 0
        return order

    assert run(scenario()) == [0, 2, 3]


# ---------------------------------------------------------------------------------------------- HTTP tools
@pytest.fixture()
def http_server() -> Any:
    async def ok(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"result": f"hello {body.get('name')}", "extra": 1})

    async def plain(request: web.Request) -> web.Response:
        return web.Response(text="plain text")

    async def not_found(request: web.Request) -> web.Response:
        return web.json_response({"error": "no such thing"}, status=404)

    hits = {"flaky": 0}

    async def flaky(request: web.Request) -> web.Response:
        hits["flaky"] += 1
        if hits["flaky"] < 2:
            return web.Response(status=503, text="busy")
        return web.json_response({"result": "recovered"})

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(1)
        return web.json_response({"result": "late"})

    async def huge(request: web.Request) -> web.Response:
        return web.Response(text="z" * 200_000)

    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({"result": []})

    async def start() -> tuple[web.AppRunner, int]:
        app = web.Application()
        for path, h in [("/ok", ok), ("/plain", plain), ("/nf", not_found), ("/flaky", flaky), ("/slow", slow),
                        ("/huge", huge), ("/hang/retrieve", hang)]:
            app.router.add_route("*", path, h)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return runner, port

    runner, port = run(start())
    yield f"http://127.0.0.1:{port}", hits
    run(runner.cleanup())


def test_http_tool_against_real_server(http_server: Any) -> None:
    base, _ = http_server
    params = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    tools = [
        HTTPTool("greet", f"{base}/ok", parameters=params, result_key="result"),
        HTTPTool("whole", f"{base}/ok"),
        HTTPTool("plain", f"{base}/plain", method="GET"),
        HTTPTool("nf", f"{base}/nf"),
        HTTPTool("flaky", f"{base}/flaky", idempotent=True, result_key="result"),
        HTTPTool("slow", f"{base}/slow", timeout_s=0.2),
        HTTPTool("huge", f"{base}/huge", max_response_bytes=1000),
        HTTPTool("down", "http://127.0.0.1:9/x"),
    ]
    caller = ToolCaller(tools, CallerConfig(retry_backoff_s=0.001))
    names = ["greet", "whole", "plain", "nf", "flaky", "slow", "huge", "down"]
    res = run(caller.call_batch([ToolCall(n, {"name": "ann"}) for n in names] + [ToolCall("greet", {})]))
    by = dict(zip(names, res, strict=False))
    assert by["greet"].ok and by["greet"].content == "hello ann"
    assert json.loads(by["whole"].content) == {"result": "hello ann", "extra": 1}
    assert by["plain"].content == "plain text"
    assert by["nf"].status is ToolStatus.ERROR and "HTTP 404" in by["nf"].content
    assert by["flaky"].ok and by["flaky"].content == "recovered" and by["flaky"].attempts == 2
    assert by["slow"].status is ToolStatus.TIMEOUT
    assert by["huge"].status is ToolStatus.ERROR and "larger than 1000 bytes" in by["huge"].content
    assert by["down"].status is ToolStatus.CRASHED
    assert res[-1].status is ToolStatus.INVALID_ARGS and "'name' is a required property" in res[-1].content


def test_http_tool_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="must start with http"):
        HTTPTool("x", "ftp://host/")
    with pytest.raises(ValueError, match="GET or POST"):
        HTTPTool("x", "http://127.0.0.1/", method="DELETE")


def test_deadline_wheel_times_out_and_keeps_outside_cancellation() -> None:
    from rlf_envs.tools.deadlines import DeadlineWheel

    async def scenario() -> None:
        wheel = DeadlineWheel(resolution_s=0.01)
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError):
            async with wheel.deadline(0.05):
                await asyncio.sleep(120)
        assert 0.04 < time.perf_counter() - t0 < 60  # not early; and fired (generous bound: a loaded machine)

        async with wheel.deadline(0.05):  # finishes in time: no TimeoutError, later nothing fires on it
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.08)

        async def outer() -> None:
            async with wheel.deadline(10):
                await asyncio.sleep(5)

        task = asyncio.create_task(outer())
        await asyncio.sleep(0.01)
        task.cancel()  # a cancellation from outside stays a cancellation
        with pytest.raises(asyncio.CancelledError):
            await task

    run(scenario())
