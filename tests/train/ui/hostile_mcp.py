"""A stdio MCP server written at the JSON-RPC level, for the web UI's tests: its tool names, descriptions and
outputs carry markup (they must stay text in the page), and one tool's input schema is not valid JSON Schema.

    python hostile_mcp.py
"""

from __future__ import annotations

import json
import sys

PWN = "<img id=pwn src=x onerror=\"document.title='pwned'\">"
CLOSE = "</script><script>document.title='pwned'</script><!--"
TOOLS = [
    {"name": "echo", "description": f"Echo the text back {PWN}",
     "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}},
    {"name": f"shout{PWN}", "description": CLOSE, "inputSchema": {"type": "object", "properties": {}}},
    {"name": "bad_schema", "description": "a tool whose parameter schema is broken",
     "inputSchema": {"type": "object", "properties": {"x": {"type": "strnig"}}}},
]


def reply(msg_id: object, result: object = None, error: dict[str, object] | None = None) -> None:
    out: dict[str, object] = {"jsonrpc": "2.0", "id": msg_id}
    if error is not None:
        out["error"] = error
    else:
        out["result"] = result
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


def main() -> None:
    for line in sys.stdin:
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        method, msg_id, params = msg.get("method"), msg.get("id"), msg.get("params") or {}
        if msg_id is None:
            continue  # a notification
        if method == "initialize":
            reply(msg_id, {"protocolVersion": params.get("protocolVersion", "2025-06-18"),
                           "capabilities": {"tools": {}}, "serverInfo": {"name": f"hostile{PWN}", "version": "1"}})
        elif method == "tools/list":
            reply(msg_id, {"tools": TOOLS})
        elif method == "tools/call":
            text = json.dumps(params.get("arguments", {}))
            reply(msg_id, {"content": [{"type": "text", "text": f"{PWN} {CLOSE} you said {text}"}], "isError": False})
        elif method == "ping":
            reply(msg_id, {})
        else:
            reply(msg_id, error={"code": -32601, "message": f"Method not found: {method}"})


if __name__ == "__main__":
    main()
