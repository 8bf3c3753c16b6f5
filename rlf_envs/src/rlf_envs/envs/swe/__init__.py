"""`rlf/SWE-v0`: repair a real Python repository with a shell and file tools; hidden tests decide the reward.

Modules: `tasks` (the typed task, shipped / SWE-bench-style loaders, repository materialisation), `verify`
(the hidden-test run on a fresh session), `tools` + `env` (the env), `pytest_report` (the outcome plugin).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:  # the env pulls in the sessions package: only on use
    if name in ("SweEnv", "swe_tasks"):
        from rlf_envs.envs.swe import env

        return getattr(env, name)
    raise AttributeError(name)


__all__ = ["SweEnv", "swe_tasks"]
