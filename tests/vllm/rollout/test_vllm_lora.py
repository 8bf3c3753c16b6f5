"""`rollout.engine: vllm` with `model.lora`: the engine samples from base + adapter. It is built from the policy
before RL (no adapter yet), then after each change of the adapter it reloads the merged weights
(`rlf_train.policy.lora.hf_state`) under the plain names; the log-probs vLLM sampled with equal the trainer's own
forward of the LoRA policy (peft's unmerged forward), within the tolerance test_vllm_rollout.py uses for full
weights (measured: 1.4e-6 and 1.9e-6 in two runs)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from openrlhf_support import search_config
from vllm_support import TINY

from tests.vllm.rollout.test_vllm_rollout import LOGPROB_TOL, action_logprobs, behaviour, params, worst

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def trainer(bm25_index_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from rlf_train.trainer import Trainer

    cfg = search_config(bm25_index_dir, tmp_path_factory.mktemp("vllm_lora") / "run", backend="local", **{
        "model.tiny": TINY, "model.lora": {"rank": 4, "alpha": 8}, "rollout.engine": "vllm",
        "rollout.prompts_per_step": 4, "rollout.samples_per_prompt": 4, "rollout.max_new_tokens_per_turn": 12,
        "rollout.max_total_tokens": 512, "algorithm.micro_batch_size": 16, "optim.lr": 3e-3})
    cfg = cfg.model_copy(update={"openrlhf": type(cfg.openrlhf)()})
    t = Trainer(cfg)
    try:
        yield t
    finally:
        t.close_engine()


def test_vllm_engine_samples_from_base_plus_adapter_after_every_update(trainer: Any) -> None:
    from rlf_train.policy import lora

    r = trainer.cfg.rollout
    tasks = [p for p in range(r.prompts_per_step) for _ in range(r.samples_per_prompt)]
    sp = params(trainer)
    trajs, _ = trainer.source.rollouts(trainer.train_envs, tasks, sp, seed_base=0, gen=trainer.gen)  # plain policy
    base_lp = action_logprobs(trainer, trainer.model, trajs)
    assert worst(behaviour(trajs), base_lp) < LOGPROB_TOL
    trainer.model = lora.attach(trainer.model, trainer.cfg.model.lora, trainer.cfg.seed)  # as run_rl does
    optimizer = torch.optim.AdamW(lora.trainable(trainer.model), lr=trainer.cfg.optim.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    trainer.update(1, trajs, tasks, optimizer, scheduler, behaviour=False)
    with torch.no_grad():  # move the adapter further than one update on no reward does
        g = torch.Generator().manual_seed(1)
        for n, p in trainer.model.named_parameters():
            if ".lora_" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    trajs2, _ = trainer.source.rollouts(trainer.train_envs, tasks, sp, seed_base=100, gen=trainer.gen)
    assert trainer.vllm.reloads == 1
    new_lp = action_logprobs(trainer, trainer.model, trajs2)  # peft's forward: base + adapter, unmerged
    err = worst(behaviour(trajs2), new_lp)
    print(f"worst |vLLM - trainer| log-prob after the adapter moved: {err:.2e}")
    assert err < LOGPROB_TOL
    with lora.reference(lora.AdapterOff(trainer.model)) as base:
        assert worst(action_logprobs(trainer, base, trajs2), new_lp) > 1e-2  # the adapter does change the policy
