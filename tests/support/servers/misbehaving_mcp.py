"""An MCP server (stdio or streamable HTTP) with tools that misbehave, for rlf's caller tests.

    python misbehaving_mcp.py [stdio | http PORT]
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("misbehaving")
_counter = {"n": 0}


@server.tool()
def echo(text: str) -> str:
    """Echo the text back."""
    return text


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def blocking_sleep(seconds: float) -> str:
    """Block the server's thread (a hung server)."""
    time.sleep(seconds)
    return "woke"


@server.tool()
def crash() -> str:
    """Kill the server process."""
    os._exit(3)


@server.tool()
def huge(n: int) -> str:
    """Return n characters."""
    return "x" * n


@server.tool()
def fail(message: str) -> str:
    """Report a tool error (its message reaches the client)."""
    raise ToolError(message)


@server.tool()
def bug() -> str:
    """An unexpected exception inside the tool (the SDK hides its message)."""
    raise ValueError("hidden")


@server.tool()
def pid() -> str:
    """The server's process id."""
    return str(os.getpid())


@server.tool()
def count() -> str:
    """A per-process counter (state shared by every caller of this server)."""
    _counter["n"] += 1
    return str(_counter["n"])


@server.tool()
def spawn() -> str:
    """Start children that try to outlive the server: a shell pipeline holding the server's stdout, a daemon
    in its own session holding the protocol pipes (`setsid`), and one in its own process group. Returns their pids."""
    import json
    import subprocess

    pipeline = subprocess.Popen(["sh", "-c", "sleep 300 | sleep 301"], stdin=subprocess.DEVNULL)
    daemon = subprocess.Popen(["setsid", "sleep", "302"], stdin=subprocess.DEVNULL, pass_fds=_wire_fds())
    grouped = subprocess.Popen(["sleep", "303"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               process_group=0)
    time.sleep(0.2)  # let the shell start its pipeline
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pipeline.pid:
                        kids.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return json.dumps([pipeline.pid, *kids, daemon.pid, grouped.pid])


@server.tool()
def flood(seconds: float) -> str:
    """Write a reply that never ends (no newline) for `seconds`, straight to the protocol pipe."""
    import fcntl

    wire = next(fd for fd in _wire_fds() if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY)
    deadline = time.monotonic() + seconds
    os.write(wire, b'{"jsonrpc": "2.0", "id": 999999, "result": {"content": [{"type": "text", "text": "')
    while time.monotonic() < deadline:
        os.write(wire, b"x" * 65536)
    return "done"


def _wire_fds() -> list[int]:
    """The protocol pipes (the SDK's server moved them off fds 0 and 1)."""
    wire = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if int(fd) > 2 and os.readlink(f"/proc/self/fd/{fd}").startswith(("pipe:", "socket:")):
                os.fstat(int(fd))
                wire.append(int(fd))
        except OSError:
            pass
    return wire


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
