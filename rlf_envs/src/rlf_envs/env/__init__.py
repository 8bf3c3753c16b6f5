"""The environments: ToolEnv (gymnasium.Env) and ToolVectorEnv (gymnasium.vector.VectorEnv), and the token-episode
protocol every trainer drives them with (`rlf_envs.env.episodes`)."""

from rlf_envs.env.spaces import AnyText, token_space
from rlf_envs.env.tool_env import ToolEnv
from rlf_envs.env.vector import StepResult, ToolVectorEnv

__all__ = ["AnyText", "StepResult", "ToolEnv", "ToolVectorEnv", "token_space"]
