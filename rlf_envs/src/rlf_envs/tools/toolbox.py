"""A Toolbox is the set of tools an env can call plus the ToolCaller that runs them.

Envs built with the same tools (e.g. the N copies of a vector env, or many `gymnasium.make` calls with
the same MCP config) share one Toolbox: one caller, one set of limits and metrics, one set of servers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rlf_envs import runtime
from rlf_envs.tools.base import Tool, ToolSpec
from rlf_envs.tools.caller import CallerConfig, CallerMetrics, ToolCaller
from rlf_envs.tools.python import FunctionTool
from rlf_envs.types import ToolCall, ToolResult

ToolLike = Tool | Callable[..., Any]
MCPSource = str | os.PathLike[str] | dict[str, Any]


class Toolbox:
    """Tools + caller. All calls run on rlf's runtime loop, whichever loop or thread asks."""

    def __init__(self, tools: Iterable[ToolLike] = (), config: CallerConfig | dict[str, Any] | None = None) -> None:
        if isinstance(config, dict):
            config = CallerConfig.model_validate(config)
        resolved: list[Tool] = []
        for t in tools:
            if isinstance(t, Tool):
                resolved.append(t)
            elif callable(t):
                resolved.append(FunctionTool(t))
            else:
                raise TypeError(f"not a tool: {t!r}; pass rlf Tool objects or typed Python functions")
        self.caller = ToolCaller(resolved, config)

    @property
    def tools(self) -> dict[str, Tool]:
        return self.caller.tools

    @property
    def specs(self) -> list[ToolSpec]:
        return [t.spec for t in self.caller.tools.values()]

    @property
    def metrics(self) -> CallerMetrics:
        return self.caller.metrics

    async def call_batch(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        if not calls:
            return []
        return await runtime.bridge(self.caller.call_batch(calls))

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """The `ToolInvoker` protocol used by tool-verified rewards."""
        return (await self.call_batch([ToolCall(name, arguments)]))[0]


_shared: dict[tuple[Any, ...], Toolbox] = {}
runtime.on_fork_in_child(_shared.clear)  # toolboxes hold sessions of the parent's loop


def shared_toolbox(
    tools: Sequence[ToolLike] = (),
    mcp_servers: MCPSource | None = None,
    config: CallerConfig | dict[str, Any] | None = None,
) -> Toolbox:
    """The process-wide Toolbox for these tools / MCP servers / limits (created on first use)."""
    import json

    cfg = config if isinstance(config, CallerConfig) else CallerConfig.model_validate(config or {})
    mcp_key = json.dumps(mcp_servers, sort_keys=True, default=str) if mcp_servers is not None else None
    key = (tuple(id(t) for t in tools), mcp_key, cfg.model_dump_json())
    box = _shared.get(key)
    if box is None:
        all_tools: list[ToolLike] = list(tools)
        if mcp_servers is not None:
            from rlf_envs.tools.mcp import mcp_tools

            all_tools.extend(mcp_tools(mcp_servers))
        box = _shared[key] = Toolbox(all_tools, cfg)
        box._keepalive = tuple(tools)  # type: ignore[attr-defined]  # keep ids in the key valid
    return box
