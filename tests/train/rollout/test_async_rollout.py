"""Asynchronous RL in the local backend (`rollout.mode: async`): the decoupled PPO loss against a numpy
re-implementation, the staleness bound as admission control (instrumented), partial rollouts keeping each
turn's policy version and behaviour log-probs, the trainer's math checks on the async path, and a SIGKILL
mid-async-run resuming exactly."""

from __future__ import annotations

import copy
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import rlf_train.rollout.env_source as async_mod
import rlf_train.trainer as trainer_mod
from rlf_envs.records import TrajectoryRecord
from rlf_train.config import ConfigError, load_config
from rlf_train.grpo import masked_logprobs, policy_loss
from rlf_train.rollout.async_worker import Admission
from rlf_train.rollout.batch import SamplingParams
from rlf_train.rollout.env_factory import make_envs
from rlf_train.rollout.env_source import AsyncRollout
from rlf_train.rollout.weights import WeightStore
from rlf_train.sft import pad_batch
from rlf_train.trainer import Trainer
from tests.train.test_crash_resume import COMMON, STEPS, _run_until_parked_then_kill, final_weights, rows
from tests.train.test_learning_signal import action_logprob, parity_cfg

ASYNC = ["rollout.mode=async", "rollout.async_worker=thread"]
PROCESS = ["rollout.mode=async", "rollout.async_worker=process"]


# ---------------------------------------------------------------- the loss, against numpy
def np_decoupled_loss(logp: np.ndarray, prox: np.ndarray, behav: np.ndarray, adv: np.ndarray, mask: np.ndarray,
                      lo: float, hi: float, cap: float) -> float:
    """-sum_t m_t min(pi_prox/mu, C) min(rho_t A_t, clip(rho_t, 1-lo, 1+hi) A_t) / sum_t m_t, rho = pi/pi_prox."""
    rho = np.exp(logp - prox)
    w = np.minimum(np.exp(prox - behav), cap)
    pg = -w * np.minimum(rho * adv, np.clip(rho, 1 - lo, 1 + hi) * adv)
    return float((pg * mask).sum() / mask.sum())


def test_decoupled_loss_matches_numpy_and_is_plain_ppo_on_policy() -> None:
    rng = np.random.default_rng(0)
    B, T = 4, 7
    logp = rng.normal(-2.0, 0.3, (B, T))
    prox = logp + rng.normal(0, 0.2, (B, T))
    behav = prox + rng.normal(0, 0.8, (B, T))  # stale: some weights above the cap, some far below 1
    adv = rng.normal(0, 1, (B, 1)).repeat(T, axis=1)
    mask = (rng.random((B, T)) > 0.3).astype(np.float64)
    behav[mask == 0] = -np.inf  # padding may hold anything: it must not reach the loss
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in
         dict(logp=logp, prox=prox, behav=behav, adv=adv, mask=mask).items()}
    lp = t["logp"].clone().requires_grad_(True)
    out = policy_loss(lp, t["prox"], t["adv"], t["mask"], clip_low=0.2, clip_high=0.28, behav_logp=t["behav"],
                      is_cap=2.0)
    want = np_decoupled_loss(logp, prox, behav, adv, mask, 0.2, 0.28, 2.0)
    assert float(out.loss.detach()) == pytest.approx(want, rel=1e-10)
    out.loss.backward()
    assert lp.grad is not None and torch.isfinite(lp.grad).all()
    w = np.minimum(np.exp(prox - behav), 2.0)
    assert out.is_weight_mean == pytest.approx(float((w * mask).sum() / mask.sum()), rel=1e-10)
    assert (w[mask == 1] == 2.0).any() and (w[mask == 1] < 0.5).any(), "the sample must exercise the cap"
    # finite-difference check of the gradient through rho (w carries none)
    eps = 1e-6
    i, j = map(int, np.argwhere(mask == 1)[0])
    bumped = logp.copy()
    bumped[i, j] += eps
    fd = (np_decoupled_loss(bumped, prox, behav, adv, mask, 0.2, 0.28, 2.0) - want) / eps
    assert float(lp.grad[i, j]) == pytest.approx(fd, rel=1e-4, abs=1e-8)
    # on-policy (mu = pi_prox): exactly the plain PPO-clip loss
    plain = policy_loss(t["logp"], t["prox"], t["adv"], t["mask"], clip_low=0.2, clip_high=0.28)
    same = policy_loss(t["logp"], t["prox"], t["adv"], t["mask"], clip_low=0.2, clip_high=0.28,
                       behav_logp=t["prox"], is_cap=2.0)
    assert float(same.loss) == float(plain.loss) and same.is_weight_mean == 1.0


# ---------------------------------------------------------------- config and admission
def test_async_config_keys_are_checked() -> None:
    cfg = load_config(None, ["rollout.mode=async", "rollout.max_staleness=2", "algorithm.is_cap=3"])
    assert (cfg.rollout.mode, cfg.rollout.max_staleness, cfg.rollout.partial_rollouts) == ("async", 2, True)
    assert load_config(None).rollout.mode == "sync"
    for bad, key in (("rollout.mode=fast", "rollout.mode"), ("rollout.max_staleness=-1", "rollout.max_staleness"),
                     ("algorithm.is_cap=0.5", "algorithm.is_cap"), ("rollout.max_stale=1", "rollout.max_stale")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [bad])


def test_admission_rule() -> None:
    adm = Admission(groups_per_update=2, max_staleness=1)
    assert [adm.update_of(k) for k in range(6)] == [1, 1, 2, 2, 3, 3]
    # update 3 trains from version 2: with staleness 1 its groups may start at version 1, not 0
    assert adm.allows(4, 1) and not adm.allows(4, 0) and adm.allows(3, 0)
    adm.admit(3, 0)
    with pytest.raises(RuntimeError, match="may not start"):
        adm.admit(5, 0)
    assert [(e.group, e.update, e.version) for e in adm.events] == [(3, 2, 0)]
    store = WeightStore()
    m = torch.nn.Linear(2, 2)
    store.publish(0, m)
    with pytest.raises(ValueError, match="must grow"):
        store.publish(0, m)
    got = store.newer_than(-1)
    assert got is not None and got[0] == 0 and store.newer_than(0) is None
    with torch.no_grad():
        m.weight.add_(1.0)  # the learner goes on in place: the published copy does not move
    assert not torch.equal(got[1]["weight"], m.weight)


# ---------------------------------------------------------------- partial rollouts (the worker alone)
def _turn_logprobs(model: torch.nn.Module, traj: Any, temperature: float, top_p: float) -> list[list[float]]:
    ids, attn, tgt, mask = pad_batch([traj], 0, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = masked_logprobs(model, ids, attn, tgt, mask, temperature=temperature, top_p=top_p)
    return [lp[0, s - 1:e - 1].tolist() for s, e in (t.action_span for t in traj.turns)]


@pytest.mark.parametrize("partial", [True, False])
def test_partial_rollouts_keep_each_turns_version_and_behaviour_logprobs(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         partial: bool) -> None:
    """A weight update lands while the first turn's env steps run: with partial rollouts the later turns use
    the new weights, the first keeps version 0, and each turn's recorded log-probs are those of the weights
    that sampled it (checked by recomputing them under each version); without, the episode stays on 0."""
    cfg = parity_cfg(tmp_path / "p", 1, ["rollout.max_turns=3", "rollout.max_new_tokens_per_turn=2",
                                         "rollout.max_total_tokens=512", "rollout.temperature=1.3",
                                         "rollout.top_p=0.9"])
    tr = Trainer(cfg)
    v0 = copy.deepcopy(tr.model)
    v1 = copy.deepcopy(tr.model)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.3)
    store = WeightStore()
    store.publish(0, v0)
    orig = async_mod.generate_batched
    calls: list[int] = []

    def generate_then_publish(*args: Any, **kw: Any) -> Any:
        out = orig(*args, **kw)
        calls.append(len(args[1]))
        if len(calls) == 1:
            store.publish(1, v1)  # the learner finished an update while turn 1 was generated
        return out

    monkeypatch.setattr(async_mod, "generate_batched", generate_then_publish)
    venv = make_envs(cfg, tr.tokenizer, "train", 4)
    worker = AsyncRollout(venv, copy.deepcopy(v0), tr.tokenizer, SamplingParams(1.3, 0.9, 2), store=store,
                          admission=Admission(2, 1), prompts_for=lambda u: [0, 1], seed_for=lambda u, r: r,
                          group_size=2, first_update=1, last_update=1, batch_size=8, gen=torch.Generator(),
                          partial_rollouts=partial)
    worker.start()
    try:
        batch = worker.next_batch(1, timeout=120)
    finally:
        worker.stop()
    assert len(batch.trajectories) == 4 and len(calls) >= 2
    models = {0: v0, 1: v1}
    for traj in batch.trajectories:
        versions = [t.policy_version for t in traj.turns]
        assert len(versions) == 3, "the parity env runs max_turns turns (one-token actions are never answers)"
        assert versions == ([0, 1, 1] if partial else [0, 0, 0])
        for k, turn in enumerate(traj.turns):
            want = _turn_logprobs(models[versions[k]], traj, 1.3, 0.9)[k]
            assert turn.behaviour_logprobs is not None and len(turn.behaviour_logprobs) == len(want)
            assert np.allclose(turn.behaviour_logprobs, want, atol=1e-4), (k, turn.behaviour_logprobs, want)
        if partial:  # the other version's log-probs differ: the check above can tell them apart
            other = _turn_logprobs(v0, traj, 1.3, 0.9)[2]
            assert not np.allclose(traj.turns[2].behaviour_logprobs, other, atol=1e-3)
        rec = TrajectoryRecord.from_json(TrajectoryRecord.from_trajectory(traj, source="train").to_json())
        assert [t.policy_version for t in rec.turns] == versions
        assert rec.turns[0].behaviour_logprobs == traj.turns[0].behaviour_logprobs


# ---------------------------------------------------------------- the trainer's async path
class UpdateSpy:
    """Records each update's batch with the learner's weights at that moment, and every policy_loss call."""

    def __init__(self, tr: Trainer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.batches: list[tuple[int, list[Any], dict[str, torch.Tensor]]] = []
        self.losses: list[dict[str, torch.Tensor]] = []
        orig_update, orig_loss = tr.update, trainer_mod.policy_loss

        def update(step: int, trajs: Any, *args: Any, **kw: Any) -> Any:
            self.batches.append((step, list(trajs), copy.deepcopy(tr.model.state_dict())))
            return orig_update(step, trajs, *args, **kw)

        def loss(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, **kw: Any) -> Any:
            self.losses.append({"adv": adv.detach().clone(), "old": old.detach().clone(), "mask": mask.clone(),
                                "behav": kw["behav_logp"].detach().clone()})
            return orig_loss(logp, old, adv, mask, **kw)

        monkeypatch.setattr(tr, "update", update)
        monkeypatch.setattr(trainer_mod, "policy_loss", loss)

    def rows(self, key: str) -> list[torch.Tensor]:
        return [row[m.bool()] for call in self.losses for row, m in zip(call[key], call["mask"], strict=True)]


@pytest.mark.parametrize("worker", [pytest.param(ASYNC, id="thread"),
                                    pytest.param(PROCESS, id="process", marks=pytest.mark.slow)])
def test_async_staleness_never_exceeds_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 worker: list[str]) -> None:
    """Multi-turn episodes, 6 updates, max_staleness 1: every admission respected the bound, so did every
    token the learner trained on, and the worker did run ahead: each update waits (at most 60 s) until the
    worker has started a group of the next update with the weights this update starts from."""
    tr = Trainer(parity_cfg(tmp_path / "s", 6, [*worker, "rollout.max_staleness=1", "rollout.max_turns=2",
                                                "rollout.max_total_tokens=512", "eval.num_tasks=2"]))
    orig = tr.update

    def update_after_the_worker_ran_ahead(step: int, *args: Any, **kw: Any) -> Any:
        deadline = time.monotonic() + 60
        while worker is ASYNC and step < 6 and time.monotonic() < deadline and tr.admission is not None \
                and not any(e.update == step + 1 for e in tr.admission.events):
            time.sleep(0.01)
        return orig(step, *args, **kw)

    monkeypatch.setattr(tr, "update", update_after_the_worker_ran_ahead)
    tr.run()
    assert tr.admission is not None
    events = tr.admission.events
    assert len(events) == 6 * 2 and [e.group for e in events] == list(range(12))
    assert all(e.update - 1 - e.version <= 1 for e in events)
    if worker is ASYNC:  # (in a process the worker's admissions reach the learner only with its batches)
        ahead = [e for e in events if e.update - 1 - e.version == 1]
        assert len(ahead) >= 5, f"the worker never ran ahead of the learner: {events}"
    recs = [json.loads(x) for x in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in recs if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == list(range(1, 7))
    assert all(0 <= r["staleness_max"] <= 1 for r in rl)
    if worker is ASYNC:
        assert max(r["staleness_max"] for r in rl) == 1
    assert all(r["time_wait"] >= 0 and r["rollout_busy"] >= 0 for r in rl)


def test_async_on_policy_update_matches_the_sampling_distribution(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """max_staleness 0: every batch is sampled by the weights the update starts from, so the recorded
    behaviour log-probs equal the update's pi_prox log-probs (temperature and top-p included) and the
    importance weights are 1."""
    tr = Trainer(parity_cfg(tmp_path / "o", 2, [*ASYNC, "rollout.max_staleness=0", "rollout.temperature=0.6",
                                                "rollout.top_p=0.5"]))
    spy = UpdateSpy(tr, monkeypatch)
    tr.run()
    for old, behav in zip(spy.rows("old"), spy.rows("behav"), strict=True):
        assert len(old) and torch.allclose(old, behav, atol=1e-4), (old, behav)
    recs = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["staleness_max"] == 0 and r["is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
               for r in recs if r["stage"] == "rl")


def test_async_update_moves_the_policy_toward_rewarded_actions_with_group_advantages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The signal checks of test_train_signal on the async path: advantages are the group-normalised rewards
    of each prompt's samples, and the update raises the log-prob of rewarded first tokens and lowers the
    unrewarded ones."""
    tr = Trainer(parity_cfg(tmp_path / "m", 1, [*ASYNC, "rollout.max_staleness=1"]))
    spy = UpdateSpy(tr, monkeypatch)
    tr.run()
    (step, trajs, weights), = spy.batches
    by_task: dict[str, list[float]] = defaultdict(list)
    for t in trajs:
        by_task[t.task.id] += [t.reward]
    assert step == 1 and len(by_task) == 2 and all(len(v) == 6 for v in by_task.values())
    for t, a in zip(trajs, spy.rows("adv"), strict=True):
        g = torch.tensor(by_task[t.task.id], dtype=torch.float64)
        want = (t.reward - g.mean()) / (g.std(unbiased=False) + tr.cfg.algorithm.eps)
        assert len(a) and torch.allclose(a.double(), torch.full_like(a.double(), float(want)), atol=1e-5)
    rewards = torch.tensor([t.reward for t in trajs])
    assert torch.all(rewards.view(2, 6).std(dim=1) > 0), "the test needs mixed rewards in every group"
    before = copy.deepcopy(tr.model)
    before.load_state_dict(weights)
    delta = action_logprob(tr.model, trajs, 1.0) - action_logprob(before, trajs, 1.0)
    good, bad = delta[rewards == 1.0], delta[rewards == 0.0]
    assert len(good) and len(bad) and good.mean() > 0.05 and bad.mean() < -0.05 and good.min() > bad.max()


def test_async_worker_error_reaches_the_learner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tr = Trainer(parity_cfg(tmp_path / "e", 2, ASYNC))

    def broken(*args: Any, **kw: Any) -> Any:
        raise ValueError("generation broke")

    monkeypatch.setattr(async_mod, "generate_batched", broken)
    with pytest.raises(RuntimeError, match="async rollout worker failed.*generation broke"):
        tr.run()


# ---------------------------------------------------------------- SIGKILL mid-async-run
FREE_0 = ["rollout.max_staleness=0"]
FIXED_1 = ["rollout.max_staleness=1", "rollout.async_schedule=fixed"]


@pytest.fixture(scope="module", params=[
    pytest.param(("thread", FREE_0), id="thread-free-s0"),
    pytest.param(("thread", FIXED_1), id="thread-fixed-s1"),
    pytest.param(("process", FREE_0), id="process-free-s0", marks=pytest.mark.slow),
    pytest.param(("process", FIXED_1), id="process-fixed-s1", marks=pytest.mark.slow)])
def strict(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path]:
    """A reproducible async setting (max_staleness 0, or the fixed schedule at max_staleness 1) with the given
    worker kind, and an uninterrupted run of it."""
    worker, extra = request.param
    flags = ["rollout.mode=async", f"rollout.async_worker={worker}", *extra]
    run = tmp_path_factory.mktemp(f"full_async_{worker}") / "run"
    Trainer(parity_cfg(run, STEPS, COMMON + flags)).run()
    return flags, run


def test_async_resume_after_sigkill_equals_the_uninterrupted_run(tmp_path: Path,
                                                                 strict: tuple[list[str], Path]) -> None:
    """With max_staleness 0, or with the fixed schedule at max_staleness 1, an async run is reproducible (the
    worker's sampler is re-seeded per update; under the fixed schedule update u's batch comes from weights
    version max(0, u - 2), which the checkpoint keeps), so a run SIGKILLed after checkpoint step_2 (its rollout
    worker, a thread or a process, with it) and resumed ends with the same metrics and bit-identical weights."""
    flags, uninterrupted_async = strict
    run = tmp_path / "run"
    at_kill = _run_until_parked_then_kill(run, tmp_path, "step_2",
                                          [*flags, "logging.save_every=2", "env.kwargs.pause_skip=4"])
    assert at_kill == "step_2"
    import yaml

    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["env"]["kwargs"] = {}
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    from rlf_train.cli import main

    assert main(["--resume", str(run)]) == 0
    volatile = {"time_wait", "rollout_busy"}
    got = [{k: v for k, v in r.items() if k not in volatile} for r in rows(run)]
    want = [{k: v for k, v in r.items() if k not in volatile} for r in rows(uninterrupted_async)]
    keys = [(r["stage"], r["step"]) for r in got]
    assert len(keys) == len(set(keys)), "duplicate metrics rows after resume"
    assert got == want
    if "rollout.async_schedule=fixed" in flags:  # update u trained on version max(0, u - 2): staleness 0, 1, 1, ...
        assert [r["staleness_max"] for r in got if r["stage"] == "rl"] == [min(1, s - 1) for s in range(1, STEPS + 1)]
    wa, wb = final_weights(uninterrupted_async), final_weights(run)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_fixed_schedule_resume_refuses_a_checkpoint_without_the_older_weights(tmp_path: Path) -> None:
    """Resuming with the fixed schedule needs the weights the worker generates the next batches with (versions
    step - max_staleness .. step - 1), which only a fixed-schedule run's checkpoint holds: anything else is
    refused with the fix, instead of silently generating with other weights."""
    run = tmp_path / "run"
    Trainer(parity_cfg(run, 2, [*ASYNC, "rollout.max_staleness=1", "logging.save_every=1"])).run()
    cfg = parity_cfg(run, 3, [*ASYNC, "rollout.max_staleness=1", "rollout.async_schedule=fixed",
                              "logging.save_every=1"])
    with pytest.raises(ValueError, match="versions \\[1\\].*resume with rollout.async_schedule: free"):
        Trainer(cfg, run_dir=run, resume=True).run()


def test_weight_stores_keep_the_newest_versions_exactly() -> None:
    """The fixed schedule reads an exact older version: both stores hold the `keep` newest, and only those."""
    import multiprocessing

    model = torch.nn.Linear(2, 2)
    stores = [WeightStore(keep=2), async_mod.SharedWeights(model, multiprocessing.get_context("spawn"), slots=2)]
    for store in stores:
        for v in range(4):
            with torch.no_grad():
                model.weight.fill_(float(v))
            store.publish(v, model)
        assert store.get(1) is None and store.get(5) is None
        assert float(store.get(2)["weight"][0, 0]) == 2.0 and float(store.get(3)["weight"][0, 0]) == 3.0
        with pytest.raises(ValueError, match="versions must grow"):
            store.publish(3, model)
