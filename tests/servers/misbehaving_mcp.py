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


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
