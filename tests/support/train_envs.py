"""Tiny envs for the trainer tests (imported by them, and by trainer subprocesses via `env.imports`).

`rlf_test/Parity-v0`: one turn; the reward depends only on the policy's first token id (1.0 if even,
0.5 if it is 1 mod 4, else 0). A randomly initialised policy over a 3k vocabulary draws near-uniform
first tokens, so every GRPO group has mixed rewards, non-zero advantages and a non-zero gradient, and
"rewarded behaviour" is exactly known: the first tokens the verifier paid for.

`pause_after` (a run's `checkpoints/latest`) and `pause_at` (a checkpoint name): once that file names
`pause_at`, the episode scored `pause_skip` episodes later creates the file `pause_on` and blocks the
process for good, so a subprocess test can SIGKILL a run parked at a known point after a checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import gymnasium

from rlf_envs.env import ToolEnv
from rlf_envs.rewards.base import Verifier
from rlf_envs.types import Score, Task, Trajectory

PARITY_ID = "rlf_test/Parity-v0"


def parity_reward(first_token: int) -> float:
    return 1.0 if first_token % 2 == 0 else 0.5 if first_token % 4 == 1 else 0.0


_SCORED_SINCE_PAUSE_AT = [0]  # episodes scored (by any env of the process) since `pause_at` was seen


class FirstTokenParity(Verifier):
    name = "parity"

    def __init__(self, pause_on: str | None = None, pause_after: str | None = None, pause_at: str | None = None,
                 pause_skip: int = 0) -> None:
        self.pause_on = Path(pause_on) if pause_on else None
        self.pause_after = Path(pause_after) if pause_after else None
        self.pause_at = pause_at
        self.pause_skip = pause_skip

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        if self.pause_on is not None and self.pause_after is not None and self.pause_after.is_file() \
                and self.pause_after.read_text().strip() == self.pause_at:
            _SCORED_SINCE_PAUSE_AT[0] += 1
            if _SCORED_SINCE_PAUSE_AT[0] > self.pause_skip:
                self.pause_on.touch()
                while True:  # parked (the whole process: this is rlf's loop thread) until the test kills it
                    time.sleep(0.05)
        span = trajectory.turns[0].action_span if trajectory.turns else None
        if span is None or trajectory.token_ids is None or span[1] <= span[0]:
            return Score(0.0)
        return Score(parity_reward(trajectory.token_ids[span[0]]))


def parity_tasks(split: str) -> list[dict[str, Any]]:
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; Parity-v0 has 'train' and 'test'")
    n = 6 if split == "train" else 5
    return [{"id": f"{split}-{i}", "question": f"Say something about {split} item {i}.", "answers": ["x"]}
            for i in range(n)]


def make_parity(split: str = "train", pause_on: str | None = None, pause_after: str | None = None,
                pause_at: str | None = None, pause_skip: int = 0, max_turns: int = 1, max_total_tokens: int = 256,
                max_obs_tokens: int = 64, tokenizer: Any = None, format: str = "search_r1") -> ToolEnv:
    return ToolEnv(tasks=parity_tasks(split), verifier=FirstTokenParity(pause_on, pause_after, pause_at, pause_skip),
                   format=format, max_turns=max_turns, max_total_tokens=max_total_tokens,
                   max_obs_tokens=max_obs_tokens, tokenizer=tokenizer)


if PARITY_ID not in gymnasium.registry:
    gymnasium.register(PARITY_ID, entry_point=make_parity)


# the trainer spec tests' shape (tests/train/test_*_spec.py)
G = 4  # samples per prompt
P = 3  # prompts per step
N = G * P
MAX_TOTAL = 128


def spec_cfg(run_dir: Path, extra: list[str] | None = None) -> Any:
    """The trainer spec tests' config: Parity with a one-layer tiny model, one update, no SFT, no KL."""
    from rlf_train.config import load_config

    return load_config(None, [
        f"env.id={PARITY_ID}", "env.imports=[train_envs]", "env.eval_split=test",
        f"logging.run_dir={run_dir}", "logging.progress=false", "logging.tensorboard=false", "threads=1",
        "logging.trajectories_every=0",
        "model.tiny.hidden_size=16", "model.tiny.intermediate_size=32", "model.tiny.num_layers=1",
        f"rollout.prompts_per_step={P}", f"rollout.samples_per_prompt={G}", "rollout.max_turns=1",
        "rollout.max_new_tokens_per_turn=4", f"rollout.max_total_tokens={MAX_TOTAL}", "rollout.max_obs_tokens=32",
        "sft.enabled=false", "algorithm.steps=1", "algorithm.kl_coef=0", "optim.grad_clip=1e6",
        "optim.lr=5e-2", "eval.num_tasks=3", "eval.before_rl=false", "eval.sampled=false", "seed=5",
        *(extra or []),
    ])
