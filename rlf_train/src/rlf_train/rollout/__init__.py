"""Where episodes come from: the rollout sources (`source`: the `Source` protocol and `make_source`; `env_source`,
`agent_source`), their async workers (`async_worker`, `weights`), the engines (`local`, `vllm`) with their sampler
and seeds (`sampling`, `seeds`), the configured env (`env_factory`) and the policy endpoint agent code talks to
(`endpoint`, `agent_runner`). `batch` is what every source hands the learner."""

from __future__ import annotations

import importlib
from typing import Any

from rlf_train.rollout.batch import (
    Rollouts,
    RolloutStats,
    SamplingParams,
    drive_episodes,
    drop_infra_failed,
    episode_stats,
    failure_rates,
    is_success,
    reward_stats,
)
from rlf_train.rollout.source import Source, make_source

#: the local engine's names that `rlf_train.rollout` held when it was one module, kept importable from here for one
#: release without importing torch with this package
_LOCAL = ("StopChecker", "cache_kwarg", "generate", "generate_batched", "kv_cache", "length_buckets",
          "local_generate_batch", "rollout", "run_episodes")


def __getattr__(name: str) -> Any:
    if name in _LOCAL:
        return getattr(importlib.import_module("rlf_train.rollout.local"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RolloutStats", "Rollouts", "SamplingParams", "Source", "drive_episodes", "drop_infra_failed",
           "episode_stats", "failure_rates", "is_success", "make_source", "reward_stats"]
