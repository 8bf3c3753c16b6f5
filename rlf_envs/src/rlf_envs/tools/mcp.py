"""Tools from MCP servers (the `mcp` SDK v2), over stdio, streamable HTTP or SSE.

Configured by the usual `mcpServers` map (YAML or JSON)::

    mcpServers:
      time:   {command: mcp-server-time, args: ["--local-timezone", "UTC"], timeout: 10}
      remote: {url: "http://127.0.0.1:8931/mcp", headers: {Authorization: "Bearer ..."}, tools: [search]}
      legacy: {url: "http://127.0.0.1:8932/sse"}         # SSE transport (`type: sse`, or a URL ending in /sse)
      off:    {command: some-server, disabled: true}     # skipped, as Claude Desktop / Cursor / Cline skip it

Files written for Claude Desktop, Cursor or Cline work unchanged: `disabled` is honoured, client-only keys
(`autoApprove`, `alwaysAllow`, ...) are ignored with a debug log, Cline's `transportType` means `type`.

One `MCPServer` (one session, one server process) per configured server per process, shared by every
env that uses it (see `shared_mcp_tools`). Its session lives in an owner task on rlf's runtime loop;
when the server dies, the next call starts it again. Stdio servers run through rlf's own transport
(tools/mcp_stdio.py): each server's whole process tree is ended on close, restart, crash and interpreter
exit, and replies are bounded by `max_reply_bytes`.

Per-episode state: a shared server sees calls from many episodes interleaved. Tools that keep state
must key it by an explicit argument (e.g. `session_id`), or be given to each env as its own server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

import pydantic
import yaml

from rlf_envs import runtime
from rlf_envs.tools.base import Tool, ToolCrashed, ToolError, ToolSpec

log = logging.getLogger(__name__)

try:
    from mcp_types import CONNECTION_CLOSED as _CONNECTION_CLOSED
except ImportError:  # pragma: no cover - older layouts
    _CONNECTION_CLOSED = -32000


#: keys MCP clients keep in their `mcpServers` entries that only concern the client's UI / approval flow
CLIENT_ONLY_KEYS = frozenset({"autoApprove", "alwaysAllow", "description", "trust", "icon", "notes"})
_SSE_TYPES = ("sse",)
_HTTP_TYPES = ("http", "streamable-http", "streamable_http", "streamableHttp")


class MCPServerConfig(pydantic.BaseModel):
    """One entry of an `mcpServers` map: either `command` (stdio) or `url` (streamable HTTP, or SSE with
    `type: sse` or a URL path ending in `/sse`). `disabled: true` entries are skipped."""

    model_config = pydantic.ConfigDict(extra="forbid", populate_by_name=True)

    command: str | None = None
    args: list[str] = []
    env: dict[str, str] = {}
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = {}
    type: str | None = pydantic.Field(None, description="stdio | http | streamable-http (inferred if absent)")
    timeout_s: float = pydantic.Field(30.0, gt=0, alias="timeout", description="per-call deadline, seconds")
    startup_timeout_s: float = pydantic.Field(30.0, gt=0, description="deadline to start + list tools")
    tools: list[str] | None = pydantic.Field(None, description="allow-list of tool names (default: all)")
    prefix: str = pydantic.Field("", description="prepended to tool names, to avoid clashes between servers")
    idempotent: bool | list[str] = pydantic.Field(False, description="tools that may be retried on timeout/crash")
    max_concurrency: int | None = pydantic.Field(None, ge=1, description="in-flight calls per tool")
    max_reply_bytes: int = pydantic.Field(
        4 << 20, ge=1024, description="stdio: a larger reply is dropped unparsed and answered with an error"
    )
    disabled: bool = pydantic.Field(False, description="skip this server (as MCP clients do)")

    @pydantic.model_validator(mode="before")
    @classmethod
    def _client_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        ignored = sorted(k for k in data if k in CLIENT_ONLY_KEYS)
        if ignored:
            log.debug("mcpServers entry: ignoring client-only key(s) %s", ", ".join(ignored))
            data = {k: v for k, v in data.items() if k not in CLIENT_ONLY_KEYS}
        if "transportType" in data:  # Cline's name for `type`
            data = dict(data)
            transport = data.pop("transportType")
            data.setdefault("type", transport)
        return data

    @property
    def transport(self) -> str:
        """"stdio", "http" (streamable HTTP) or "sse"."""
        if self.command is not None:
            return "stdio"
        if self.type in _SSE_TYPES:
            return "sse"
        if self.type is None and (self.url or "").split("?")[0].rstrip("/").endswith("/sse"):
            return "sse"
        return "http"

    @pydantic.model_validator(mode="after")
    def _one_transport(self) -> MCPServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of `command` (stdio server) or `url` (streamable HTTP or SSE server)")
        if self.type not in (None, "stdio", *_HTTP_TYPES, *_SSE_TYPES):
            raise ValueError(f"type {self.type!r} is not supported; use stdio, http, streamable-http or sse")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url {self.url!r} must start with http:// or https://")
        return self

    def key(self) -> str:
        return self.model_dump_json()


class MCPConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", populate_by_name=True)
    servers: dict[str, MCPServerConfig] = pydantic.Field(alias="mcpServers")


def load_mcp_config(source: str | os.PathLike[str] | dict[str, Any] | MCPConfig) -> MCPConfig:
    """Read an `mcpServers` config from a YAML/JSON file or a dict; errors name the bad field."""
    if isinstance(source, MCPConfig):
        return source
    if isinstance(source, dict):
        data = source
    else:
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"MCP config {path} does not exist")
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, dict) or "mcpServers" not in data:
        raise ValueError("an MCP config must be a mapping with a top-level `mcpServers` key")
    try:
        return MCPConfig.model_validate(data)
    except pydantic.ValidationError as e:
        lines = [f"mcpServers.{'.'.join(str(x) for x in err['loc'][1:])}: {err['msg']}" for err in e.errors()]
        raise ValueError("invalid MCP config:\n  " + "\n  ".join(lines)) from None


def _result_text(result: Any) -> str:
    parts: list[str] = []
    for block in result.content or []:
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and hasattr(block.resource, "text"):
            parts.append(block.resource.text)
        else:
            parts.append(f"[{kind} content omitted]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


class MCPServer:
    """A connection to one MCP server, restarted on demand after a crash. Use on rlf's runtime loop."""

    def __init__(self, name: str, config: MCPServerConfig) -> None:
        self.name = name
        self.config = config
        self._client: Any = None
        self._owner: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._starting: asyncio.Lock | None = None
        self.restarts = 0  # sessions started after the first one (crashes, undrainable replies)
        self._started = False
        self._transport: Any = None  # the stdio transport of the live session (None over HTTP)
        self.specs: list[ToolSpec] = []
        self.closed = False

    def _make_client(self) -> Any:
        from mcp import Client

        c = self.config
        if c.command is not None:
            server: Any = self._stdio_transport()
        elif c.transport == "sse":
            from mcp.client.sse import sse_client

            server = sse_client(c.url or "", headers=c.headers or None, timeout=c.startup_timeout_s)
        elif c.headers:
            from mcp.client.streamable_http import streamable_http_client
            from mcp.shared._httpx_utils import create_mcp_http_client

            server = streamable_http_client(c.url or "", http_client=create_mcp_http_client(headers=c.headers))
        else:
            server = c.url
        return Client(server, read_timeout_seconds=c.timeout_s + 5.0)

    def _stdio_transport(self) -> Any:
        """rlf's stdio transport: the server's whole process tree is ended with the session, and replies are
        bounded by `max_reply_bytes` (see tools/mcp_stdio.py)."""
        from rlf_envs.tools.mcp_stdio import BoundedStdioTransport

        c = self.config
        assert c.command is not None
        self._transport = BoundedStdioTransport(
            c.command, c.args, env=dict(c.env) or None, cwd=c.cwd, max_reply_bytes=c.max_reply_bytes
        )
        return self._transport

    async def drain_or_restart(self, grace_s: float, why: str) -> None:
        """stdio: if a reply is mid-stream, give it `grace_s` to finish; a reply that does not (a server
        streaming without end) is not going to drain: restart, so the next call is not queued behind it."""
        t = self._transport
        if t is None or self._owner is None:
            return
        started = t.partial_reply_started()
        if started is None:
            return
        deadline = asyncio.get_running_loop().time() + grace_s
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
            if t.partial_reply_started() != started:
                return
        await self.restart(why)

    async def restart(self, why: str) -> None:
        """End the session (and the server's process tree); the next call starts a new one."""
        log.warning("MCP server %s: restarting (%s)", self.name, why)
        await self._stop_owner()

    async def _run_owner(self, ready: asyncio.Future[Any], stop: asyncio.Event) -> None:
        try:
            async with self._make_client() as client:
                if not ready.done():
                    ready.set_result(client)
                await stop.wait()
        except BaseException as e:
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else ToolCrashed(repr(e)))
            elif not isinstance(e, asyncio.CancelledError):
                log.warning("MCP server %s: session ended: %r", self.name, e)
        finally:
            self._client = None

    async def ensure(self) -> Any:
        """The live client, starting (or restarting) the server if needed."""
        if self.closed:
            raise ToolCrashed(f"MCP server {self.name!r} is closed")
        if self._client is not None and self._owner is not None and not self._owner.done():
            return self._client
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._client is not None and self._owner is not None and not self._owner.done():
                return self._client
            if self._started:  # a previous session died or was ended
                self.restarts += 1
            if self._owner is not None:
                await self._stop_owner()
            loop = asyncio.get_running_loop()
            ready: asyncio.Future[Any] = loop.create_future()
            self._stop = asyncio.Event()
            self._owner = loop.create_task(self._run_owner(ready, self._stop), name=f"mcp:{self.name}")
            try:
                async with asyncio.timeout(self.config.startup_timeout_s):
                    client = await ready
            except TimeoutError:
                await self._stop_owner()
                raise ToolCrashed(
                    f"MCP server {self.name!r} did not start within {self.config.startup_timeout_s:g}s "
                    f"(command: {self.config.command or self.config.url})"
                ) from None
            except Exception as e:
                await self._stop_owner()
                raise ToolCrashed(f"MCP server {self.name!r} failed to start: {type(e).__name__}: {e}") from None
            self._client = client
            self._started = True
            return client

    async def list_tools(self) -> list[ToolSpec]:
        client = await self.ensure()
        specs: list[ToolSpec] = []
        cursor = None
        async with asyncio.timeout(self.config.startup_timeout_s):
            while True:
                res = await client.list_tools(cursor=cursor)
                for t in res.tools:
                    specs.append(ToolSpec(t.name, t.description or "", dict(t.input_schema or {"type": "object"})))
                cursor = getattr(res, "next_cursor", None)
                if not cursor:
                    break
        allow = self.config.tools
        if allow is not None:
            missing = sorted(set(allow) - {s.name for s in specs})
            if missing:
                raise ValueError(
                    f"MCP server {self.name!r} has no tool(s) {missing}; it offers {sorted(s.name for s in specs)}"
                )
            specs = [s for s in specs if s.name in allow]
        self.specs = specs
        return specs

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        client = await self.ensure()
        try:
            result = await client.call_tool(name, arguments)
        except (asyncio.CancelledError, TimeoutError):
            raise
        except Exception as e:
            # a protocol-level error from a live server is the tool's error; a closed connection is a crash
            code = getattr(e, "code", None)
            alive = self._owner is not None and not self._owner.done()
            if alive and code is not None and code != _CONNECTION_CLOSED:
                raise ToolError(f"{name}: {getattr(e, 'message', None) or e}") from None
            await self._stop_owner()
            raise ToolCrashed(f"MCP server {self.name!r} connection failed: {type(e).__name__}: {e}") from None
        text = _result_text(result)
        if result.is_error:
            raise ToolError(text or f"{name} reported an error")
        return text

    async def _stop_owner(self) -> None:
        owner, self._owner = self._owner, None
        self._client = None
        if owner is None:
            return
        if self._stop is not None:
            self._stop.set()
        try:
            async with asyncio.timeout(10):
                await asyncio.shield(owner)
        except BaseException:
            owner.cancel()
            try:
                async with asyncio.timeout(5):
                    await owner
            except BaseException:
                pass

    async def aclose(self) -> None:
        """Stop the session and reap the server process (idempotent)."""
        self.closed = True
        await self._stop_owner()


class MCPTool(Tool):
    """One tool of an MCP server."""

    def __init__(self, server: MCPServer, spec: ToolSpec) -> None:
        self.server = server
        self.remote_name = spec.name
        cfg = server.config
        self.spec = ToolSpec(cfg.prefix + spec.name, spec.description, spec.parameters)
        # the call's own deadline starts once the server is up; a (re)start is bounded by startup_timeout_s
        self.call_timeout_s = cfg.timeout_s
        self.timeout_s = cfg.timeout_s + cfg.startup_timeout_s
        self.max_concurrency = cfg.max_concurrency
        idem = cfg.idempotent
        self.idempotent = idem if isinstance(idem, bool) else spec.name in idem

    async def call(self, arguments: dict[str, Any]) -> str:
        await self.server.ensure()
        try:
            async with asyncio.timeout(self.call_timeout_s):
                return await self.server.call_tool(self.remote_name, arguments)
        except TimeoutError:
            await self._recover_after_timeout()
            raise TimeoutError(f"Error: tool {self.name} timed out after {self.call_timeout_s:g}s.") from None

    async def _recover_after_timeout(self) -> None:
        grace = min(self.call_timeout_s, 2.0)
        await self.server.drain_or_restart(grace, f"a reply still streaming {grace:g}s after {self.name} timed out")


_shared: dict[str, MCPServer] = {}
runtime.on_fork_in_child(_shared.clear)  # a forked worker starts its own servers (the parent's are its own)


async def open_mcp_tools(config: str | os.PathLike[str] | dict[str, Any] | MCPConfig) -> list[MCPTool]:
    """Start (or reuse) every configured server on rlf's runtime loop and return their tools.

    Servers are shared process-wide: the same server config gives the same running server.
    """

    async def _open() -> list[MCPTool]:
        cfg = load_mcp_config(config)
        tools: list[MCPTool] = []
        for name, scfg in cfg.servers.items():
            if scfg.disabled:
                log.debug("MCP server %s is disabled in the config; skipped", name)
                continue
            key = f"{name}:{scfg.key()}"
            server = _shared.get(key)
            if server is None or server.closed:
                server = _shared[key] = MCPServer(name, scfg)
                runtime.register_closer(server)
            specs = server.specs or await server.list_tools()
            tools.extend(MCPTool(server, s) for s in specs)
        return tools

    return await runtime.bridge(_open())


def mcp_tools(config: str | os.PathLike[str] | dict[str, Any] | MCPConfig) -> list[MCPTool]:
    """Synchronous `open_mcp_tools` (from code that is not on an event loop)."""
    return runtime.run(open_mcp_tools(config))


async def close_mcp_servers() -> None:
    """Stop every shared MCP server and reap its process."""

    async def _close() -> None:
        servers = list(_shared.values())
        _shared.clear()
        for s in servers:
            runtime.unregister_closer(s)
        await asyncio.gather(*(s.aclose() for s in servers), return_exceptions=True)

    await runtime.bridge(_close())
