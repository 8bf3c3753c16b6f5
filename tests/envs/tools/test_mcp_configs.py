"""`mcpServers` files written for other MCP clients work unchanged: `disabled` is honoured, client-only
keys are ignored (with a debug note), and SSE servers (`type: sse` or a `/sse` URL) are reachable."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from repo_paths import SUPPORT

from rlf_envs import runtime
from rlf_envs.tools.caller import ToolCaller
from rlf_envs.tools.mcp import close_mcp_servers, load_mcp_config, mcp_tools
from rlf_envs.types import ToolCall
from tests.conftest import stop_process

SSE_SERVER = str(SUPPORT / "servers" / "sse_mcp.py")

# as Claude Desktop / Cline / Roo Code write them
CLIENT_FILE = {
    "mcpServers": {
        "time": {"command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"],
                 "autoApprove": ["get_current_time"],
                 "alwaysAllow": [], "disabled": False, "timeout": 20},
        "off": {"command": "/nonexistent/never-started", "disabled": True, "autoApprove": []},
    }
}


def test_client_files_load_unchanged(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    path = tmp_path / "claude_desktop_config.json"
    path.write_text(json.dumps(CLIENT_FILE))
    with caplog.at_level(logging.DEBUG, logger="rlf_envs.tools.mcp"):
        cfg = load_mcp_config(path)
    assert cfg.servers["off"].disabled and not cfg.servers["time"].disabled
    assert cfg.servers["time"].timeout_s == 20
    assert "ignoring client-only key(s) alwaysAllow, autoApprove" in caplog.text
    with pytest.raises(ValueError, match="autoApprov"):  # a typo of a real key is still an error
        load_mcp_config({"mcpServers": {"x": {"command": "c", "autoApprov": []}}})


def test_disabled_servers_are_not_started() -> None:
    try:
        tools = mcp_tools(CLIENT_FILE)  # would fail if "off" (a nonexistent binary) were started
        assert {t.name for t in tools} >= {"get_current_time"}
        assert {t.server.name for t in tools} == {"time"}
    finally:
        runtime.run(close_mcp_servers())


@pytest.mark.parametrize(
    ("entry", "transport"),
    [
        ({"url": "http://h/sse"}, "sse"),
        ({"url": "http://h/sse/?x=1"}, "sse"),
        ({"url": "http://h/mcp", "type": "sse"}, "sse"),
        ({"url": "http://h/mcp", "transportType": "sse"}, "sse"),  # Cline
        ({"url": "http://h/mcp"}, "http"),
        ({"url": "http://h/sse", "type": "streamable-http"}, "http"),
        ({"command": "c"}, "stdio"),
    ],
)
def test_transport_inference(entry: dict[str, object], transport: str) -> None:
    assert load_mcp_config({"mcpServers": {"s": entry}}).servers["s"].transport == transport


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("style", ["url", "type"])
def test_sse_server(style: str) -> None:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, SSE_SERVER, str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        entry = ({"url": f"http://127.0.0.1:{port}/sse"} if style == "url"
                 else {"url": f"http://127.0.0.1:{port}/sse", "type": "sse", "autoApprove": ["shout"]})
        tools = mcp_tools({"mcpServers": {"legacy": entry}})
        assert [t.name for t in tools] == ["shout"]
        results = runtime.run(ToolCaller(tools).call_batch([ToolCall("shout", {"text": f"hi {i}"}) for i in range(5)]))
        assert [r.content for r in results] == [f"HI {i}" for i in range(5)] and all(r.ok for r in results)
    finally:
        runtime.run(close_mcp_servers())
        stop_process(proc)
