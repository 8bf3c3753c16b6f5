"""The paths around the GRPO loss pinned as tightly as the synchronous step (issue 34): the trainer's clip bounds
when they are not equal, a turn whose env step spans a weight refresh, the sampler's random stream across updates,
and the async process worker at a temperature other than 1. Each test recomputes the specified value from what a
real run did (its stored trajectories, the gradient of each optimizer step, its metrics), through public entry
points only (`Trainer.run`, `AsyncRollout`, torch's global optimizer hook), so a deviation fails whatever its form:

1. clip bounds (`algorithm.clip_eps_low` < `clip_eps_high`), on the sync and the async path: the gradient of the
   second epoch's optimizer step (ratio != 1, so the bounds matter) is the gradient of
   -w_t min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t), token mean, recomputed in one piece from the
   weights the step was taken at and those the update started from; the test also shows that the same gradient
   with the bounds swapped, or both equal to either, is far outside the tolerance (tokens lie in both regions
   where the two bounds disagree).
2. a turn whose env step spans a weight refresh (partial rollouts): it keeps the version that sampled it and that
   version's behaviour log-probs; the episode's later turns carry the new version.
3. random streams: with one prompt text for every task and lr ~ 0 (so every update samples the same distribution),
   no action of any update repeats an action of another update, and the G samples of a group differ: on the
   sync path, and on the async worker under both schedules.
4. the process worker at temperature 0.6 / top-p 0.8, max_staleness 0 (in the default suite: one worker process,
   two updates): its batches equal the thread worker's token for token (the same seeds), every behaviour log-prob
   is the tempered top-p log-prob under the weights the update starts from (numpy), every sampled token lies in
   the nucleus, and the logged importance weight is 1.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import pytest
import torch
from seed_envs import SEED_LOG_ID, SEEN
from torch.optim.optimizer import register_optimizer_step_pre_hook
from train_envs import PARITY_ID, FirstTokenParity

from rlf_envs.env import ToolEnv
from rlf_envs.records import TrajectoryRecord, read_records, step_path
from rlf_train.config import TrainConfig, load_config
from rlf_train.grpo import masked_logprobs
from rlf_train.rollout.async_worker import Admission
from rlf_train.rollout.batch import SamplingParams
from rlf_train.rollout.env_factory import make_envs
from rlf_train.rollout.env_source import AsyncRollout
from rlf_train.rollout.seeds import seed_base
from rlf_train.rollout.weights import WeightStore
from rlf_train.sft import pad_batch
from rlf_train.trainer import Trainer
from tests.train.test_grpo_spec import nucleus_logprob_choices

G, P = 4, 3
SAME_ID = "rlf_test/SamePrompt-v0"


def make_same_prompt(split: str = "train", max_turns: int = 1, max_total_tokens: int = 256, max_obs_tokens: int = 32,
                     tokenizer: Any = None) -> ToolEnv:
    """Six tasks with one prompt text: every update samples from the same distribution (at lr ~ 0)."""
    tasks = [{"id": f"{split}-{i}", "question": "Say something.", "answers": ["x"]} for i in range(6)]
    return ToolEnv(tasks=tasks, verifier=FirstTokenParity(), format="search_r1", max_turns=max_turns,
                   max_total_tokens=max_total_tokens, max_obs_tokens=max_obs_tokens, tokenizer=tokenizer)


if SAME_ID not in gymnasium.registry:
    gymnasium.register(SAME_ID, entry_point=make_same_prompt)


def cfg_for(run: Path, extra: list[str]) -> TrainConfig:
    return load_config(None, [
        f"env.id={PARITY_ID}", "env.imports=[train_envs]", "env.eval_split=test",
        f"logging.run_dir={run}", "logging.progress=false", "logging.tensorboard=false", "threads=1",
        "logging.trajectories_every=1", "logging.trajectories=-1", "logging.save_every=0",
        "model.tiny.hidden_size=16", "model.tiny.intermediate_size=32", "model.tiny.num_layers=1",
        f"rollout.prompts_per_step={P}", f"rollout.samples_per_prompt={G}", "rollout.max_turns=1",
        "rollout.max_new_tokens_per_turn=3", "rollout.max_total_tokens=256", "rollout.max_obs_tokens=32",
        "sft.enabled=false", "algorithm.kl_coef=0", "optim.grad_clip=1e6", "algorithm.micro_batch_size=5",
        "algorithm.std_normalize=true", "algorithm.eps=0.25", "algorithm.loss_agg=token_mean",
        "optim.warmup_steps=0", "eval.num_tasks=3", "eval.before_rl=false", "eval.greedy=false",
        "eval.sampled=false", "seed=5", *extra])


class Run:
    """A real `Trainer.run()`, observed from outside: every optimizer step's parameters and gradient (torch's global
    optimizer pre-step hook: after clipping, which is off, before the step), the stored training trajectories of
    each update (`logging.trajectories: -1`, every step) and the metrics rows."""

    def __init__(self, run: Path, extra: list[str]) -> None:
        self.tr = tr = Trainer(cfg_for(run, extra))
        self.steps: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

        def capture(opt: torch.optim.Optimizer, *_: Any) -> None:
            ps = [p for g in opt.param_groups for p in g["params"]]
            self.steps.append(([p.detach().clone() for p in ps],
                               [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in ps]))

        handle = register_optimizer_step_pre_hook(capture)
        try:
            tr.run()
        finally:
            handle.remove()
        self.run_dir = run
        self.rows = [r for r in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines())
                     if r["stage"] == "rl"]
        self.per_update = tr.cfg.algorithm.ppo_epochs * tr.cfg.algorithm.mini_batches
        self.wall = 0.0  # set by whoever times the run

    def batch(self, step: int) -> list[TrajectoryRecord]:
        recs = [r for r in read_records(step_path(self.run_dir, step)) if r.source == "train"]
        assert [r.index for r in recs] == list(range(P * G))
        return recs

    def model_at(self, params: list[torch.Tensor]) -> torch.nn.Module:
        m = copy.deepcopy(self.tr.model)
        with torch.no_grad():
            for p, v in zip(m.parameters(), params, strict=True):
                p.copy_(v)
        return m

    def weights_version(self, version: int) -> torch.nn.Module:
        """The learner's weights version `version` (= the weights at the first optimizer step of update version+1)."""
        return self.model_at(self.steps[version * self.per_update][0])


def actions(t: TrajectoryRecord) -> tuple[int, ...]:
    """Every policy token of an episode, in order."""
    return tuple(tok for tok, m in zip(t.token_ids or [], t.loss_mask or [], strict=True) if m)


def group_advantages(rewards: list[float], eps: float) -> np.ndarray:
    r = np.array(rewards, dtype=np.float64).reshape(-1, G)
    return ((r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + eps)).reshape(-1)


# ------------------------------------------------------------------------------------------------ 1. clip bounds
LO, HI = 0.05, 0.25
TEMP = 0.8


def tempered_logprobs(model: torch.nn.Module, t: TrajectoryRecord) -> torch.Tensor:
    """log softmax(logits / TEMP) of each policy token (top-p 1), float64, with the graph to `model`'s weights."""
    ids = torch.tensor([t.token_ids], dtype=torch.long)
    logits = model(input_ids=ids[:, :-1]).logits[0].double() / TEMP
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return lp[torch.tensor((t.loss_mask or [])[1:], dtype=torch.bool)]


def clipped_objective_grad(run: Run, step: int, k: int, lo: float, hi: float) -> tuple[list[torch.Tensor], dict]:
    """The specified gradient of update `step`'s optimizer step `k` (0: first epoch) in one piece: pg_t =
    -w_t min(rho_t A_t, clip(rho_t, 1 - lo, 1 + hi) A_t), token mean over the batch, rho = pi_theta / pi_prox with
    theta the weights the step was taken at and prox those of the update's start, w = min(pi_prox / mu, is_cap)
    with mu the recorded behaviour log-probs on the async path (1 on the sync path). Also the token counts in the
    two regions where the lower and the upper bound disagree."""
    a = run.tr.cfg.algorithm
    trajs = run.batch(step)
    base = (step - 1) * run.per_update
    prox = run.model_at(run.steps[base][0])
    theta = run.model_at(run.steps[base + k][0])
    theta.zero_grad(set_to_none=True)
    adv = group_advantages([t.reward for t in trajs], a.eps)
    n_tok = sum(sum((t.loss_mask or [])[1:]) for t in trajs)
    total = torch.zeros((), dtype=torch.float64)
    zones = {"upper": 0, "lower": 0}
    for i, t in enumerate(trajs):
        lp = tempered_logprobs(theta, t)
        with torch.no_grad():
            old = tempered_logprobs(prox, t)
        w = torch.ones_like(old)
        if run.tr.cfg.rollout.mode == "async":
            mu = torch.tensor([x for turn in t.turns for x in (turn.behaviour_logprobs or [])], dtype=torch.float64)
            w = torch.clamp(torch.exp(old - mu), max=a.is_cap)
        rho = torch.exp(lp - old)
        A = float(adv[i])
        pg = -w * torch.minimum(rho * A, torch.clamp(rho, 1 - lo, 1 + hi) * A)
        total = total + pg.sum()
        r = rho.detach()
        lo_b, hi_b = min(LO, HI), max(LO, HI)
        zones["upper"] += int(((r > 1 + lo_b) & (r < 1 + hi_b) & (A > 0)).sum())
        zones["lower"] += int(((r < 1 - lo_b) & (r > 1 - hi_b) & (A < 0)).sum())
    (total / n_tok).backward()
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in theta.parameters()], zones


def flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([x.flatten().double() for x in ts])


CLIP_PATHS = {
    "sync": [],
    "async": ["rollout.mode=async", "rollout.async_worker=thread", "rollout.async_schedule=fixed",
              "rollout.max_staleness=1", "algorithm.is_cap=1.5"],
}


@pytest.fixture(scope="module", params=list(CLIP_PATHS))
def clip_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return Run(tmp_path_factory.mktemp(f"clip_{request.param}") / "run", [
        # seed 6: a run whose second epoch has tokens in both zones where the bounds disagree (asserted below;
        # which seeds do depends on the sampler's random stream, rlf_train.rollout.sampling)
        *CLIP_PATHS[request.param], "seed=6", "algorithm.steps=2", "algorithm.ppo_epochs=2", "optim.lr=2e-2",
        f"rollout.temperature={TEMP}", "rollout.top_p=1.0", f"algorithm.clip_eps_low={LO}",
        f"algorithm.clip_eps_high={HI}"])


def test_asymmetric_clip_bounds_on_the_trainer_path(clip_run: Run) -> None:
    """Every optimizer step of both updates (first epoch: rho = 1, second: rho moved) has the one-piece gradient
    of the clipped objective with eps_low = LO below and eps_high = HI above; with the bounds swapped or equal the
    second epoch's gradient would be far off (checked on the reference itself, so the test sees such a trainer)."""
    run = clip_run
    assert len(run.steps) == 2 * run.per_update == 4
    for step in (1, 2):
        for k in range(run.per_update):
            ref, zones = clipped_objective_grad(run, step, k, LO, HI)
            got, want = flat(run.steps[(step - 1) * run.per_update + k][1]), flat(ref)
            assert want.norm() > 0
            tol = 2e-4 * want.norm() + 1e-9
            assert (got - want).norm() <= tol, (step, k, float((got - want).norm()), float(want.norm()))
            if k == 0:
                continue
            # the second epoch: tokens on both sides where the two bounds disagree, so the bounds are visible
            assert zones["upper"] > 0 and zones["lower"] > 0, zones
            for lo, hi in ((HI, LO), (LO, LO), (HI, HI)):
                other = flat(clipped_objective_grad(run, step, k, lo, hi)[0])
                assert (other - want).norm() > 20 * tol, (step, lo, hi, float((other - want).norm()), float(tol))


# ------------------------------------------------------------------------ 2. an env step across a weight refresh
def turn_logprobs(model: torch.nn.Module, traj: Any, temperature: float, top_p: float) -> list[list[float]]:
    ids, attn, tgt, mask = pad_batch([traj], 0, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = masked_logprobs(model, ids, attn, tgt, mask, temperature=temperature, top_p=top_p)
    return [lp[0, s - 1:e - 1].tolist() for s, e in (t.action_span for t in traj.turns)]


def test_a_turn_whose_env_step_spans_a_weight_refresh_keeps_the_version_that_sampled_it(tmp_path: Path) -> None:
    """Two groups of two episodes (tasks 0 and 1, updates 1 and 2, max_staleness 1) start on version 0. The env
    steps of task 0's first turn publish version 1 and do not return until the worker has loaded it (its other
    episodes go on meanwhile, so a refresh lands inside those steps). Each turn must carry the version that
    sampled it (task 0's first turn: 0, not the 1 current when its tools returned), with the log-probs of that
    version's tempered top-p distribution; every later turn is sampled by version 1."""
    temp, top_p = 1.3, 0.9
    cfg = cfg_for(tmp_path / "r", ["rollout.max_turns=3", "rollout.max_new_tokens_per_turn=2",
                                   "rollout.max_total_tokens=512", "algorithm.steps=1"])
    tr = Trainer(cfg)
    v0, v1 = copy.deepcopy(tr.model), copy.deepcopy(tr.model)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.3)
    store = WeightStore()
    store.publish(0, v0)
    venv = make_envs(cfg, tr.tokenizer, "train", 4)
    worker = AsyncRollout(venv, copy.deepcopy(v0), tr.tokenizer, SamplingParams(temp, top_p, 2), store=store,
                          admission=Admission(1, 1), prompts_for=lambda u: [u - 1], seed_for=lambda u, r: r,
                          group_size=2, first_update=1, last_update=2, batch_size=8,
                          gen=torch.Generator().manual_seed(0), partial_rollouts=True)
    orig = venv.astep_active
    spanned: list[tuple[int, int]] = []  # (worker version when the step started, when it returned)

    async def astep_active(acts: Any) -> Any:
        (slot,) = acts
        traj = venv.envs[slot].trajectory
        if traj.task.id == "train-0" and not traj.turns:  # task 0's first turn: its tools outlast a refresh
            before = worker.version
            if store.version < 1:
                store.publish(1, v1)  # the learner finished an update while these tools ran
            deadline = time.monotonic() + 120
            while worker.version < 1:
                assert time.monotonic() < deadline, "the worker never loaded version 1"
                await asyncio.sleep(0.002)
            spanned.append((before, worker.version))
        return await orig(acts)

    venv.astep_active = astep_active  # type: ignore[method-assign]
    worker.start()
    try:
        batches = [worker.next_batch(1, timeout=120), worker.next_batch(2, timeout=120)]
    finally:
        worker.stop()
    assert spanned == [(0, 1), (0, 1)]
    # the groups of updates 1 and 2, each once, both at version 0; nothing of an update after the last
    assert [(e.group, e.update, e.version) for e in worker.admission.events] == [(0, 1, 0), (1, 2, 0)]
    models = {0: v0, 1: v1}
    for u, batch in enumerate(batches, 1):
        assert len(batch.trajectories) == 2
        for traj in batch.trajectories:
            assert traj.task.id == f"train-{u - 1}"
            versions = [t.policy_version for t in traj.turns]
            assert versions == [0, 1, 1], (u, versions)
            for k, turn in enumerate(traj.turns):
                want = turn_logprobs(models[versions[k]], traj, temp, top_p)[k]
                other = turn_logprobs(models[1 - versions[k]], traj, temp, top_p)[k]
                assert turn.behaviour_logprobs is not None and len(turn.behaviour_logprobs) == len(want)
                assert np.allclose(turn.behaviour_logprobs, want, atol=1e-4), (u, k, turn.behaviour_logprobs, want)
                assert not np.allclose(turn.behaviour_logprobs, other, atol=1e-3)  # the versions are told apart


@pytest.mark.parametrize("schedule", ["free", "fixed"])
def test_the_async_worker_ends_a_turn_at_eos(tmp_path: Path, schedule: str) -> None:
    """A policy that all but always says EOS first (its output row for EOS turned toward the prompts' hidden
    states): every action the worker records is that one EOS, with its log-prob ~0 (a worker that does not stop at
    EOS runs on to the token budget)."""
    cfg = cfg_for(tmp_path / "r", ["algorithm.steps=1", "rollout.max_new_tokens_per_turn=3"])
    tr = Trainer(cfg)
    eos = tr.tokenizer.eos_token_id
    model = copy.deepcopy(tr.model)
    venv = make_envs(cfg, tr.tokenizer, "train", P * G)
    ids = [tr.tokenizer.encode(t.question) for t in tr.train_tasks]
    with torch.no_grad():
        hidden = torch.cat([model.model(input_ids=torch.tensor([x])).last_hidden_state[0] for x in ids])
        d = hidden.mean(0)
        model.get_output_embeddings().weight[eos] = 200 * d / d.norm()
    store = WeightStore(keep=1)
    store.publish(0, model)
    worker = AsyncRollout(venv, model, tr.tokenizer, SamplingParams(1.0, 1.0, 3), store=store,
                          admission=Admission(P, 0), prompts_for=lambda u: list(range(P)), seed_for=lambda u, r: r,
                          group_size=G, first_update=1, last_update=1, batch_size=8,
                          gen=torch.Generator().manual_seed(0), schedule=schedule)
    worker.start()
    try:
        batch = worker.next_batch(1, timeout=120)
    finally:
        worker.stop()
    assert len(batch.trajectories) == P * G
    for t in batch.trajectories:
        for turn in t.turns:
            a, e = turn.action_span
            assert (t.token_ids or [])[a:e] == [eos]
            assert turn.behaviour_logprobs is not None and len(turn.behaviour_logprobs) == 1
            assert turn.behaviour_logprobs[0] > -1e-3


# --------------------------------------------------------------------------- 3. random streams across updates
STREAM_PATHS = {
    "sync": [],
    "async-free": ["rollout.mode=async", "rollout.async_worker=thread", "rollout.max_staleness=1"],
    "async-fixed": ["rollout.mode=async", "rollout.async_worker=thread", "rollout.async_schedule=fixed",
                    "rollout.max_staleness=1"],
}


@pytest.mark.parametrize("path", list(STREAM_PATHS))
def test_each_update_draws_fresh_samples(tmp_path: Path, path: str) -> None:
    """One prompt text, lr 1e-9 (the distribution the sampler draws from is the same at every update), 3 updates
    of 3 groups x 4: every action sequence differs from every action sequence of the other updates (a sampler
    started over each update repeats the previous update row by row), and within a group the samples differ."""
    run = Run(tmp_path / "run", [*STREAM_PATHS[path], f"env.id={SAME_ID}", "algorithm.steps=3",
                                 "algorithm.ppo_epochs=1", "optim.lr=1e-9", "rollout.temperature=1.0",
                                 "seed=6"])  # a run that draws no stop token (asserted below; stream-dependent)
    acts = {s: [actions(t) for t in run.batch(s)] for s in (1, 2, 3)}
    assert all(len(a) == 3 for rows in acts.values() for a in rows)  # three tokens each (no stop was drawn)
    for s, rows in acts.items():
        for g in range(P):
            group = rows[g * G:(g + 1) * G]
            assert len(set(group)) == G, (s, g, group)
    for s in acts:
        for s2 in acts:
            if s < s2:
                same = set(acts[s]) & set(acts[s2])
                assert not same, (path, s, s2, same)


@pytest.mark.parametrize("path", list(STREAM_PATHS))
def test_each_update_seeds_its_envs_anew(tmp_path: Path, path: str) -> None:
    """The env of row r of update u's batch is reset with seed `seed_base(seed, u) + r`, in row order, sync and
    async alike: no env seed of one update comes back in another."""
    SEEN.clear()
    Run(tmp_path / "run", [*STREAM_PATHS[path], f"env.id={SEED_LOG_ID}", "env.imports=[seed_envs]",
                           "algorithm.steps=2", "algorithm.ppo_epochs=1", "optim.lr=1e-3"])
    assert [seed_base(5, u) + row for u in (1, 2) for row in range(P * G)] == SEEN
    assert seed_base(5, 2) - seed_base(5, 1) >= P * G


# ----------------------------------------------------------------- 4. the process worker at temperature != 1
PT, PP = 0.6, 0.8
ON_POLICY = ["rollout.mode=async", "rollout.max_staleness=0", "algorithm.steps=2", "algorithm.ppo_epochs=1",
             "optim.lr=5e-2", f"rollout.temperature={PT}", f"rollout.top_p={PP}"]


@pytest.fixture(scope="module")
def worker_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    base = tmp_path_factory.mktemp("worker")
    runs = {}
    for kind in ("thread", "process"):
        t0 = time.monotonic()
        runs[kind] = Run(base / kind, [*ON_POLICY, f"rollout.async_worker={kind}"])
        runs[kind].wall = time.monotonic() - t0
    yield runs


def test_process_worker_samples_at_the_rollout_temperature(worker_runs: dict[str, Run]) -> None:
    """max_staleness 0: the process worker's batches are the thread worker's, token for token (the same sampler
    seeds); each behaviour log-prob is the tempered (0.6) top-p (0.8) log-prob under the weights the update
    starts from (numpy; every sampled token inside the nucleus), each turn records that version, and the logged
    importance weight is 1 (a worker sampling at temperature 1 records other log-probs: ~1.02)."""
    proc, thread = worker_runs["process"], worker_runs["thread"]
    for step in (1, 2):
        batch = proc.batch(step)
        assert [actions(t) for t in batch] == [actions(t) for t in thread.batch(step)]
        assert [t.token_ids for t in batch] == [t.token_ids for t in thread.batch(step)]
        prox = proc.weights_version(step - 1)
        for t in batch:
            assert [turn.policy_version for turn in t.turns] == [step - 1] * len(t.turns)
            got = [x for turn in t.turns for x in (turn.behaviour_logprobs or [])]
            want = nucleus_logprob_choices(prox, t, PT, PP, strict=True, margin=1e-4)
            assert len(got) == len(want) and all(min(abs(g - c) for c in cs) <= 2e-4
                                                 for g, cs in zip(got, want, strict=True)), (step, got, want)
    for run in (proc, thread):
        assert [r["step"] for r in run.rows] == [1, 2]
        for r in run.rows:
            assert r["staleness_max"] == 0
            assert r["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
            # the worker's accounting: the batch's generated tokens, its generation time within the run's
            assert r["gen_tokens"] == sum(len(actions(t)) for t in run.batch(r["step"]))
        assert 0 < sum(r["rollout_busy"] for r in run.rows) <= run.wall
