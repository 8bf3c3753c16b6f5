"""GRPO math on hand-computed numbers, and the loss mask: only policy tokens get gradient."""

from __future__ import annotations

import math

import pytest
import torch

from rlf_envs.types import Action, ActionKind, Task, Trajectory, Turn
from rlf_train.config import load_config
from rlf_train.grpo import (
    group_advantages,
    k3_kl,
    masked_logprobs,
    policy_loss,
    token_advantages,
    token_logprobs,
    token_returns,
)
from rlf_train.policy.model import build_tiny_model
from rlf_train.policy.tokenizer import load_tokenizer
from rlf_train.sft import pad_batch, sft_loss


def test_group_advantages_hand_computed() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    a = group_advantages(r, 4, std_normalize=False)
    assert torch.allclose(a, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]))
    a = group_advantages(r, 4, std_normalize=True, eps=0.0 + 1e-12)
    s = math.sqrt(0.1875)  # population std of [1, 0, 0, 0]
    assert torch.allclose(a[:4], torch.tensor([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s]))
    assert torch.all(a[4:] == 0)  # zero-variance group: zero advantage, no NaN
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(5), 4, True)


def test_ppo_clip_loss_and_kl_hand_computed() -> None:
    # four tokens in one sequence, ratios 1.5, 0.5, 0.5, 1.5; advantages +1, +1, -1, -1
    old = torch.log(torch.tensor([[0.2, 0.4, 0.4, 0.2]]))
    new = torch.log(torch.tensor([[0.3, 0.2, 0.2, 0.3]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    out = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # per token: -min(r*A, clip(r)*A) = -1.2, -0.5, 0.8, 1.5  -> mean 0.15
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 1.5) / 4, abs=1e-6)
    assert out.clip_frac == pytest.approx(0.5)  # tokens 1 and 3 are clipped
    # asymmetric clip (clip-higher): upper bound 1.28 -> token 1 gives -1.28
    out = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert out.loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.5) / 4, abs=1e-6)
    # mask the last token: token mean over 3
    m3 = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    out = policy_loss(new, old, adv, m3, clip_low=0.2, clip_high=0.2)
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 0.8) / 3, abs=1e-6)
    # k3 KL: logp = log .5, ref = log .25 -> .5 + ln 2 - 1
    kl = k3_kl(torch.log(torch.tensor(0.5)), torch.log(torch.tensor(0.25)))
    assert kl.item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    same = torch.log(torch.full((1, 4), 0.25))
    out = policy_loss(same, same, adv, mask, clip_low=0.2, clip_high=0.2, ref_logp=torch.log(torch.full((1, 4), 0.125)),
                      kl_coef=0.1)
    # ratio 1 -> pg = -(1 + 1 - 1 - 1)/4 = 0; kl per token = .5 + ln 2 - 1
    assert out.kl == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    assert out.loss.item() == pytest.approx(0.1 * (0.5 + math.log(2) - 1), abs=1e-6)


def test_aggregations_and_accumulation() -> None:
    lp = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # ratio 1: per-token pg = -A ; seq0 tokens -1,-1 ; seq1 token +2
    tok = policy_loss(lp, lp, adv, mask, clip_low=0.2, clip_high=0.2, agg="token_mean")
    assert tok.loss.item() == pytest.approx((-1 - 1 + 2) / 3)
    seq = policy_loss(lp, lp, adv, mask, clip_low=0.2, clip_high=0.2, agg="seq_mean_token_mean")
    assert seq.loss.item() == pytest.approx((-1 + 2) / 2)
    dr = policy_loss(lp, lp, adv, mask, clip_low=0.2, clip_high=0.2, agg="seq_mean_token_sum_norm", norm_len=10)
    assert dr.loss.item() == pytest.approx((-2 + 2) / (2 * 10))
    # advantages that do not cancel tell the three apart: pg per token -1, -1 (seq 0) and +3 (seq 1)
    adv3 = torch.tensor([1.0, -3.0])
    losses = [policy_loss(lp, lp, adv3, mask, clip_low=0.2, clip_high=0.2, agg=agg, norm_len=10).loss.item()
              for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")]
    assert losses == pytest.approx([1 / 3, (-1 + 3) / 2, (-2 + 3) / (2 * 10)])
    # micro-batches with mini-batch denominators sum to the full-batch loss
    a = policy_loss(lp[:1], lp[:1], adv[:1], mask[:1], clip_low=0.2, clip_high=0.2, total_tokens=3, total_seqs=2)
    b = policy_loss(lp[1:], lp[1:], adv[1:], mask[1:], clip_low=0.2, clip_high=0.2, total_tokens=3, total_seqs=2)
    assert (a.loss + b.loss).item() == pytest.approx(tok.loss.item())


def _traj(ids: list[int], mask: list[int], reward: float, turn_spans: list[tuple[int, int]],
          turn_rewards: list[float]) -> Trajectory:
    t = Trajectory(task=Task("t", "q"), prompt="", token_ids=ids, loss_mask=mask, reward=reward)
    for span, r in zip(turn_spans, turn_rewards, strict=True):
        t.turns.append(Turn(action=Action(ActionKind.ANSWER, ""), reward=r, action_span=span))
    return t


def test_per_turn_returns_hand_computed() -> None:
    # prompt [0,1], turn0 action [2,3] obs [4], turn1 action [5]; turn rewards .1 and .2, final 1
    tr = _traj([9, 9, 7, 7, 8, 7], [0, 0, 1, 1, 0, 1], 1.0, [(2, 4), (5, 6)], [0.1, 0.2])
    other = _traj([9, 9, 7, 7, 8, 7], [0, 0, 1, 1, 0, 1], 0.0, [(2, 4), (5, 6)], [0.0, 0.0])
    ret, ep = token_returns([tr, other], 5, per_turn=True)
    assert ep.tolist() == pytest.approx([1.3, 0.0])
    # targets t=1,2 are the turn-0 tokens (ids 2,3) -> return 1.3; target 4 (id 5) -> 1.2
    assert ret[0, 1:3].tolist() == pytest.approx([1.3, 1.3]) and ret[0, 4].item() == pytest.approx(1.2)
    adv = token_advantages(ret, ep, 2, std_normalize=False)
    assert adv[0, 4].item() == pytest.approx(1.2 - 0.65) and adv[1, 4].item() == pytest.approx(-0.65)
    # the std-normalised path (GRPO's default, what the trainer calls): group of 2 episodes, returns 1.3
    # and 0: mean 0.65, population std 0.65
    adv = token_advantages(ret, ep, 2, std_normalize=True, eps=1e-6)
    assert adv[0, 1].item() == pytest.approx((1.3 - 0.65) / (0.65 + 1e-6))
    assert adv[0, 4].item() == pytest.approx((1.2 - 0.65) / (0.65 + 1e-6))
    assert adv[1, 4].item() == pytest.approx(-0.65 / (0.65 + 1e-6))
    # two groups of two (rows 0,1 | 2,3): each normalised by its own statistics
    ep4 = torch.tensor([1.0, 0.0, 3.0, 1.0])
    adv4 = token_advantages(ep4.unsqueeze(1), ep4, 2, std_normalize=True, eps=0.0)
    assert adv4.squeeze(1).tolist() == pytest.approx([1.0, -1.0, 1.0, -1.0])
    with pytest.raises(ValueError, match="multiple of group_size"):
        token_advantages(ep4.unsqueeze(1)[:3], ep4[:3], 2, True)
    ret2, _ = token_returns([tr, other], 5, per_turn=False)
    assert torch.all(ret2[0] == 1.0)


@pytest.fixture(scope="module")
def tiny() -> tuple[torch.nn.Module, object]:
    cfg = load_config(None, ["model.tiny.hidden_size=32", "model.tiny.intermediate_size=64"])
    tok = load_tokenizer(cfg.model)
    model = build_tiny_model(cfg.model, len(tok), 0, tok.pad_token_id)
    return model, tok


def test_loss_mask_only_policy_tokens_count(tiny) -> None:  # type: ignore[no-untyped-def]
    """Two trajectories that differ only in their final observation tokens: identical SFT and GRPO losses
    under the env's loss mask, different ones if the observation were (wrongly) trained on."""
    model, _tok = tiny
    prompt, action, action2 = [5, 6, 7, 8], [20, 21, 22], [40, 41]
    obs_a, obs_b = [30, 31, 32], [33, 34, 35]
    mask = [0] * 4 + [1] * 3 + [0] * 3 + [1] * 2 + [0] * 3
    ids_a = prompt + action + obs_a + action2 + obs_a
    ids_b = prompt + action + obs_a + action2 + obs_b  # only the trailing observation differs
    ta = _traj(ids_a, mask, 1.0, [(4, 7), (10, 12)], [0.0, 0.0])
    tb = _traj(ids_b, mask, 1.0, [(4, 7), (10, 12)], [0.0, 0.0])
    with torch.no_grad():
        la, na = sft_loss(model, [ta], 0)
        lb, _ = sft_loss(model, [tb], 0)
    assert na == 5 and la.item() == lb.item()
    full_a = _traj(ids_a, [1] * len(ids_a), 1.0, [], [])
    full_b = _traj(ids_b, [1] * len(ids_b), 1.0, [], [])
    with torch.no_grad():
        assert sft_loss(model, [full_a], 0)[0].item() != sft_loss(model, [full_b], 0)[0].item()

    def grpo(tr: Trajectory) -> torch.Tensor:
        inp, attn, tgt, m = pad_batch([tr], 0, torch.device("cpu"))
        lp, _ = masked_logprobs(model, inp, attn, tgt, m)
        # huge advantages on observation positions would dominate the loss if they leaked through
        adv = torch.where(m.bool(), torch.ones_like(lp), torch.full_like(lp, 1e6))
        return policy_loss(lp, lp.detach() - 0.1, adv, m, clip_low=0.2, clip_high=0.2).loss

    ga, gb = grpo(ta), grpo(tb)
    assert ga.item() == gb.item() and abs(ga.item()) < 10
    # gradient: the vocabulary head only sees policy positions, and every parameter grad is finite/small
    rows: list[int] = []
    h = model.lm_head.register_forward_hook(lambda _m, _i, out: rows.append(out.shape[0]))
    try:
        grpo(ta).backward()
    finally:
        h.remove()
    assert rows == [5]
    gmax = max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    assert 0 < gmax < 100


def test_masked_logprobs_match_full_logits(tiny) -> None:  # type: ignore[no-untyped-def]
    model, _tok = tiny
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    tgt = torch.roll(ids, -1, 1)
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 0, 1, 0, 0, 0]], dtype=torch.float32)
    with torch.no_grad():
        lp, ent = masked_logprobs(model, ids, attn, tgt, mask, with_entropy=True)
        full = token_logprobs(model(input_ids=ids, attention_mask=attn).logits, tgt) * mask
    assert torch.allclose(lp, full, atol=1e-5)
    assert ent is not None and torch.all(ent[mask.bool()] > 0) and torch.all(ent[~mask.bool()] == 0)
