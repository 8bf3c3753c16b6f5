"""A small MCP server on the SSE transport (GET /sse + POST /messages/), for rlf's config tests.

    python sse_mcp.py PORT
"""

from __future__ import annotations

import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("sse-demo")


@server.tool()
def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper()


if __name__ == "__main__":
    server.run("sse", host="127.0.0.1", port=int(sys.argv[1]))
