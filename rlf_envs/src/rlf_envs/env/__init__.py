"""The environments: ToolEnv (gymnasium.Env) and ToolVectorEnv (gymnasium.vector.VectorEnv)."""

from rlf_envs.env.spaces import AnyText, token_space
from rlf_envs.env.tool_env import ToolEnv
from rlf_envs.env.vector import StepResult, ToolVectorEnv

__all__ = ["AnyText", "StepResult", "ToolEnv", "ToolVectorEnv", "token_space"]
