"""The GRPO / decoupled-PPO math pinned to its specification on the ASYNC trainer path (`rollout.mode: async`,
`Trainer._run_rl_async` with the real rollout worker), as tests/train/test_grpo_spec.py pins the synchronous
step. Each check recomputes the specified value independently (numpy, or a plain full-batch torch forward)
from what the worker recorded and what the learner did, so a broken async loss, ratio, importance weight,
advantage or version bookkeeping fails here. The specification (grpo.policy_loss's docstring,
docs/guides/async-rl.md), per policy token t of a batch that update u trains on:

- mu(a_t): the behaviour log-prob the worker recorded when it sampled the token (`Turn.behaviour_logprobs`),
  under the sampling distribution (temperature, top-p) of the weights version the turn records
  (`Turn.policy_version`); pi_prox: the learner's weights at the start of update u (version u - 1), same
  distribution; pi_theta: the weights being trained.
- rho_t = pi_theta / pi_prox, w_t = min(pi_prox / mu, is_cap) (no gradient through w),
  pg_t = -w_t min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t), token_mean over the mini-batch.
- A: group-normalised episode returns, (r - mean_g) / (std_g + eps), population std.
- staleness: u - 1 - policy_version, never above max_staleness; under `async_schedule: fixed` every turn of
  update u's batch has version max(0, u - 1 - max_staleness).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from train_envs import PARITY_ID

import rlf_train.trainer as trainer_mod
from rlf_envs.types import Trajectory
from rlf_train.config import TrainConfig, load_config
from rlf_train.trainer import Trainer
from tests.train.test_grpo_spec import expected_advantages, nucleus_logprob_choices, nucleus_logprobs

G, P, STEPS = 4, 3, 3
TEMP, TOP_P = 0.7, 0.9
CLIP = 0.2


def cfg_for(run: Path, extra: list[str]) -> TrainConfig:
    return load_config(None, [
        f"env.id={PARITY_ID}", "env.imports=[train_envs]", "env.eval_split=test",
        f"logging.run_dir={run}", "logging.progress=false", "logging.tensorboard=false", "threads=1",
        "logging.trajectories_every=0", "logging.save_every=0",
        "model.tiny.hidden_size=16", "model.tiny.intermediate_size=32", "model.tiny.num_layers=1",
        f"rollout.prompts_per_step={P}", f"rollout.samples_per_prompt={G}", "rollout.max_turns=2",
        "rollout.max_new_tokens_per_turn=3", "rollout.max_total_tokens=256", "rollout.max_obs_tokens=32",
        f"rollout.temperature={TEMP}", f"rollout.top_p={TOP_P}",
        "sft.enabled=false", f"algorithm.steps={STEPS}", "algorithm.kl_coef=0", "optim.grad_clip=1e6",
        f"algorithm.clip_eps_low={CLIP}", f"algorithm.clip_eps_high={CLIP}", "algorithm.micro_batch_size=5",
        "algorithm.ppo_epochs=2", "algorithm.std_normalize=true", "algorithm.eps=0.25",
        "optim.lr=5e-2", "optim.warmup_steps=0", "eval.num_tasks=3", "eval.before_rl=false", "eval.sampled=false",
        "seed=5", "rollout.mode=async", "rollout.async_worker=thread", "rollout.max_staleness=1", *extra])


class AsyncRun:
    """A real async run, spied on: each update's batch and the learner's weights at its start (= version
    step - 1), every policy_loss call, and the gradient of every optimizer step (before clipping, which is
    off: grad_clip 1e6)."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str]) -> None:
        self.tr = tr = Trainer(cfg_for(tmp / "run", extra))
        self.batches: list[tuple[int, list[Trajectory]]] = []
        self.versions: dict[int, dict[str, torch.Tensor]] = {}  # weights version -> state dict
        self.calls: list[dict[str, Any]] = []  # policy_loss calls, with the update they belong to
        self.grads: list[tuple[int, list[torch.Tensor]]] = []
        self._models: dict[int, torch.nn.Module] = {}
        orig_update, orig_loss, orig_clip = tr.update, trainer_mod.policy_loss, torch.nn.utils.clip_grad_norm_
        current = [0]

        def update(step: int, trajs: Any, *args: Any, **kw: Any) -> Any:
            assert kw.get("behaviour") is True or (len(args) == 4 and args[3] is True), "async batch not flagged"
            current[0] = step
            self.versions[step - 1] = copy.deepcopy(tr.model.state_dict())
            self.batches.append((step, list(trajs)))
            return orig_update(step, trajs, *args, **kw)

        def loss(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, **kw: Any) -> Any:
            out = orig_loss(logp, old, adv, mask, **kw)
            self.calls.append({"step": current[0], "logp": logp.detach().clone(), "old": old.clone(),
                               "adv": adv.clone(), "mask": mask.clone(), "behav": kw["behav_logp"].clone(),
                               "kw": dict(kw), "out": out})
            return out

        def clip(params: Any, *a: Any, **kw: Any) -> Any:
            params = list(params)
            self.grads.append((current[0], [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                                            for p in params]))
            return orig_clip(params, *a, **kw)

        monkeypatch.setattr(tr, "update", update)
        monkeypatch.setattr(trainer_mod, "policy_loss", loss)
        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
        tr.run()
        monkeypatch.undo()
        self.rows = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()
                     if json.loads(x)["stage"] == "rl"]

    def model(self, version: int) -> torch.nn.Module:
        if version not in self._models:
            m = copy.deepcopy(self.tr.model)
            m.load_state_dict(self.versions[version])
            self._models[version] = m
        return self._models[version]

    def first_epoch(self, step: int) -> list[dict[str, Any]]:
        """The policy_loss calls of `step`'s first epoch (micro-batches covering rows 0..N-1 in order)."""
        calls = [c for c in self.calls if c["step"] == step]
        n, out = 0, []
        for c in calls:
            if n >= P * G:
                break
            out.append(c)
            n += c["logp"].shape[0]
        assert n == P * G
        return out


def np_logprobs(model: torch.nn.Module, t: Trajectory, strict: bool) -> torch.Tensor:
    """numpy (test_train_spec_grpo's reference) at this file's TEMP / TOP_P: see `nucleus_logprobs`."""
    return torch.tensor(nucleus_logprobs(model, t, TEMP, TOP_P, strict), dtype=torch.float32)


#: the cumulative mass within which float32 (sampler, update) and the float64 reference may cut the nucleus apart
NUCLEUS_MARGIN = 1e-4


def np_choices(model: torch.nn.Module, t: Trajectory, strict: bool) -> list[list[float]]:
    """`np_logprobs` with every value a nucleus cut within NUCLEUS_MARGIN of top_p gives (one value elsewhere)."""
    return nucleus_logprob_choices(model, t, TEMP, TOP_P, strict, margin=NUCLEUS_MARGIN)


def behaviour(run: AsyncRun, t: Trajectory) -> torch.Tensor:
    """mu of each policy token: its turn's version's sampling distribution (strict: it was drawn from it)."""
    vs = token_versions(t)
    per_version = {v: np_logprobs(run.model(v), t, strict=True) for v in set(vs)}
    return torch.tensor([float(per_version[v][k]) for k, v in enumerate(vs)])


def behaviour_choices(run: AsyncRun, t: Trajectory) -> list[list[float]]:
    """`behaviour` with every value a nucleus cut within NUCLEUS_MARGIN of top_p gives (see `np_choices`)."""
    vs = token_versions(t)
    per_version = {v: np_choices(run.model(v), t, strict=True) for v in set(vs)}
    return [per_version[v][k] for k, v in enumerate(vs)]


def matches(got: torch.Tensor, choices: list[list[float]], atol: float) -> bool:
    """Each value within atol of one of its token's reference values."""
    return len(got) == len(choices) and all(min(abs(float(g) - c) for c in cs) <= atol
                                            for g, cs in zip(got, choices, strict=True))


def token_versions(t: Trajectory) -> list[int]:
    """The recorded weights version of each policy token, in the order of the loss mask's 1s."""
    by_pos: dict[int, int] = {}
    for turn in t.turns:
        if turn.action_span is not None:
            assert turn.policy_version is not None and turn.behaviour_logprobs is not None
            for pos in range(*turn.action_span):
                by_pos[pos - 1] = turn.policy_version
    return [by_pos[k] for k, on in enumerate((t.loss_mask or [])[1:]) if on]


def masked(calls: list[dict[str, Any]], key: str) -> list[torch.Tensor]:
    return [row[m.bool()] for c in calls for row, m in zip(c[key], c["mask"], strict=True)]


def np_decoupled(c: dict[str, Any], cap: float) -> float:
    m = c["mask"].double().numpy()
    lp, old, beh = (c[k].double().numpy() for k in ("logp", "old", "behav"))
    adv = c["adv"].double().numpy()
    adv = adv[:, None] if adv.ndim == 1 else adv
    rho = np.exp(lp - old)
    w = np.minimum(np.exp(np.where(m > 0, old - beh, 0.0)), cap)
    pg = -w * np.minimum(rho * adv, np.clip(rho, 1 - CLIP, 1 + CLIP) * adv)
    return float((pg * m).sum() / c["kw"]["total_tokens"])


def one_piece_grad(model: torch.nn.Module, trajs: list[Trajectory], w: list[torch.Tensor],
                   adv: np.ndarray) -> list[torch.Tensor]:
    """The first optimizer step's gradient, specified: rho = 1, so d pg_t = -w_t A_t d log pi_theta(a_t), the
    log-prob under the tempered top-p distribution (nucleus fixed, renormalised), token_mean over the batch."""
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    n_tok = sum(sum((t.loss_mask or [])[1:]) for t in trajs)
    total = torch.zeros((), dtype=torch.float64)
    for i, t in enumerate(trajs):
        ids = torch.tensor([t.token_ids], dtype=torch.long)
        logits = m(input_ids=ids[:, :-1]).logits[0].double() / TEMP
        p = torch.softmax(logits, -1)
        srt, order = torch.sort(p.detach(), dim=-1, descending=True, stable=True)
        before = torch.cumsum(srt, -1) - srt
        keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, before < TOP_P)
        tgt = ids[0, 1:]
        keep = keep.scatter(-1, tgt[:, None], True)  # the sampled token, kept in (see np_logprobs)
        lp = torch.log(p.gather(-1, tgt[:, None])[:, 0]) - torch.log((p * keep).sum(-1))
        mask = torch.tensor((t.loss_mask or [])[1:], dtype=torch.bool)
        total = total - (float(adv[i]) * w[i].double() * torch.exp(lp[mask] - lp[mask].detach())).sum()
    (total / n_tok).backward()
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in m.parameters()]


@pytest.fixture(scope="module", params=[pytest.param(["rollout.async_schedule=fixed"], id="fixed"),
                                        pytest.param(["rollout.async_schedule=free"], id="free")])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncRun:
    mp = pytest.MonkeyPatch()
    try:
        return AsyncRun(tmp_path_factory.mktemp("spec_async"), mp, [*request.param, "algorithm.is_cap=1.0"])
    finally:
        mp.undo()


def test_versions_and_staleness(run: AsyncRun) -> None:
    fixed = run.tr.cfg.rollout.async_schedule == "fixed"
    assert [s for s, _ in run.batches] == list(range(1, STEPS + 1))
    for (step, trajs), row in zip(run.batches, run.rows, strict=True):
        vs = [v for t in trajs for v in token_versions(t)]
        assert vs and all(step - 2 <= v <= step - 1 and v >= 0 for v in vs), (step, sorted(set(vs)))
        if fixed:
            assert set(vs) == {max(0, step - 2)}
        stale = [step - 1 - t.policy_version for tr in trajs for t in tr.turns if t.policy_version is not None]
        assert row["staleness_max"] == max(stale) and row["staleness_mean"] == pytest.approx(np.mean(stale))
    if fixed:  # the point of these tests: a stale batch, where mu != pi_prox
        assert [r["staleness_max"] for r in run.rows] == [0, 1, 1]


def test_behaviour_logprobs_are_the_sampling_policy_of_each_turns_version(run: AsyncRun) -> None:
    """What reaches the loss as mu is, token by token, the tempered top-p log-prob under the weights of the
    version the turn records (numpy), and pi_prox is the same under the learner's weights at the update's start."""
    for step, trajs in run.batches:
        calls = run.first_epoch(step)
        behav = torch.cat(masked(calls, "behav"))
        want = [cs for t in trajs for cs in behaviour_choices(run, t)]
        assert matches(behav, want, atol=2e-4), (step, behav, want)
        old = torch.cat(masked(calls, "old"))
        prox = run.model(step - 1)
        want = [cs for t in trajs for cs in np_choices(prox, t, strict=False)]
        assert matches(old, want, atol=2e-4), (step, old, want)
        ratio = torch.exp(torch.cat(masked(calls, "logp")) - old)  # first epoch: pi_theta = pi_prox
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5)


def test_advantages_are_group_normalised_on_the_async_path(run: AsyncRun) -> None:
    for step, trajs in run.batches:
        ids = [t.task.id for t in trajs]
        assert all(len(set(ids[g:g + G])) == 1 for g in range(0, P * G, G))
        want = expected_advantages([t.reward for t in trajs], True, 0.25)
        got = [float(row[0]) for row in masked(run.first_epoch(step), "adv")]
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), (step, got, want.tolist())


def test_every_loss_value_is_the_decoupled_objective(run: AsyncRun) -> None:
    """Every micro-batch of both epochs: the loss equals the numpy decoupled PPO objective with the recorded
    mu, the truncation at is_cap = 1 active on some tokens and not on others, and the logged mean weight."""
    cap = run.tr.cfg.algorithm.is_cap
    assert cap == 1.0
    for c in run.calls:
        assert c["out"].loss.item() == pytest.approx(np_decoupled(c, cap), rel=1e-5, abs=1e-7)
    stale = [c for c in run.calls if c["step"] >= 2]
    d = torch.cat([(c["old"] - c["behav"])[c["mask"].bool()] for c in stale])
    assert (d > 1e-3).any() and (d < -1e-3).any(), "the stale batches need weights both above and below the cap"
    first = {id(c) for step in range(1, STEPS + 1) for c in run.first_epoch(step)}
    second = [c for c in run.calls if id(c) not in first]
    r = torch.cat(masked(second, "logp")) - torch.cat(masked(second, "old"))
    assert r.abs().max() > 1e-3  # the second epoch's ratio moved: the objective is not trivially at rho = 1
    for step, row in zip(range(1, STEPS + 1), run.rows, strict=True):
        ws = [c["out"].is_weight_mean for c in run.calls if c["step"] == step]
        assert row["is_weight_mean"] == pytest.approx(float(np.mean(ws)))


def test_first_step_gradient_is_the_weighted_one_piece_gradient(run: AsyncRun) -> None:
    """Each update's first optimizer step: the gradient (accumulated over micro-batches of 5) equals the
    one-piece gradient of the whole batch's loss with w = min(pi_prox / mu, cap), computed from scratch."""
    cap = run.tr.cfg.algorithm.is_cap
    for step, trajs in run.batches:
        grads = [g for s, g in run.grads if s == step]
        assert len(grads) == 2  # two epochs, one mini-batch each
        model = run.model(step - 1)
        pi_prox = [np_logprobs(model, t, strict=False) for t in trajs]
        mu = [behaviour(run, t) for t in trajs]
        w = [torch.clamp(torch.exp(p - m), max=cap) for p, m in zip(pi_prox, mu, strict=True)]
        adv = expected_advantages([t.reward for t in trajs], True, 0.25)
        ref = one_piece_grad(model, trajs, w, adv)
        fa = torch.cat([x.flatten().double() for x in grads[0]])
        fb = torch.cat([x.flatten().double() for x in ref])
        assert fb.norm() > 0
        assert (fa - fb).norm() <= 2e-4 * fb.norm() + 1e-9, (step, float((fa - fb).norm()), float(fb.norm()))
