"""The trainer's rollout runs on rlf's one token-episode driver (`rlf_envs.env.episodes`): for the
quickstart's config and seed it gives exactly the token ids, masks and rewards of the trainer's earlier,
own lock-step loop (written out below as the reference), and its seconds/token counts add up."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from repo_paths import REPO

from rlf_envs import runtime
from rlf_envs.env.vector import ToolVectorEnv
from rlf_envs.types import Trajectory
from rlf_train.config import load_config
from rlf_train.policy.model import build_tiny_model
from rlf_train.policy.tokenizer import load_tokenizer
from rlf_train.rollout.batch import SamplingParams
from rlf_train.rollout.env_factory import make_envs
from rlf_train.rollout.local import StopChecker, generate_batched, rollout

ROOT = REPO


async def reference_rollout(venv: ToolVectorEnv, task_indices: Sequence[int], model: torch.nn.Module, tok: Any,
                            params: SamplingParams, seeds: Sequence[int], gen: torch.Generator,
                            batch_size: int) -> list[Trajectory]:
    """The trainer's lock-step loop as it was before it moved onto the shared driver."""
    n = len(task_indices)
    stop = StopChecker(tok, list(venv.envs[0].format.stop_strings), tok.eos_token_id)
    resets = await venv.areset_envs({i: {"task_index": int(t)} for i, t in enumerate(task_indices)},
                                    seeds={i: int(s) for i, s in enumerate(seeds)})
    contexts = {i: np.asarray(obs).astype(np.int64).tolist() for i, (obs, _) in resets.items()}
    active = list(range(n))
    while active:
        outs = generate_batched(model, [contexts[i] for i in active], params, stop, tok.pad_token_id, gen, batch_size)
        actions = dict(zip(active, outs, strict=True))
        results = await venv.astep_active(actions)
        still = []
        for i in active:
            contexts[i].extend(actions[i])
            if not results[i].done:
                contexts[i].extend(np.asarray(results[i].obs).astype(np.int64).tolist())
                still.append(i)
        active = still
    return [venv.envs[i].trajectory for i in range(n)]


def _summary(trajs: Sequence[Trajectory]) -> list[tuple[Any, ...]]:
    return [(list(t.token_ids or []), list(t.loss_mask or []), float(t.reward), t.end.value, len(t.turns))
            for t in trajs]


@pytest.fixture(scope="module")
def quickstart() -> tuple[Any, ...]:
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [])
    tok = load_tokenizer(cfg.model)
    torch.manual_seed(cfg.seed)
    model = build_tiny_model(cfg.model, len(tok), cfg.seed, tok.pad_token_id)
    return cfg, tok, model


def test_rollout_equals_the_reference_loop_on_the_quickstart_seed(quickstart: tuple[Any, ...]) -> None:
    cfg, tok, model = quickstart
    r = cfg.rollout
    n = 24  # 3 prompts x 8 samples, fewer envs than the pool holds (as the trainer's last batch may)
    params = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens_per_turn)
    tasks = [k // r.samples_per_prompt for k in range(n)]
    seeds = [cfg.seed * 100_000 + k for k in range(n)]
    venv = make_envs(cfg, tok, "train", 32)
    try:
        model.train()
        want = runtime.run(reference_rollout(venv, tasks, model.eval(), tok, params, seeds,
                                             torch.Generator().manual_seed(cfg.seed + 1), 16))
        want_s = _summary(want)
        model.train()
        got, stats = rollout(venv, tasks, model, tok, params, seeds=seeds, batch_size=16,
                             gen=torch.Generator().manual_seed(cfg.seed + 1))
        assert model.training  # the policy's mode is restored
        assert _summary(got) == want_s
        assert any(len(s[4:]) and s[4] > 1 for s in want_s), "the check needs multi-turn episodes"
        assert stats.turns == sum(len(t.turns) for t in got)
        assert stats.gen_tokens == sum(sum(t.loss_mask or []) for t in got)
        assert 0 < stats.gen_seconds < stats.total_seconds and 0 < stats.env_seconds < stats.total_seconds
    finally:
        venv.close()


def test_rollout_rejects_more_tasks_than_envs(quickstart: tuple[Any, ...]) -> None:
    cfg, tok, model = quickstart
    venv = make_envs(cfg, tok, "train", 2)
    try:
        with pytest.raises(ValueError, match=r"need 1\.\.2 task indices"):
            rollout(venv, [0, 1, 2], model, tok, SamplingParams())
    finally:
        venv.close()
