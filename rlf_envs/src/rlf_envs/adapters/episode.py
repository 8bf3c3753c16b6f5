"""Kept for one release: the token-episode protocol lives in `rlf_envs.env.episodes`, beside `ToolVectorEnv`
(and `make_tool_env` in `rlf_envs.registration`); import them from there."""

from __future__ import annotations

from rlf_envs.env.episodes import (
    ENV_ERROR,
    MAX_LENGTH,
    DriveStats,
    GenerateBatchFn,
    GenerateFn,
    Generation,
    TokenEpisode,
    obs_ids,
    run_token_episode,
    run_token_episodes,
    run_token_episodes_sync,
)
from rlf_envs.registration import make_tool_env

__all__ = [
    "ENV_ERROR", "MAX_LENGTH", "DriveStats", "GenerateBatchFn", "GenerateFn", "Generation", "TokenEpisode",
    "make_tool_env", "obs_ids", "run_token_episode", "run_token_episodes", "run_token_episodes_sync",
]
