"""Tools backed by HTTP JSON endpoints (aiohttp; one shared session per process on rlf's loop)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from rlf_envs import runtime
from rlf_envs.tools.base import Tool, ToolCrashed, ToolError, ToolSpec

_session: aiohttp.ClientSession | None = None


class _SessionCloser:
    async def aclose(self) -> None:
        global _session
        s, _session = _session, None
        if s is not None and not s.closed:
            await s.close()


async def http_session() -> aiohttp.ClientSession:
    """The process-wide aiohttp session (created on first use on rlf's runtime loop)."""
    global _session
    if _session is None or _session.closed:
        _session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512))
        runtime.register_closer(_SessionCloser())
    return _session


async def read_capped(resp: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The response body, or its first `max_bytes + 1` bytes when it is longer (so `len(body) > max_bytes` says
    it was too large); `resp.content.read(n)` alone returns whatever has arrived so far, not n bytes."""
    chunks: list[bytes] = []
    size = 0
    while size <= max_bytes:
        chunk = await resp.content.read(max_bytes + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


class HTTPTool(Tool):
    """POST (or GET) the call's arguments as JSON to `url`; the response body is the tool output.

    A JSON response is returned as its `result_key` field when given, else as the whole JSON text.
    HTTP 4xx -> a ToolError the policy sees; 5xx / connection errors -> ToolCrashed (retried if idempotent).
    """

    def __init__(
        self,
        name: str,
        url: str,
        description: str = "",
        parameters: dict[str, Any] | None = None,
        method: str = "POST",
        headers: dict[str, str] | None = None,
        result_key: str | None = None,
        timeout_s: float | None = None,
        idempotent: bool = False,
        max_concurrency: int | None = None,
        max_response_bytes: int = 4 << 20,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"HTTPTool {name!r}: url {url!r} must start with http:// or https://")
        if method.upper() not in ("GET", "POST"):
            raise ValueError(f"HTTPTool {name!r}: method must be GET or POST, got {method!r}")
        self.spec = ToolSpec(name, description, parameters or {"type": "object", "properties": {}})
        self.url = url
        self.method = method.upper()
        self.headers = dict(headers or {})
        self.result_key = result_key
        self.timeout_s = timeout_s
        self.idempotent = idempotent
        self.max_concurrency = max_concurrency
        self.max_response_bytes = max_response_bytes

    async def call(self, arguments: dict[str, Any]) -> str:
        session = await http_session()
        kw: dict[str, Any] = {"headers": self.headers}
        if self.method == "GET":
            kw["params"] = {k: v if isinstance(v, str) else json.dumps(v) for k, v in arguments.items()}
        else:
            kw["json"] = arguments
        try:
            async with session.request(self.method, self.url, **kw) as resp:
                body = await read_capped(resp, self.max_response_bytes)
                status = resp.status
                ctype = resp.headers.get("Content-Type", "")
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            raise ToolCrashed(f"cannot reach {self.url}: {type(e).__name__}") from None
        if len(body) > self.max_response_bytes:
            raise ToolError(f"response larger than {self.max_response_bytes} bytes")
        text = body.decode("utf-8", errors="replace")
        if status >= 500:
            raise ToolCrashed(f"HTTP {status} from {self.name}")
        if status >= 400:
            raise ToolError(f"HTTP {status}: {text[:500]}")
        if "json" in ctype:
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                return text
            if self.result_key is not None:
                if not isinstance(data, dict) or self.result_key not in data:
                    raise ToolError(f"response has no {self.result_key!r} field")
                data = data[self.result_key]
            return data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
        return text
