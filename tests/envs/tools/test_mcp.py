"""MCP tools over stdio and streamable HTTP: a real PyPI server, and one that misbehaves on purpose."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from procs_support import leftover_children
from repo_paths import SUPPORT

from rlf_envs import runtime
from rlf_envs.env import ToolEnv
from rlf_envs.tools import CallerConfig, ToolCaller, close_mcp_servers, load_mcp_config, mcp_tools
from rlf_envs.types import ToolCall, ToolStatus

SERVER = str(SUPPORT / "servers" / "misbehaving_mcp.py")


def children() -> list[psutil.Process]:
    return leftover_children()


@pytest.fixture()
def clean_servers() -> Any:
    yield
    runtime.run(close_mcp_servers())
    deadline = time.time() + 10
    while children() and time.time() < deadline:
        time.sleep(0.05)
    assert children() == [], "MCP server processes left behind"


def bad_config(**extra: Any) -> dict[str, Any]:
    return {"mcpServers": {"bad": {"command": sys.executable, "args": [SERVER], "timeout": 1.0, **extra}}}


def call(caller: ToolCaller, *calls: ToolCall) -> list[Any]:
    return runtime.run(caller.call_batch(list(calls)))


def test_real_pypi_time_server_over_stdio(clean_servers: None) -> None:
    exe = shutil.which("mcp-server-time") or str(Path(sys.executable).parent / "mcp-server-time")
    tools = mcp_tools({"mcpServers": {"time": {"command": exe, "args": ["--local-timezone", "UTC"]}}})
    names = {t.name for t in tools}
    assert {"get_current_time", "convert_time"} <= names
    spec = next(t.spec for t in tools if t.name == "get_current_time")
    assert "timezone" in spec.parameters["properties"]  # the real schema, listed from the server
    caller = ToolCaller(tools)
    ok, bad, missing = call(
        caller,
        ToolCall("get_current_time", {"timezone": "Asia/Tokyo"}),
        ToolCall("get_current_time", {"timezone": "Mars/Olympus"}),
        ToolCall("get_current_time", {}),
    )
    assert ok.ok and json.loads(ok.content)["timezone"] == "Asia/Tokyo"
    assert bad.status is ToolStatus.ERROR and "Mars/Olympus" in bad.content
    assert missing.status is ToolStatus.INVALID_ARGS and "'timezone' is a required property" in missing.content


def test_misbehaving_server_deadlines_crashes_huge_outputs(clean_servers: None) -> None:
    tools = mcp_tools(bad_config())
    caller = ToolCaller(tools, CallerConfig(max_output_chars=1000))
    (pid0,) = call(caller, ToolCall("pid", {}))
    t0 = time.perf_counter()
    slow, echo, huge, fail = call(
        caller,
        ToolCall("slow", {"seconds": 30}),
        ToolCall("echo", {"text": "hi"}),
        ToolCall("huge", {"n": 300_000}),
        ToolCall("fail", {"message": "kaboom"}),
    )
    assert time.perf_counter() - t0 < 25, "the deadline did not hold"  # the slow call sleeps 30 s
    assert slow.status is ToolStatus.TIMEOUT
    assert echo.ok and echo.content == "hi"
    assert huge.ok and huge.truncated and "[truncated: " in huge.content
    assert fail.status is ToolStatus.ERROR and "kaboom" in fail.content

    # a hung (blocked) server: our deadline still answers
    (hung,) = call(caller, ToolCall("blocking_sleep", {"seconds": 3}))
    assert hung.status is ToolStatus.TIMEOUT  # answered by our 1 s deadline, not by the server at 3 s

    # a crash is contained, reported, and the server is restarted for the next call
    (crash,) = call(caller, ToolCall("crash", {}))
    assert crash.status is ToolStatus.CRASHED
    (pid1,) = call(caller, ToolCall("pid", {}))
    assert pid1.ok and pid1.content != pid0.content
    assert psutil.pid_exists(int(pid1.content))
    m = caller.metrics.total
    assert m.timeouts == 2 and m.crashed == 1 and m.errors == 1 and m.truncated == 1


def test_crashed_server_restart_is_retried_for_idempotent_tools(clean_servers: None) -> None:
    tools = mcp_tools(bad_config(idempotent=["pid"]))
    caller = ToolCaller(tools, CallerConfig(retry_backoff_s=0.01))
    by = {t.name: t for t in tools}
    assert by["pid"].idempotent and not by["crash"].idempotent
    (first,) = call(caller, ToolCall("pid", {}))
    psutil.Process(int(first.content)).kill()  # the server dies between calls
    time.sleep(0.3)
    (second,) = call(caller, ToolCall("pid", {}))
    assert second.ok and second.content != first.content


def test_servers_are_shared_by_envs_and_reaped(clean_servers: None) -> None:
    tasks = [{"id": "t", "question": "q", "answer": "a"}]
    envs = [ToolEnv(mcp_servers=bad_config(tools=["pid", "echo"]), tasks=tasks) for _ in range(3)]
    assert {id(e.toolbox) for e in envs} == {id(envs[0].toolbox)}
    assert sorted(envs[0].toolbox.tools) == ["echo", "pid"]  # allow-list applied
    pids = set()
    for e in envs:
        e.reset(seed=0)
        obs, *_ = e.step('<tool_call>{"name": "pid", "arguments": {}}</tool_call>')
        pids.add(obs.split("<tool_response>\n")[1].split("\n")[0])
    assert len(pids) == 1  # one server process for all envs
    assert len(children()) == 1


def test_streamable_http_server(clean_servers: None) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, SERVER, "http", str(port)], stderr=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL)
    try:
        deadline = time.time() + 180  # generous: a loaded machine takes many seconds to start the server
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, "the MCP HTTP server did not start"
                time.sleep(0.1)
        tools = mcp_tools({"mcpServers": {"remote": {"url": f"http://127.0.0.1:{port}/mcp", "tools": ["echo"],
                                                     "prefix": "r_"}}})
        assert [t.name for t in tools] == ["r_echo"]
        (r,) = call(ToolCaller(tools), ToolCall("r_echo", {"text": "over http"}))
        assert r.ok and r.content == "over http"
    finally:
        runtime.run(close_mcp_servers())
        proc.terminate()
        proc.wait(10)


def test_unstartable_server_is_an_error_observation(clean_servers: None) -> None:
    with pytest.raises(Exception, match=r"failed to start|did not start"):
        mcp_tools({"mcpServers": {"x": {"command": "/nonexistent/server-binary"}}})


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"servers": {}}, "top-level `mcpServers`"),
        ({"mcpServers": {"a": {}}}, "exactly one of `command`"),
        ({"mcpServers": {"a": {"command": "x", "url": "http://h"}}}, "exactly one of `command`"),
        ({"mcpServers": {"a": {"url": "ftp://h"}}}, "must start with http"),
        ({"mcpServers": {"a": {"command": "x", "timeout": -1}}}, r"mcpServers.a.timeout: Input should be greater"),
        ({"mcpServers": {"a": {"command": "x", "bogus": 1}}}, r"mcpServers.a.bogus: Extra inputs"),
    ],
)
def test_bad_mcp_config(cfg: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_mcp_config(cfg)


def test_mcp_config_from_yaml_and_json(tmp_path: Path) -> None:
    y = tmp_path / "mcp.yaml"
    y.write_text("mcpServers:\n  t:\n    command: mcp-server-time\n    timeout: 5\n    tools: [get_current_time]\n")
    j = tmp_path / "mcp.json"
    j.write_text(json.dumps({"mcpServers": {"t": {"url": "http://127.0.0.1:1/mcp"}}}))
    assert load_mcp_config(y).servers["t"].timeout_s == 5
    assert load_mcp_config(j).servers["t"].url == "http://127.0.0.1:1/mcp"


def test_unknown_allow_listed_tool(clean_servers: None) -> None:
    with pytest.raises(ValueError, match=r"has no tool\(s\) \['nope'\]"):
        mcp_tools(bad_config(tools=["nope"]))


# -- containment: the server's whole process tree ends with it -------------------------------------------


def running(pids: list[int]) -> list[int]:
    out = []
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(pids: list[int], seconds: float = 10.0) -> list[int]:
    deadline = time.time() + seconds
    while running(pids) and time.time() < deadline:
        time.sleep(0.05)
    return running(pids)


def spawn_tree(caller: ToolCaller) -> list[int]:
    (r,) = call(caller, ToolCall("spawn", {}))
    assert r.ok, r.content
    pids = json.loads(r.content)
    assert len(pids) >= 5 and running(pids) == pids  # shell, its 2 pipeline children, daemon, grouped
    return pids


def test_processes_started_by_a_server_end_with_it_on_close(clean_servers: None) -> None:
    caller = ToolCaller(mcp_tools(bad_config(timeout=5.0)))
    pids = spawn_tree(caller)
    runtime.run(close_mcp_servers())
    assert wait_gone(pids) == [], "children of a closed MCP server are still running"


def test_a_crash_with_children_holding_the_pipe_is_seen_and_the_tree_ended(clean_servers: None) -> None:
    from rlf_envs.tools.mcp import _shared

    tools = mcp_tools(bad_config(timeout=20.0))
    caller = ToolCaller(tools)
    server = next(iter(_shared.values()))
    (pid0,) = call(caller, ToolCall("pid", {}))
    pids = spawn_tree(caller)
    t0 = time.perf_counter()
    (crash,) = call(caller, ToolCall("crash", {}))
    # the children keep the stdout pipe open, so no EOF ever comes: the leader's exit must be noticed
    assert crash.status is ToolStatus.CRASHED and time.perf_counter() - t0 < 15, crash
    assert wait_gone(pids) == [], "children of a crashed MCP server are still running"
    (pid1,) = call(caller, ToolCall("pid", {}))
    assert pid1.ok and pid1.content != pid0.content
    assert server.restarts == 1
    psutil.Process(int(pid1.content)).kill()  # dies between calls: the next call restarts it again
    time.sleep(0.3)
    call(caller, ToolCall("pid", {}))
    (pid2,) = call(caller, ToolCall("pid", {}))
    assert pid2.ok and server.restarts == 2


def test_server_trees_end_at_interpreter_exit(tmp_path: Path) -> None:
    script = tmp_path / "leave.py"
    script.write_text(
        "import json, sys\n"
        "from rlf_envs import runtime\n"
        "from rlf_envs.tools import ToolCaller, mcp_tools\n"
        "from rlf_envs.types import ToolCall\n"
        f"cfg = {{'mcpServers': {{'bad': {{'command': sys.executable, 'args': [{SERVER!r}], 'timeout': 5}}}}}}\n"
        "caller = ToolCaller(mcp_tools(cfg))\n"
        "pid = runtime.run(caller.call_batch([ToolCall('pid', {})]))[0].content\n"
        "kids = runtime.run(caller.call_batch([ToolCall('spawn', {})]))[0].content\n"
        "print(json.dumps([int(pid), *json.loads(kids)]), flush=True)\n"  # exits without closing anything
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pids = json.loads(out.stdout.strip().splitlines()[-1])
    assert wait_gone(pids) == [], "MCP server processes outlived the interpreter"


# -- bounded replies ------------------------------------------------------------------------------------


class Heartbeat:
    """The longest gap between ticks of a 10 ms timer on rlf's loop: how long the loop was stalled."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._stop = False

    async def run(self) -> None:
        import asyncio

        last = time.perf_counter()
        while not self._stop:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now

    def stop(self) -> None:
        self._stop = True


def test_an_oversize_reply_is_an_error_the_loop_stays_responsive_and_the_server_recovers(
    clean_servers: None,
) -> None:
    import asyncio

    caller = ToolCaller(mcp_tools(bad_config(timeout=30.0, max_reply_bytes=1 << 20)), CallerConfig())
    beat = Heartbeat()

    async def go() -> list[Any]:
        hb = asyncio.ensure_future(beat.run())
        try:
            return await caller.call_batch([ToolCall("huge", {"n": 20_000_000})])
        finally:
            beat.stop()
            await hb

    t0 = time.perf_counter()
    (big,) = runtime.run(go())
    assert big.status is ToolStatus.ERROR and "max_reply_bytes" in big.content, big.content[:300]
    assert time.perf_counter() - t0 < 25
    # the SDK's quadratic line joining stalled the loop for seconds on a 20 MB reply (~10 s for 50 MB)
    assert beat.longest < 2.0, f"the event loop stalled {beat.longest:.1f}s while a 20 MB reply streamed in"
    (echo,) = call(caller, ToolCall("echo", {"text": "still here"}))
    assert echo.ok and echo.content == "still here"
    (ok,) = call(caller, ToolCall("huge", {"n": 500_000}))  # under the limit: delivered
    assert ok.ok and ok.truncated


def test_a_reply_that_never_ends_restarts_the_server_for_the_next_call(clean_servers: None) -> None:
    caller = ToolCaller(mcp_tools(bad_config(timeout=1.0)))
    (pid0,) = call(caller, ToolCall("pid", {}))
    (flood,) = call(caller, ToolCall("flood", {"seconds": 60}))
    assert flood.status is ToolStatus.TIMEOUT
    t0 = time.perf_counter()
    (after,) = call(caller, ToolCall("pid", {}))
    assert after.ok and after.content != pid0.content, after.content
    assert time.perf_counter() - t0 < 20
