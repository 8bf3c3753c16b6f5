"""rlf_envs: multi-turn tool environments for RL on LLM agents, as Gymnasium envs.

    import gymnasium as gym, rlf_envs
    env = gym.make("rlf/Calculator-v0")

Importing rlf_envs registers its ids; it never imports torch or transformers.
"""

from __future__ import annotations

from rlf_envs.env import StepResult, ToolEnv, ToolVectorEnv
from rlf_envs.formats import Format, Qwen3Format, SearchR1Format, get_format
from rlf_envs.registration import register_envs
from rlf_envs.rewards.base import Verifier
from rlf_envs.tasks import load_tasks
from rlf_envs.tools import CallerConfig, FunctionTool, Tool, Toolbox, ToolError, mcp_tools, tool
from rlf_envs.types import Action, ActionKind, Score, Task, ToolCall, ToolResult, ToolStatus, Trajectory, Turn

__version__ = "0.1.0"

register_envs()


def close_all() -> None:
    """Stop every shared MCP server (reaping their processes). Also runs at interpreter exit."""
    from rlf_envs import runtime
    from rlf_envs.tools.mcp import close_mcp_servers

    runtime.run(close_mcp_servers())


__all__ = [
    "Action", "ActionKind", "CallerConfig", "Format", "FunctionTool", "Qwen3Format", "Score", "SearchR1Format",
    "StepResult", "Task", "Tool", "ToolCall", "ToolEnv", "ToolError", "ToolResult", "ToolStatus", "ToolVectorEnv",
    "Toolbox", "Trajectory", "Turn", "Verifier", "close_all", "get_format", "load_tasks", "mcp_tools", "tool",
]
