"""The GRPO update pinned to its specification, on the real trainer's step (`Trainer.grpo_step`).

Each test recomputes the specified value independently (numpy / a plain full-batch torch forward) from
the trajectories the trainer's own rollout produced, and compares it with what the trainer did, so any
deviation fails, not one imagined mutation. The specification (grpo.py / config.py docstrings):

- advantages: A_i = (r_i - mean_g) / (std_g + eps), std the POPULATION std (unbiased=False) of the
  group's episode returns, `eps` = algorithm.eps added to the std (not under a sqrt); std division only
  when algorithm.std_normalize. Groups: rows i*G..(i+1)*G-1, the G samples of one prompt.
- loss aggregation over the policy tokens (loss mask) of one mini-batch:
  token_mean: sum / (number of policy tokens of the mini-batch);
  seq_mean_token_mean: mean over sequences of (sum / that sequence's policy tokens);
  seq_mean_token_sum_norm (Dr.GRPO): sum / (sequences of the mini-batch * rollout.max_total_tokens).
  Micro-batching (algorithm.micro_batch_size) is gradient accumulation: one optimizer step's gradient is
  the gradient of the whole mini-batch's loss computed in one piece.
- ratio = exp(logp - old_logp), old_logp the log-probs of the policy that sampled, under the sampling
  distribution (rollout.temperature / top_p): exactly 1 on the first epoch of fresh data.
- KL: k3 = exp(ref - logp) - (ref - logp) - 1 to a frozen reference, separate from the policy,
  aggregated like the policy loss, added as kl_coef * KL.
- gradient clipping: the gradient the optimizer steps with has total norm min(norm, optim.grad_clip).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from train_envs import MAX_TOTAL, PARITY_ID, G, N, P, spec_cfg  # noqa: F401 - the spec tests' shape

import rlf_train.trainer as trainer_mod
from rlf_envs.types import Trajectory
from rlf_train.config import load_config
from rlf_train.trainer import Trainer


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    run = tmp_path_factory.mktemp("spec") / "run"
    tr = Trainer(spec_cfg(run))
    init = copy.deepcopy(tr.model.state_dict())
    return tr, init, run


class Step:
    """One real `grpo_step` with `overrides`; records the rollout's trajectories (their loss masks made
    ragged so the aggregation denominators differ), every `policy_loss` call, and the gradient the
    optimizer stepped with."""

    def __init__(self, fixture: Any, monkeypatch: pytest.MonkeyPatch, overrides: list[str],
                 ragged: bool = True, ref: bool = False, steps: int = 1, lr: float | None = None,
                 base: list[str] | None = None) -> None:
        tr, init, run = fixture
        tr.cfg = spec_cfg(run, [*(base or []), *overrides])
        tr.model.load_state_dict(init)
        tr.gen.manual_seed(11)
        tr.data_rng, tr.order, tr.order_pos = np.random.default_rng(7), [], 0  # the same prompts every time
        tr.ref_model = tr._reference_model() if ref else None
        self.tr = tr
        self.trajs: list[list[Trajectory]] = []
        self.weights: list[dict[str, torch.Tensor]] = []
        self.calls: list[dict[str, Any]] = []
        self.grads: list[list[torch.Tensor]] = []
        self.stepped: list[dict[str, torch.Tensor]] = []  # the weights each optimizer step's gradient was taken at
        orig_rollouts, orig_loss = tr.source.rollouts, trainer_mod.policy_loss

        def rollouts(venv: Any, idx: Any, params: Any, seed_base: int, gen: Any) -> Any:
            self.weights.append(copy.deepcopy(tr.model.state_dict()))
            trajs, stats = orig_rollouts(venv, idx, params, seed_base, gen)
            if ragged:  # drop 0..2 trailing policy tokens per row: sequences with 1..4 policy tokens
                for i, t in enumerate(trajs):
                    m = list(t.loss_mask or [])
                    pos = [k for k, v in enumerate(m) if v]
                    for k in pos[len(pos) - min(i % 3, len(pos) - 1):]:
                        m[k] = 0
                    t.loss_mask = m
            self.trajs.append(trajs)
            return trajs, stats

        def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                        **kw: Any) -> Any:
            out = orig_loss(logp, old_logp, adv, mask, **kw)
            ref = kw.get("ref_logp")
            self.calls.append({"logp": logp.detach().clone(), "old": old_logp.clone(), "adv": adv.clone(),
                               "mask": mask.clone(), "ref": None if ref is None else ref.clone(), "out": out,
                               "kw": dict(kw)})
            return out

        monkeypatch.setattr(tr.source, "rollouts", rollouts)
        monkeypatch.setattr(trainer_mod, "policy_loss", policy_loss)
        opt = torch.optim.AdamW(tr.model.parameters(), lr=tr.cfg.optim.lr if lr is None else lr)

        def capture(*_: Any) -> None:  # runs inside optimizer.step, after clipping, before the update
            self.grads.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                               for p in tr.model.parameters()])
            self.stepped.append(copy.deepcopy(tr.model.state_dict()))

        opt.register_step_pre_hook(capture)
        self.opt = opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        self.recs = [tr.grpo_step(k + 1, opt, sched) for k in range(steps)]
        monkeypatch.undo()


def expected_advantages(rewards: list[float], std_normalize: bool, eps: float) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64).reshape(-1, G)
    a = r - r.mean(axis=1, keepdims=True)
    if std_normalize:
        a = a / (r.std(axis=1, ddof=0, keepdims=True) + eps)
    return a.reshape(-1)


def reference_grad(model: torch.nn.Module, trajs: list[Trajectory], adv: np.ndarray, agg: str,
                   temperature: float = 1.0) -> list[torch.Tensor]:
    """The specified loss of the whole batch in one piece (ratio 1: pg = -A * exp(lp - sg(lp))), its grad."""
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    total = torch.zeros(())
    n_tok = sum(sum(t.loss_mask[1:]) for t in trajs)  # type: ignore[index]
    per_seq = []
    for i, t in enumerate(trajs):
        ids = torch.tensor([t.token_ids], dtype=torch.long)
        logits = m(input_ids=ids[:, :-1], attention_mask=torch.ones_like(ids[:, :-1])).logits.float()
        lp = torch.log_softmax(logits / temperature, -1).gather(-1, ids[:, 1:, None])[0, :, 0]
        mask = torch.tensor(t.loss_mask[1:], dtype=torch.float32)  # type: ignore[index]
        pg = -float(adv[i]) * torch.exp(lp - lp.detach()) * mask
        per_seq.append((pg.sum(), mask.sum()))
    if agg == "token_mean":
        total = sum(s for s, _ in per_seq) / n_tok
    elif agg == "seq_mean_token_mean":
        total = sum(s / c for s, c in per_seq) / len(trajs)
    else:
        total = sum(s for s, _ in per_seq) / (len(trajs) * MAX_TOTAL)
    total.backward()  # type: ignore[union-attr]
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in m.parameters()]


def _close(a: list[torch.Tensor], b: list[torch.Tensor], rel: float = 1e-4) -> None:
    fa = torch.cat([x.flatten() for x in a])
    fb = torch.cat([x.flatten() for x in b])
    assert fb.norm() > 0
    assert (fa - fb).norm() <= rel * fb.norm() + 1e-9, f"|diff| {(fa - fb).norm():.3e} vs |ref| {fb.norm():.3e}"


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_step_gradient_is_the_one_piece_gradient_for_every_micro_batch(trainer: Any, monkeypatch: pytest.MonkeyPatch,
                                                                       agg: str) -> None:
    grads = []
    for mb in (1, 5, N):
        s = Step(trainer, monkeypatch, [f"algorithm.loss_agg={agg}", f"algorithm.micro_batch_size={mb}",
                                        "algorithm.std_normalize=true", "algorithm.eps=0.25"])
        trajs = s.trajs[0]
        assert len({sum(t.loss_mask) for t in trajs}) > 1  # ragged: denominators differ per mode
        adv = expected_advantages([t.reward for t in trajs], True, 0.25)
        assert np.abs(adv).max() > 0
        model0 = copy.deepcopy(s.tr.model)
        model0.load_state_dict(s.weights[0])
        assert len(s.grads) == 1
        _close(s.grads[0], reference_grad(model0, trajs, adv, agg))
        grads.append(s.grads[0])
    # and the three micro-batch sizes agree with each other to float rounding
    for g in grads[1:]:
        _close(g, grads[0], rel=1e-5)


@pytest.mark.parametrize(("std", "eps"), [(True, 1e-6), (True, 0.5), (False, 1e-6)])
def test_advantages_on_the_trainer_path(trainer: Any, monkeypatch: pytest.MonkeyPatch, std: bool, eps: float) -> None:
    s = Step(trainer, monkeypatch, [f"algorithm.std_normalize={str(std).lower()}", f"algorithm.eps={eps}",
                                    "algorithm.micro_batch_size=5"], ragged=False)
    trajs = s.trajs[0]
    # groups as the rollout produced them: G consecutive rows share one task, P different tasks
    ids = [t.task.id for t in trajs]
    assert all(len(set(ids[g:g + G])) == 1 for g in range(0, N, G))
    assert len({ids[g] for g in range(0, N, G)}) == P
    want = expected_advantages([t.reward for t in trajs], std, eps)
    got = []
    for c in s.calls:
        for row, m in zip(c["adv"], c["mask"], strict=True):
            vals = row[m.bool()]
            assert torch.all(vals == vals[0])  # one advantage per episode (no per-turn rewards here)
            got.append(float(vals[0]))
    assert np.allclose(got, want, rtol=1e-5, atol=1e-6), (got, want.tolist())
    assert np.abs(want).max() > 0


def test_dr_grpo_defaults() -> None:
    a = load_config(None, ["algorithm.name=dr_grpo"]).algorithm
    assert (a.std_normalize, a.loss_agg) == (False, "seq_mean_token_sum_norm")
    a = load_config(None, ["algorithm.name=grpo"]).algorithm
    assert (a.std_normalize, a.loss_agg, a.eps) == (True, "token_mean", 1e-6)


def test_ratio_old_logprobs_and_kl(trainer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two epochs, two steps, temperature 0.7 / top-p 0.9, KL 0.1 to a reference."""
    s = Step(trainer, monkeypatch, ["algorithm.ppo_epochs=2", "algorithm.micro_batch_size=6",
                                    "rollout.temperature=0.7", "rollout.top_p=0.9", "algorithm.kl_coef=0.1",
                                    "algorithm.std_normalize=false"], ragged=False, ref=True, steps=2)
    tr = s.tr
    ref = tr.ref_model
    assert ref is not None and ref is not tr.model
    ref_ptrs = {p.data_ptr() for p in ref.parameters()}
    assert not ref_ptrs & {p.data_ptr() for p in tr.model.parameters()}
    assert not any(p.requires_grad for p in ref.parameters())
    init = trainer[1]
    assert all(torch.equal(v, init[k]) for k, v in ref.state_dict().items())  # frozen through 2 steps x 2 epochs
    assert not all(torch.equal(v, init[k]) for k, v in tr.model.state_dict().items())
    per_step = len(s.calls) // 2
    assert per_step == 2 * 2  # 2 epochs x 2 micro-batches of 6
    for k in range(2):
        calls = s.calls[k * per_step:(k + 1) * per_step]
        # old log-probs are those of the policy that sampled, under the tempered top-p distribution
        sampler = copy.deepcopy(tr.model)
        sampler.load_state_dict(s.weights[k])
        beh = behaviour_logprobs(sampler, s.trajs[k], 0.7, 0.9)
        old = torch.cat([c["old"][c["mask"].bool()] for c in calls[:2]])
        assert torch.allclose(old, beh, atol=1e-5), (old, beh)
        for j, c in enumerate(calls):  # the same old log-probs in every epoch
            assert torch.equal(c["old"], calls[j % 2]["old"])
        for j, c in enumerate(calls):
            m = c["mask"].bool()
            ratio = torch.exp(c["logp"][m] - c["old"][m])
            if j < 2:  # first epoch of fresh data: exactly the sampling policy
                assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5), ratio
            else:
                assert (ratio - 1).abs().max() > 1e-3
            # k3 against numpy, token_mean over this micro-batch's mini-batch token count
            lp, rf = c["logp"][m].double().numpy(), c["ref"][m].double().numpy()
            d = rf - lp
            kl = (np.exp(d) - d - 1).sum() / c["kw"]["total_tokens"]
            assert c["out"].kl == pytest.approx(kl, rel=1e-4, abs=1e-7)
            if k == 0 and j < 2:
                assert kl == pytest.approx(0.0, abs=1e-7)  # step 0: the policy is the reference
            if j >= 2 or k == 1:
                assert kl > 1e-7  # after an update
    assert s.recs[0]["kl"] > 0 and s.recs[1]["kl"] > 0


def nucleus_logprob_choices(model: torch.nn.Module, t: Trajectory, temp: float, top_p: float, strict: bool = True,
                            margin: float = 0.0) -> list[list[float]]:
    """numpy: log p of each policy token of `t` under softmax(logits / temp) truncated to the top-p nucleus
    (the smallest prefix of the sorted probabilities whose mass reaches top_p), renormalised. `strict`: the
    token must lie in the nucleus (it was sampled from it); else (a token scored under newer weights) it is
    added to the nucleus, as the update does so that its log-prob stays finite.

    One value per token with `margin` 0. With `margin` > 0, every value a nucleus cut could give when the
    cumulative mass before a token lies within `margin` of top_p: float32 code on a padded batch (the sampler,
    the update) and this float64 forward of one row can put such a token on either side of the cut."""
    out = []
    with torch.no_grad():
        ids = torch.tensor([t.token_ids], dtype=torch.long)
        logits = model(input_ids=ids[:, :-1]).logits[0].double().numpy()
    for pos, on in enumerate((t.loss_mask or [])[1:]):
        if not on:
            continue
        z = logits[pos] / temp
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]  # the mass ahead of each token, in sorted order
        cuts = range(int((before < top_p - margin).sum()), int((before < top_p + margin).sum()) + 1) if margin \
            else [int((before < top_p).sum())]
        tok = (t.token_ids or [])[pos + 1]
        assert tok in order[:max(cuts)] or not strict, "a sampled token outside the top-p nucleus"
        values = []
        for n in cuts:
            keep = np.zeros_like(p, dtype=bool)
            keep[order[:n]] = True
            keep[tok] = True
            values.append(float(np.log(p[tok] / p[keep].sum())))
        out.append(values)
    return out


def nucleus_logprobs(model: torch.nn.Module, t: Trajectory, temp: float, top_p: float,
                     strict: bool = True) -> list[float]:
    """`nucleus_logprob_choices` with no margin: the one value of each policy token."""
    return [v for (v,) in nucleus_logprob_choices(model, t, temp, top_p, strict)]


def behaviour_logprobs(model: torch.nn.Module, trajs: list[Trajectory], temp: float, top_p: float) -> torch.Tensor:
    """`nucleus_logprobs` of every sampled policy token of `trajs`, in order."""
    return torch.tensor([x for t in trajs for x in nucleus_logprobs(model, t, temp, top_p)], dtype=torch.float32)


@pytest.mark.parametrize("clip", [1e-3, 1e6])
def test_grad_clip_norm(trainer: Any, monkeypatch: pytest.MonkeyPatch, clip: float) -> None:
    s = Step(trainer, monkeypatch, [f"optim.grad_clip={clip}", "algorithm.micro_batch_size=12"])
    norm = torch.cat([g.flatten() for g in s.grads[0]]).norm().item()
    pre = s.recs[0]["grad_norm"]  # logged: the norm before clipping
    assert pre > 1e-3
    assert norm == pytest.approx(min(pre, clip), rel=1e-4)
