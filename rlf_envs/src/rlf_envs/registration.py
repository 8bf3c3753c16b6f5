"""Gymnasium ids: `rlf/Calculator-v0`, `rlf/Tools-v0`, `rlf/Search-v0`, `rlf/SQL-v0`, `rlf/Code-v0` (env and vector
entry points)."""

from __future__ import annotations

from typing import Any

import gymnasium as gym

ENVS = {
    "rlf/Calculator-v0": "rlf_envs.envs.calculator:CalculatorEnv",
    "rlf/Tools-v0": "rlf_envs.envs.demo:ToolsEnv",
    "rlf/Search-v0": "rlf_envs.envs.search:SearchEnv",
    "rlf/SQL-v0": "rlf_envs.envs.sql:SqlEnv",
    "rlf/Code-v0": "rlf_envs.envs.code:CodeEnv",
}


def _vector_entry(entry: str) -> Any:
    def make_vec(num_envs: int = 1, **kwargs: Any) -> Any:
        from rlf_envs.env.vector import make_tool_vector_env

        mod, cls = entry.split(":")
        env_cls = getattr(__import__(mod, fromlist=[cls]), cls)
        return make_tool_vector_env(num_envs=num_envs, env_cls=env_cls, **kwargs)

    return make_vec


def register_envs() -> None:
    for env_id, entry in ENVS.items():
        if env_id in gym.registry:
            continue
        gym.register(id=env_id, entry_point=entry, vector_entry_point=_vector_entry(entry), disable_env_checker=True)
