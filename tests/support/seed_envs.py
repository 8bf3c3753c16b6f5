"""`rlf_test/SeedLog-v0`: the Parity-v0 env (tests/support/train_envs.py) that logs the seed of every training reset, in
order, in `SEEN` (this process). The trainer seeds row r of update u's batch with `seed_base(seed, u) + r`, sync and
async, local sampler and vLLM alike: these tests read what each reset actually got."""

from __future__ import annotations

from typing import Any

import gymnasium
from train_envs import FirstTokenParity, parity_tasks

from rlf_envs.env import ToolEnv

SEED_LOG_ID = "rlf_test/SeedLog-v0"
SEEN: list[int | None] = []  # the seed of every reset of a train-split env, in order


class SeedLogEnv(ToolEnv):
    async def areset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        if self.tasks[0].id.startswith("train-"):
            SEEN.append(seed)
        return await super().areset(seed=seed, options=options)


def make_seed_log(split: str = "train", max_turns: int = 1, max_total_tokens: int = 256, max_obs_tokens: int = 64,
                  tokenizer: Any = None) -> ToolEnv:
    return SeedLogEnv(tasks=parity_tasks(split), verifier=FirstTokenParity(), format="search_r1", max_turns=max_turns,
                      max_total_tokens=max_total_tokens, max_obs_tokens=max_obs_tokens, tokenizer=tokenizer)


if SEED_LOG_ID not in gymnasium.registry:
    gymnasium.register(SEED_LOG_ID, entry_point=make_seed_log)
