"""grpo.py's pure functions pinned to their docstrings at the edges the trainer tests do not reach (found by
mutation testing, see docs/guides/trainer-correctness.md): eps and its default, one-token / one-sequence
denominators, KL gating and its aggregation in every mode, the logged diagnostics (clip fraction, ratio
mean, pg loss), top-p at its boundaries and on 3-D logits, and the log-prob path for models without a
separate body/head (`masked_logprobs`' fallback) against the fast path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlf_train.config import load_config
from rlf_train.grpo import (
    aggregate,
    entropy_from_logits,
    group_advantages,
    masked_logprobs,
    policy_loss,
    token_advantages,
)
from rlf_train.policy.model import build_tiny_model
from rlf_train.policy.tokenizer import load_tokenizer
from rlf_train.rollout.sampling import sampling_logits


def test_advantage_eps_and_its_default() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    s = float(np.std([1.0, 0.0, 0.0, 0.0]))
    assert group_advantages(r, 4, True, eps=0.5).tolist() == pytest.approx([0.75 / (s + 0.5)] + [-0.25 / (s + 0.5)] * 3)
    default = token_advantages(r.unsqueeze(1), r, 4, True).squeeze(1)  # eps defaults to 1e-6 (config's too)
    assert default.tolist() == pytest.approx([0.75 / (s + 1e-6)] + [-0.25 / (s + 1e-6)] * 3, rel=1e-7)
    assert group_advantages(r, 4, True).tolist() == default.tolist()
    with pytest.raises(ValueError, match=r"returns has 3 rows, episode returns 4"):
        token_advantages(torch.zeros(3, 2), r, 4, True)


def test_aggregate_denominators_at_one_token_and_one_sequence() -> None:
    v = torch.tensor([[3.0, 5.0]])
    m = torch.tensor([[1.0, 0.0]])
    assert aggregate(v, m, "token_mean", 1.0, 1, 7).item() == 3.0  # one token: / 1
    assert aggregate(v, m, "seq_mean_token_mean", 1.0, 1, 7).item() == 3.0  # one sequence: / 1
    assert aggregate(v, m, "seq_mean_token_sum_norm", 1.0, 1, 7).item() == pytest.approx(3.0 / 7)
    assert aggregate(v, m * 0, "token_mean", 0.0, 0, 7).item() == 0.0  # empty: no division by zero
    with pytest.raises(ValueError, match="unknown loss_agg 'mean'"):
        aggregate(v, m, "mean", 1.0, 1, 7)  # type: ignore[arg-type]
    # policy_loss's default norm_len is 1: the Dr.GRPO sum over sequences only
    lp = torch.zeros(1, 2)
    out = policy_loss(lp, lp, torch.tensor([2.0]), torch.ones(1, 2), clip_low=0.2, clip_high=0.2,
                      agg="seq_mean_token_sum_norm")
    assert out.loss.item() == pytest.approx(-4.0)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_kl_gating_and_aggregation(agg: str) -> None:
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.2, 0.3, 0.9]]))
    ref = torch.log(torch.tensor([[0.25, 0.25, 0.3], [0.4, 0.1, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    kw = {"clip_low": 0.2, "clip_high": 0.2, "agg": agg, "norm_len": 5}
    base = policy_loss(lp, lp, adv, mask, **kw)  # type: ignore[arg-type]
    assert base.kl == 0.0
    assert policy_loss(lp, lp, adv, mask, ref_logp=ref, **kw).kl == 0.0  # type: ignore[arg-type]  # kl_coef 0
    assert policy_loss(lp, lp, adv, mask, ref_logp=ref, kl_coef=0.0, **kw).kl == 0.0  # type: ignore[arg-type]
    assert policy_loss(lp, lp, adv, mask, kl_coef=0.3, **kw).loss.item() == base.loss.item()  # type: ignore[arg-type]
    out = policy_loss(lp, lp, adv, mask, ref_logp=ref, kl_coef=0.3, **kw)  # type: ignore[arg-type]
    d = (ref - lp).double().numpy()
    k3 = (np.exp(d) - d - 1) * mask.numpy()
    want = {"token_mean": k3.sum() / mask.sum().item(),
            "seq_mean_token_mean": (k3.sum(1) / mask.numpy().sum(1)).mean(),
            "seq_mean_token_sum_norm": k3.sum() / (2 * 5)}[agg]
    assert out.kl == pytest.approx(want, rel=1e-6)
    assert out.loss.item() == pytest.approx(base.loss.item() + 0.3 * want, rel=1e-6)


def test_logged_diagnostics() -> None:
    old = torch.log(torch.tensor([[0.2, 0.4, 0.4, 0.2, 0.3]]))
    new = torch.log(torch.tensor([[0.3, 0.2, 0.2, 0.3, 0.9]]))  # ratios 1.5, .5, .5, 1.5, 3 (last masked out)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    out = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert out.clip_frac == pytest.approx(0.5)
    assert out.ratio_mean == pytest.approx(1.0)
    assert out.pg_loss == pytest.approx((-1.2 - 0.5 + 0.8 + 1.5) / 4, abs=1e-6)
    same = policy_loss(old, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert same.clip_frac == 0.0 and same.ratio_mean == 1.0  # ratio 1: nothing clipped
    one = policy_loss(new[:, :1], old[:, :1], adv[:, :1], mask[:, :1], clip_low=0.2, clip_high=0.2)
    assert one.clip_frac == 1.0 and one.ratio_mean == pytest.approx(1.5)  # one token: / 1


def test_top_p_boundaries_and_3d() -> None:
    tail = torch.tensor([0.0, -30.0, -30.0])  # float32 cumsum reaches 1.0 before the tail tokens
    assert torch.isfinite(sampling_logits(tail, 1.0, 1.0)).all()  # top_p = 1: no truncation at all
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0))
    got = sampling_logits(logits, 0.7, 0.8)
    for b in range(2):
        for t in range(3):
            assert torch.equal(got[b, t], sampling_logits(logits[b, t], 0.7, 0.8))
    # the nucleus: tokens whose PRECEDING cumulative probability is strictly below top_p
    p = torch.tensor([0.5, 0.25, 0.125, 0.125])
    lg = torch.log(p)
    probs = torch.softmax(lg, -1)
    assert probs.tolist() == [0.5, 0.25, 0.125, 0.125]  # exact in float32
    assert torch.isinf(sampling_logits(lg, 1.0, 0.5)).tolist() == [False, True, True, True]
    assert torch.isinf(sampling_logits(lg, 1.0, 0.75)).tolist() == [False, False, True, True]


class NoBody(torch.nn.Module):
    """A causal LM without a separate body/head (masked_logprobs' fallback path: full logits)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> object:
        return self.inner(input_ids=input_ids, attention_mask=attention_mask)


@pytest.mark.parametrize(("temp", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_fallback_logprob_path_equals_fast_path(temp: float, top_p: float) -> None:
    cfg = load_config(None, ["model.tiny.hidden_size=16", "model.tiny.intermediate_size=32", "model.tiny.num_layers=1"])
    tok = load_tokenizer(cfg.model)
    model = build_tiny_model(cfg.model, len(tok), 0, tok.pad_token_id)
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with torch.no_grad():  # targets: the greedy tokens (always inside the nucleus)
        tgt = model(input_ids=ids, attention_mask=attn).logits.argmax(-1)
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0]])
    with torch.no_grad():
        fast_lp, fast_ent = masked_logprobs(model, ids, attn, tgt, mask, with_entropy=True, temperature=temp,
                                            top_p=top_p)
        slow_lp, slow_ent = masked_logprobs(NoBody(model), ids, attn, tgt, mask, with_entropy=True,
                                            temperature=temp, top_p=top_p)
    assert fast_ent is not None and slow_ent is not None
    assert torch.allclose(fast_lp, slow_lp, atol=1e-5) and torch.allclose(fast_ent, slow_ent, atol=1e-5)
    assert torch.all(fast_lp[mask == 0] == 0) and torch.all(fast_lp[mask == 1] < 0)
    # numpy: log p and entropy of the tempered nucleus distribution
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits.double().numpy()
    for b, t in zip(*np.nonzero(mask.numpy()), strict=True):
        z = logits[b, t] / temp
        q = np.exp(z - z.max())
        q /= q.sum()
        order = np.argsort(-q, kind="stable")
        keep = np.zeros_like(q, dtype=bool)
        keep[order[(np.cumsum(q[order]) - q[order]) < top_p]] = True
        q = np.where(keep, q, 0.0) / q[keep].sum()
        assert float(fast_lp[b, t]) == pytest.approx(math.log(q[tgt[b, t]]), abs=1e-4)
        ent = -sum(x * math.log(x) for x in q if x > 0)
        assert float(fast_ent[b, t]) == pytest.approx(ent, abs=1e-4)
    e = entropy_from_logits(torch.tensor([[0.0, 0.0], [0.0, -math.inf]]))
    assert e.tolist() == pytest.approx([math.log(2), 0.0])


def test_sampled_token_outside_the_nucleus_keeps_a_finite_logprob() -> None:
    """grpo.sampling_logits: `keep` forces the sampled token into the nucleus (the update's forward may move it
    just outside); its log-prob is then taken over nucleus + that token. Both log-prob paths do this."""
    logits = torch.tensor([[[3.0, 2.0, 0.0, -1.0]]])
    tgt = torch.tensor([[3]])  # far outside the top-0.5 nucleus {0}
    from rlf_train.grpo import token_logprobs

    lp = token_logprobs(logits, tgt, temperature=1.0, top_p=0.5)
    want = math.log(math.exp(-1.0) / (math.exp(3.0) + math.exp(-1.0)))
    assert lp.item() == pytest.approx(want, rel=1e-5)
    assert torch.equal(sampling_logits(logits), logits)  # defaults: temperature 1, no truncation
    assert token_logprobs(logits, tgt).item() == pytest.approx(torch.log_softmax(logits, -1)[0, 0, 3].item())

    cfg = load_config(None, ["model.tiny.hidden_size=16", "model.tiny.intermediate_size=32", "model.tiny.num_layers=1"])
    tok = load_tokenizer(cfg.model)
    model = build_tiny_model(cfg.model, len(tok), 0, tok.pad_token_id)
    ids = torch.tensor([[5, 6, 7, 8]])
    attn = torch.ones_like(ids)
    with torch.no_grad():
        worst = model(input_ids=ids, attention_mask=attn).logits.argmin(-1)  # least likely: outside the nucleus
    mask = torch.ones(1, 4)
    for m in (model, NoBody(model)):
        lp2, ent = masked_logprobs(m, ids, attn, worst, mask, temperature=0.7, top_p=0.5)
        assert ent is None  # with_entropy defaults to off
        assert torch.isfinite(lp2).all() and (lp2 < 0).all()
    a = masked_logprobs(model, ids, attn, worst, mask, temperature=0.7, top_p=0.5)[0]
    b = masked_logprobs(NoBody(model), ids, attn, worst, mask, temperature=0.7, top_p=0.5)[0]
    assert torch.allclose(a, b, atol=1e-5)
