"""Tools (Python functions, MCP servers, HTTP endpoints) and the async tool caller."""

from rlf_envs.tools.base import InvalidArguments, Tool, ToolCrashed, ToolError, ToolSpec
from rlf_envs.tools.caller import CallerConfig, CallerMetrics, ToolCaller, ToolStats
from rlf_envs.tools.http import HTTPTool
from rlf_envs.tools.interpreter import PythonInterpreter
from rlf_envs.tools.mcp import MCPServerConfig, close_mcp_servers, load_mcp_config, mcp_tools, open_mcp_tools
from rlf_envs.tools.python import FunctionTool, tool
from rlf_envs.tools.toolbox import Toolbox, shared_toolbox

__all__ = [
    "CallerConfig", "CallerMetrics", "FunctionTool", "HTTPTool", "InvalidArguments", "MCPServerConfig",
    "PythonInterpreter", "Tool", "ToolCaller", "ToolCrashed", "ToolError", "ToolSpec", "ToolStats", "Toolbox",
    "close_mcp_servers", "load_mcp_config", "mcp_tools", "open_mcp_tools", "shared_toolbox", "tool",
]
