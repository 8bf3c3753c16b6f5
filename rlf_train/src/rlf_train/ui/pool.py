"""The web UI's tool pool: MCP servers and Python tools, checked live and tried with arguments.

All of it is rlf_envs' code: an `mcpServers` text is validated by `load_mcp_config` / `MCPServerConfig`, a server
is connected by `MCPServer` (rlf's stdio transport reaps its process tree) on rlf's runtime loop, its tools are
`MCPTool`s, Python tools come from `rlf_train.ui.pool_env.load_python_tools` (what the `rlf_ui/Pool-v0` env of a
run uses), and a trial is one `ToolCaller.call` (schema validation, deadline, output truncation, error results).
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml

from rlf_envs import runtime
from rlf_envs.errors import RlfError
from rlf_envs.records import atomic_write_text
from rlf_envs.tools.base import Tool, ToolCrashed
from rlf_envs.tools.caller import CallerConfig, ToolCaller
from rlf_envs.tools.mcp import MCPServer, MCPServerConfig, MCPTool, load_mcp_config
from rlf_envs.types import ToolCall
from rlf_train.ui.pool_env import ToolSourceError, load_python_tools, schema_problem

#: a name the page may give a server: what an mcpServers key usually is (no paths, no markup)
MAX_NAME = 64
Status = Literal["unchecked", "checking", "ok", "error"]


class PoolError(RlfError, ValueError):
    """Bad input for the pool (a text that is not an mcpServers map, an unknown server, bad arguments)."""


class ToolInfo(pydantic.BaseModel):
    """One tool as the page shows it."""

    name: str
    description: str
    parameters: dict[str, Any]
    schema_error: str | None = None


class SourceView(pydantic.BaseModel):
    """A server or a Python module of the pool, as the page shows it."""

    kind: Literal["mcp", "python"]
    name: str
    status: Status
    error: str | None = None
    transport: str = ""
    target: str = ""  # the command line or URL (MCP), the import path (Python)
    tools: list[ToolInfo] = []
    checked_at: float | None = None
    restarts: int = 0


class TrialResult(pydantic.BaseModel):
    """What one call of a tool returned (rlf's ToolResult)."""

    tool: str
    status: str
    content: str
    latency_s: float
    attempts: int
    truncated: bool


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 2000 else text[:2000] + " ..."


def _tool_info(t: Tool) -> ToolInfo:
    return ToolInfo(name=t.name, description=t.spec.description or "", parameters=dict(t.spec.parameters or {}),
                    schema_error=schema_problem(t.spec.parameters))


@dataclass
class _Source:
    kind: Literal["mcp", "python"]
    name: str
    entry: dict[str, Any] = field(default_factory=dict)  # mcp: the mcpServers entry as given
    status: Status = "unchecked"
    error: str | None = None
    tools: list[Tool] = field(default_factory=list)
    server: _PoolServer | None = None
    caller: ToolCaller | None = None
    checked_at: float | None = None
    task: asyncio.Task[None] | None = None

    def view(self) -> SourceView:
        if self.kind == "mcp":
            cfg = MCPServerConfig.model_validate(self.entry)
            target = cfg.url or " ".join([cfg.command or "", *cfg.args])
            transport = cfg.transport
        else:
            target, transport = self.name, "python"
        return SourceView(kind=self.kind, name=self.name, status=self.status, error=self.error, transport=transport,
                          target=target, tools=[_tool_info(t) for t in self.tools], checked_at=self.checked_at,
                          restarts=self.server.restarts if self.server is not None else 0)


def parse_servers_text(text: str) -> dict[str, dict[str, Any]]:
    """The entries of an `mcpServers` file's text (JSON, as Claude Desktop / Cursor / Cline write it, or YAML),
    validated by rlf_envs' `load_mcp_config`; a bare `{name: entry}` map is accepted too."""
    if not text.strip():
        raise PoolError("the mcpServers text is empty: paste a file like {\"mcpServers\": {\"time\": {\"command\": "
                        "\"mcp-server-time\"}}}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as je:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            raise PoolError(f"not valid JSON (line {je.lineno}, column {je.colno}: {je.msg}) nor YAML") from None
    if isinstance(data, dict) and "mcpServers" not in data and data and all(
            isinstance(v, dict) and ("command" in v or "url" in v) for v in data.values()):
        data = {"mcpServers": data}
    try:
        cfg = load_mcp_config(data)
    except ValueError as e:
        raise PoolError(str(e)) from None
    if not cfg.servers:
        raise PoolError("mcpServers is empty: add at least one server")
    raw = data["mcpServers"]
    for name in raw:
        check_name(name)
    return {str(k): dict(v) for k, v in raw.items()}


def check_name(name: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise PoolError("a server needs a name")
    if len(name) > MAX_NAME:
        raise PoolError(f"server name {name[:MAX_NAME]!r}...: at most {MAX_NAME} characters")
    return name


def _leaves(e: BaseException) -> list[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        return [leaf for sub in e.exceptions for leaf in _leaves(sub)]
    return [e]


def explain_start_failure(e: ToolCrashed, cfg: MCPServerConfig) -> str:
    """rlf's 'failed to start' message with the reason it wraps (the SDK raises exception groups): the server
    exited, answered but not as MCP, or nothing listens at the URL."""
    text = str(e)
    context = e.__context__
    if context is None or "failed to start" not in text:
        return text
    head = text.split(": ", 1)[0] if ": " in text else text
    why: list[str] = []
    for leaf in _leaves(context):
        msg = " ".join(str(getattr(leaf, "message", None) or leaf).split())
        code = getattr(leaf, "code", None)
        if type(leaf).__name__ == "ConnectError":
            why.append(f"nothing answers at {cfg.url} ({msg})")
        elif code == -32000 and cfg.command is not None:
            why.append("the server process exited (or closed its output) before it answered the MCP handshake")
        elif code == -32601:
            why.append(f"it answered, but not as an MCP server ({msg})")
        elif code is not None and cfg.url is not None:
            why.append(f"{cfg.url} answered, but not as an MCP server ({msg})")
        else:
            why.append(f"{type(leaf).__name__}: {msg}")
    return f"{head}: {'; '.join(why)}"


def _safe_file(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64] or "server"


class _PoolServer(MCPServer):
    """rlf's `MCPServer`, the stdio server's stderr going to a file the page shows (rlf's transport lets the server
    inherit the app's stderr, where a user of the page would never see why it did not start)."""

    def __init__(self, name: str, config: MCPServerConfig, stderr_path: Path | None) -> None:
        super().__init__(name, config)
        self.stderr_path = stderr_path

    def _stdio_transport(self) -> Any:
        from rlf_envs.tools.mcp_stdio import BoundedStdioTransport

        c = self.config
        if self.stderr_path is None or c.command is None:
            return super()._stdio_transport()
        self.stderr_path.parent.mkdir(parents=True, exist_ok=True)
        self.stderr_path.write_bytes(b"")
        # the same process (exec), its stderr appended to the file
        script = f'exec "$0" "$@" 2>>{shlex.quote(str(self.stderr_path))}'
        self._transport = BoundedStdioTransport("/bin/sh", ["-c", script, c.command, *c.args], env=dict(c.env) or None,
                                                cwd=c.cwd, max_reply_bytes=c.max_reply_bytes)
        return self._transport

    def stderr_tail(self, limit: int = 1500) -> str:
        if self.stderr_path is None or not self.stderr_path.is_file():
            return ""
        text = self.stderr_path.read_bytes()[-limit:].decode("utf-8", "replace").strip()
        return f"; its stderr ends with:\n{text}" if text else ""


class ToolPool:
    """The pool's sources, keyed `mcp:<name>` / `python:<spec>`. Used from one event loop (the app's); MCP work
    runs on rlf's runtime loop through `runtime.bridge`. `state_file` keeps the entries across restarts; `log_dir`
    gets each stdio server's stderr."""

    def __init__(self, state_file: Path | None = None, log_dir: Path | None = None) -> None:
        self.state_file = state_file
        self.log_dir = log_dir
        self.sources: dict[str, _Source] = {}
        self._load_state()

    # ------------------------------------------------------------------ state
    def _load_state(self) -> None:
        if self.state_file is None or not self.state_file.is_file():
            return
        try:
            data = json.loads(self.state_file.read_text(encoding="utf-8"))
            for name, entry in dict(data.get("mcpServers", {})).items():
                MCPServerConfig.model_validate(entry)
                self.sources[f"mcp:{name}"] = _Source("mcp", name, entry=dict(entry))
            for spec in list(data.get("python", [])):
                self.sources[f"python:{spec}"] = _Source("python", str(spec))
        except (OSError, ValueError, TypeError, AttributeError, pydantic.ValidationError):
            self.sources = {}  # a damaged state file: start with an empty pool (the file is rewritten on change)

    def _save_state(self) -> None:
        if self.state_file is None:
            return
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.state_file, json.dumps(self.servers_file(None) | {"python": [
            s.name for s in self.sources.values() if s.kind == "python"]}, indent=2))
        os.chmod(self.state_file, 0o600)  # entries may hold env values (API keys)

    # ------------------------------------------------------------------ views
    def views(self) -> list[SourceView]:
        return [s.view() for s in self.sources.values()]

    def get(self, key: str) -> _Source:
        src = self.sources.get(key)
        if src is None:
            raise PoolError(f"no {key!r} in the pool (it has: {', '.join(self.sources) or 'nothing'})")
        return src

    def servers_file(self, names: list[str] | None) -> dict[str, Any]:
        """The `mcpServers` map of the named servers (None: all), as a run's env gets it."""
        servers = {s.name: s.entry for s in self.sources.values() if s.kind == "mcp"
                   and (names is None or s.name in names)}
        return {"mcpServers": servers}

    def python_specs(self) -> list[str]:
        return [s.name for s in self.sources.values() if s.kind == "python"]

    # ------------------------------------------------------------------ changes
    async def add_servers(self, entries: dict[str, dict[str, Any]]) -> list[SourceView]:
        """Add (or replace) servers and check each one live, all at once."""
        for name, entry in entries.items():
            check_name(name)
            try:
                MCPServerConfig.model_validate(entry)
            except pydantic.ValidationError as e:
                problems = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or '(entry)'}: {err['msg']}"
                                     for err in e.errors())
                raise PoolError(f"mcpServers.{name}: {problems}") from None
        for name, entry in entries.items():
            key = f"mcp:{name}"
            old = self.sources.pop(key, None)
            if old is not None:
                await self._disconnect(old)
            self.sources[key] = _Source("mcp", name, entry=dict(entry))
        self._save_state()
        await asyncio.gather(*(self.check(f"mcp:{n}") for n in entries))
        return [self.sources[f"mcp:{n}"].view() for n in entries]

    async def add_python(self, spec: str) -> SourceView:
        spec = spec.strip()
        key = f"python:{spec}"
        src = self.sources.get(key) or _Source("python", spec)
        self.sources[key] = src
        await self.check(key)
        if src.status == "error":  # not kept: a module that does not load is not a pool entry
            self.sources.pop(key, None)
        else:
            self._save_state()
        return src.view()

    async def remove(self, key: str) -> None:
        src = self.get(key)
        await self._disconnect(src)
        self.sources.pop(key, None)
        self._save_state()

    async def check(self, key: str) -> SourceView:
        """Connect (again) and list the tools: for a server, a new session; for Python, a fresh import."""
        src = self.get(key)
        await self._disconnect(src)
        src.status, src.error, src.tools = "checking", None, []
        try:
            if src.kind == "mcp":
                await self._connect(src)
            else:
                src.tools = list(load_python_tools(src.name))
                src.caller = ToolCaller(src.tools, CallerConfig(timeout_s=30.0))
            src.status = "ok"
        except (ToolSourceError, PoolError) as e:
            src.status, src.error = "error", str(e)
            await self._disconnect(src)
        except Exception as e:
            src.status, src.error = "error", _one_line(e)
            await self._disconnect(src)
        src.checked_at = time.time()
        return src.view()

    async def _connect(self, src: _Source) -> None:
        cfg = MCPServerConfig.model_validate(src.entry)
        if cfg.disabled:
            raise PoolError(f"MCP server {src.name!r} is disabled in its entry (disabled: true); a run skips it")
        if cfg.command is not None and not (cfg.cwd and os.sep in cfg.command):
            path = (cfg.env or {}).get("PATH", os.environ.get("PATH", ""))
            if shutil.which(cfg.command, path=path) is None:
                raise PoolError(f"MCP server {src.name!r}: command {cfg.command!r} not found (not a file, and not on "
                                "PATH); give the full path, or install it in the environment the app runs in")
        stderr = self.log_dir / f"{_safe_file(src.name)}.stderr.log" if self.log_dir is not None else None
        server = _PoolServer(src.name, cfg, stderr)
        src.server = server
        runtime.register_closer(server)  # reaped at interpreter exit even if the app is not shut down cleanly
        # rlf's own deadlines bound the start (startup_timeout_s, then up to 15 s to end a server that hung) and
        # the listing (startup_timeout_s); this one only guards against a bug in them
        guard = 2 * cfg.startup_timeout_s + 30.0
        try:
            async with asyncio.timeout(guard):
                specs = await runtime.bridge(server.list_tools())
        except TimeoutError:
            raise PoolError(f"MCP server {src.name!r} did not list its tools within {guard:g}s"
                            + server.stderr_tail()) from None
        except ValueError as e:  # e.g. an allow-list naming tools the server does not have
            raise PoolError(str(e)) from None
        except ToolCrashed as e:
            raise PoolError(explain_start_failure(e, cfg) + server.stderr_tail()) from None
        src.tools = [MCPTool(server, s) for s in specs]
        names = [t.name for t in src.tools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise PoolError(f"MCP server {src.name!r} lists tool names more than once: {dup}")
        src.caller = ToolCaller(src.tools, CallerConfig(timeout_s=cfg.timeout_s + cfg.startup_timeout_s))

    async def _disconnect(self, src: _Source) -> None:
        server, src.server, src.caller = src.server, None, None
        if server is not None:
            try:
                await runtime.bridge(server.aclose())
            finally:
                runtime.unregister_closer(server)

    async def try_tool(self, key: str, tool: str, arguments_text: str) -> TrialResult:
        """Call one tool with the arguments (a JSON object's text) through rlf's ToolCaller."""
        src = self.get(key)
        if src.status != "ok" or src.caller is None:
            raise PoolError(f"{src.name!r} is not connected ({src.status}{': ' + src.error if src.error else ''}); "
                            "check it first")
        try:
            arguments = json.loads(arguments_text or "{}")
        except json.JSONDecodeError as e:
            raise PoolError(f"the arguments are not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
        if tool not in src.caller.tools:
            raise PoolError(f"{src.name!r} has no tool {tool!r}; it has {sorted(src.caller.tools)}")
        caller = src.caller
        res = await runtime.bridge(caller.call(ToolCall(tool, arguments)))
        return TrialResult(tool=tool, status=res.status.value, content=res.content, latency_s=res.latency_s,
                           attempts=res.attempts, truncated=res.truncated)

    def connected(self) -> int:
        return sum(s.server is not None for s in self.sources.values())

    async def disconnect_all(self) -> int:
        """Close every server session (the entries stay; a check reconnects). Returns how many were open."""
        live = [s for s in self.sources.values() if s.server is not None]
        await asyncio.gather(*(self._disconnect(s) for s in live), return_exceptions=True)
        for s in live:
            if s.status == "ok":
                s.status, s.error = "unchecked", "closed (the last page closed or the app stopped); check to reconnect"
        return len(live)
