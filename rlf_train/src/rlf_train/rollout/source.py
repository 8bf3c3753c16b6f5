"""Where the RL loop's episodes come from: the `Source` protocol and `make_source(cfg, ...)`.

The learner asks a source for the episodes of some tasks at the current policy (`collect`) or for a worker that
generates ahead of it (`async_worker`, `rollout.mode: async`); it never knows which source runs. Three exist: the env
source (`env_source.EnvSource`: the configured engine generates, the env steps), the agent source
(`agent_source.AgentSource`, `rollout.agent`: the user's agent code against the policy endpoint) and the foreign
source (`foreign.source.ForeignSource`, `rollout.environment`: another framework's environment, its own rollout
code against the endpoint).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rlf_train.config import TrainConfig
from rlf_train.rollout.async_worker import AsyncPlan, RolloutWorker
from rlf_train.rollout.batch import Rollouts, SamplingParams
from rlf_train.rollout.env_factory import Stage

if TYPE_CHECKING:
    import torch

    from rlf_envs.env.vector import ToolVectorEnv
    from rlf_train.rollout.vllm import VllmRollout


class Source(Protocol):
    """What the RL loop needs from wherever its episodes come from.

    `collect` gives GRPO rows in task order: one per episode, or one per segment of an episode when
    `Rollouts.rewards` is set (an agent's sessions). `eval_metrics` is what the source counted over the eval batches
    since its last call, `summary` a line for the end of the run (or None), `close` ends what the source started."""

    @property
    def vllm(self) -> VllmRollout | None:
        """`rollout.engine: vllm`'s engine, once the first rollout built it (None otherwise)."""
        ...

    def collect(self, stage: Stage, task_indices: Sequence[int], params: SamplingParams, seed_base: int,
                gen: torch.Generator | None) -> Rollouts: ...

    def async_worker(self, plan: AsyncPlan) -> RolloutWorker: ...

    def eval_metrics(self) -> dict[str, float]: ...

    def summary(self) -> str | None: ...

    def close(self) -> None: ...


def make_source(cfg: TrainConfig, tokenizer: Any, envs: dict[Stage, ToolVectorEnv], run_dir: Path,
                model: Callable[[], Any], version: Callable[[], int]) -> Source:
    """The configured source: env-driven episodes, or with `rollout.agent` the agent's code, generating with the
    configured engine either way. `model()` is the current policy, `version()` its version (the number of changes
    so far: the vLLM engine reloads its weights when it moved on). The agent is checked here (a ConfigError naming
    `rollout.agent`)."""
    # imported here, not above: the sources bring torch, the engines and the endpoint's server, and this module
    # (the wing's face imports it) stays light for what only needs the contract
    from rlf_train.rollout.env_source import EnvSource

    engine = EnvSource(cfg, tokenizer, envs, run_dir, model, version)
    r = cfg.rollout
    if r.agent is None and r.environment is None:
        return engine
    from rlf_train.rollout.agent_source import AgentSource
    from rlf_train.rollout.endpoint.sessions import EndpointLimits

    if r.environment is not None:  # a foreign environment's own rollout is the agent (rlf_train.rollout.foreign)
        from rlf_train.rollout.foreign.source import ForeignSource

        return ForeignSource(r.environment, tokenizer, envs, engine,
                             EndpointLimits(r.max_total_tokens, r.max_new_tokens_per_turn, r.agent_timeout_s,
                                            r.agent_max_calls), r.agent_concurrency, r.samples_per_prompt,
                             SamplingParams(r.temperature, r.top_p, r.max_new_tokens_per_turn), r.max_turns)

    # the env gives tasks, format and verifier; the agent's code makes the episodes
    return AgentSource(r.agent, tokenizer, envs, engine,
                       EndpointLimits(r.max_total_tokens, r.max_new_tokens_per_turn, r.agent_timeout_s,
                                      r.agent_max_calls), r.agent_concurrency)
