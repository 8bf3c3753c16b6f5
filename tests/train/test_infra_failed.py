"""Infrastructure failures are not rewards: an episode marked `infra_error` (a sandbox session the host failed)
leaves the GRPO loss with its whole group, the step counts it, and a batch of nothing but such groups skips the
update instead of training on reward 0."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import rlf_train.trainer as trainer_mod
from rlf_envs.types import Task, Trajectory
from rlf_train.rollout.batch import drop_infra_failed
from rlf_train.trainer import Trainer
from tests.train.test_grpo_spec import G, N, spec_cfg


def _t(i: int, failed: bool = False) -> Trajectory:
    return Trajectory(task=Task(id=str(i), question="p"), prompt="p", infra_error="session died" if failed else None)


def test_drop_infra_failed_removes_whole_groups() -> None:
    trajs = [_t(0), _t(0), _t(1, True), _t(1), _t(2), _t(2, True)]
    kept, idx, n = drop_infra_failed(trajs, [0, 0, 1, 1, 2, 2], 2)
    assert n == 2 and idx == [0, 0] and kept == trajs[:2]
    assert drop_infra_failed(trajs[:2], [0, 0], 2) == (trajs[:2], [0, 0], 0)
    assert not _t(0).infra_failed and _t(0, True).infra_failed


def test_an_infra_failed_episode_is_recorded_as_such() -> None:
    from rlf_envs.records import TrajectoryRecord

    rec = TrajectoryRecord.from_trajectory(_t(0, True))
    assert (rec.end_reason, rec.error) == ("infra_error", "session died")
    assert TrajectoryRecord.from_trajectory(_t(0)).error is None


def _step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failed_rows: set[int]) -> tuple[dict[str, Any], list[
        torch.Tensor], bool]:
    tr = Trainer(spec_cfg(tmp_path / "run"))
    before = copy.deepcopy(tr.model.state_dict())
    orig_rollouts, orig_loss = tr.source.rollouts, trainer_mod.policy_loss
    advs: list[torch.Tensor] = []

    def rollouts(venv: Any, idx: Any, params: Any, seed_base: int, gen: Any) -> Any:
        trajs, stats = orig_rollouts(venv, idx, params, seed_base, gen)
        for i in failed_rows:
            trajs[i].infra_error = "SessionInfraError: the session's agent died"
            trajs[i].reward = 0.0
        return trajs, stats

    def policy_loss(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, **kw: Any) -> Any:
        advs.append(adv.clone())
        return orig_loss(logp, old, adv, mask, **kw)

    monkeypatch.setattr(tr.source, "rollouts", rollouts)
    monkeypatch.setattr(trainer_mod, "policy_loss", policy_loss)
    opt = torch.optim.AdamW(tr.model.parameters(), lr=5e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    rec = tr.grpo_step(1, opt, sched)
    changed = any(not torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
    return rec, advs, changed


def test_an_infra_failed_episode_drops_its_group_from_the_loss(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    rec, advs, changed = _step(tmp_path, monkeypatch, {G + 1})  # one episode of the second group
    assert rec["infra_failed"] == 1 and rec["infra_dropped_rows"] == G
    assert sum(a.shape[0] for a in advs) == N - G  # the loss saw the other groups only
    assert changed


def test_a_batch_of_only_infra_failures_skips_the_update(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec, advs, changed = _step(tmp_path, monkeypatch, set(range(0, N, G)))  # one in every group
    assert rec["skipped_update"] == 1 and rec["infra_failed"] == N // G and "reward_mean" in rec
    assert advs == [] and not changed
