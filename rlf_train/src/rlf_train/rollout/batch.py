"""What a rollout hands the learner: GRPO rows (`Rollouts`), their timing (`RolloutStats`), the episode statistics the
trainer logs, and `drive_episodes`, the env-driven episode loop both engines (local, vLLM) run on."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rlf_envs.env.episodes import DriveStats, GenerateBatchFn, TokenEpisode, run_token_episodes
from rlf_envs.env.vector import ToolVectorEnv
from rlf_envs.records import SUCCESS_THRESHOLD
from rlf_envs.types import Trajectory


@dataclass(frozen=True)
class SamplingParams:
    """How a rollout samples each turn (rollout.temperature, top_p, max_new_tokens_per_turn)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 48


@dataclass
class RolloutStats:
    """Where a rollout's time went, and how much it generated."""

    gen_seconds: float = 0.0
    env_seconds: float = 0.0
    total_seconds: float = 0.0
    gen_tokens: int = 0
    turns: int = 0


@dataclass
class Rollouts:
    """What a rollout source gives the trainer: GRPO rows (one per episode for env-driven rollouts; one per
    segment for an agent's sessions, `episode_of_row` says whose), in task order."""

    trajectories: list[Trajectory]
    episode_of_row: list[int]
    stats: RolloutStats
    metrics: dict[str, float]
    rewards: list[float] | None = None  # per episode (None: each row is an episode)

    def episode_rewards(self) -> list[float]:
        return list(self.rewards) if self.rewards is not None else [t.reward for t in self.trajectories]


def drop_infra_failed(trajs: Sequence[Trajectory], task_indices: Sequence[int],
                      group_size: int) -> tuple[list[Trajectory], list[int], int]:
    """Remove every GRPO group (rows i*G..(i+1)*G-1) holding an infrastructure-failed episode
    (`Trajectory.infra_failed`): its reward is no signal, and the group's advantages would be normalised against it.
    Returns the kept trajectories, their task indices and the number of infra-failed episodes."""
    failed = sum(t.infra_failed for t in trajs)
    if not failed:
        return list(trajs), list(task_indices), 0
    keep_t: list[Trajectory] = []
    keep_i: list[int] = []
    for g in range(0, len(trajs), group_size):
        group = trajs[g:g + group_size]
        if not any(t.infra_failed for t in group):
            keep_t += group
            keep_i += task_indices[g:g + group_size]
    return keep_t, keep_i, failed


def is_success(t: Trajectory) -> bool:
    return t.reward >= SUCCESS_THRESHOLD


def reward_stats(rewards: Sequence[float]) -> dict[str, float]:
    """Mean and std (population) of episode rewards, and the share at or above the success threshold."""
    r = np.array(rewards, dtype=np.float64)
    return {"reward_mean": float(r.mean()) if len(r) else 0.0, "reward_std": float(r.std()) if len(r) else 0.0,
            "success_rate": float((r >= SUCCESS_THRESHOLD).sum()) / max(len(r), 1)}


def episode_stats(trajs: Sequence[Trajectory]) -> dict[str, float]:
    n = max(len(trajs), 1)
    return {
        **reward_stats([t.reward for t in trajs]),
        "turns_mean": sum(len(t.turns) for t in trajs) / n,
        "tool_calls_mean": sum(t.num_tool_calls for t in trajs) / n,
        "tool_errors_mean": sum(t.num_tool_errors for t in trajs) / n,
        "invalid_turns_mean": sum(t.num_invalid_turns for t in trajs) / n,
        "unknown_tool_calls_mean": sum(t.num_unknown_tool_calls for t in trajs) / n,
        **_zero_tool_reward(trajs),
        "search_rate": sum(t.num_tool_calls > 0 for t in trajs) / n,
        "answered_rate": sum(t.answer is not None for t in trajs) / n,
        "tokens_total_mean": sum(len(t.token_ids or []) for t in trajs) / n,
        "tokens_policy_mean": sum(sum(t.loss_mask or []) for t in trajs) / n,
        **failure_rates(trajs),
    }


def _zero_tool_reward(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """The mean reward of the episodes that made no tool call (when there are any): reward earned without tools."""
    none = [t.reward for t in trajs if t.num_tool_calls == 0]
    return {"zero_tool_reward_mean": sum(none) / len(none)} if none else {}


def failure_rates(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """The share of episodes per failure of their own doing that the env names in `score_info` (`failure/<kind>`:
    a patch too large, a session past its wall clock, tampering with the verdict...), so a rising rate shows."""
    n = max(len(trajs), 1)
    kinds = sorted({k for t in trajs for k in t.score_info if k.startswith("failure/")})
    return {k: sum(1 for t in trajs if t.score_info.get(k)) / n for k in kinds}


async def drive_episodes(
    venv: ToolVectorEnv,
    task_indices: Sequence[int],
    generate_batch: GenerateBatchFn,
    params: SamplingParams,
    *,
    seeds: Sequence[int] | None = None,
    check_turn_length: bool = True,
) -> tuple[list[TokenEpisode], RolloutStats]:
    """One episode on each of the first len(task_indices) envs (env i on task_indices[i]) through rlf's
    token-episode driver (`rlf_envs.env.episodes.run_token_episodes`), at most `params.max_new_tokens`
    per turn, with any engine's `generate_batch`: the local sampler (`rlf_train.rollout.local.run_episodes`) and
    `rlf_train.rollout.vllm` both roll out here."""
    n = len(task_indices)
    if not 0 < n <= venv.num_envs:
        raise ValueError(f"need 1..{venv.num_envs} task indices (one per env), got {n}")
    t0 = time.perf_counter()
    drive = DriveStats()
    episodes = await run_token_episodes(
        venv, generate_batch=generate_batch, num_episodes=n, stats=drive,
        options=[{"task_index": int(ti)} for ti in task_indices],
        seeds=None if seeds is None else [int(s) for s in seeds], max_tokens_per_turn=params.max_new_tokens,
        check_turn_length=check_turn_length)
    stats = RolloutStats(gen_seconds=drive.gen_seconds, env_seconds=drive.env_seconds,
                         total_seconds=time.perf_counter() - t0, gen_tokens=drive.gen_tokens, turns=drive.turns)
    return episodes, stats
