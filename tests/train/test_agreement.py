"""Rollout/learner agreement in every step's metrics (`rlf_train.agreement`) and the weight of an agent episode cut
into segments (`algorithm.segment_weight`, `grpo.aggregate`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from train_envs import spec_cfg

from rlf_train.agreement import WARN_KL, agreement_stats, disagreement
from rlf_train.config import load_config
from rlf_train.grpo import aggregate, policy_loss, segment_weights
from rlf_train.trainer import Trainer
from rlf_train.watch import RunWatch


def test_agreement_stats_by_hand() -> None:
    learner = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-0.5, -0.5, 0.0, 0.0]])
    behaviour = torch.tensor([[-1.0, -2.5, -2.0, 9.0], [-0.5, -0.7, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    stale = torch.tensor([[0, 0, 1, 1], [2, 2, -1, -1]])
    out = agreement_stats(learner, behaviour, mask, stale, "vllm")
    d0 = torch.tensor([0.0, 0.5])  # row 0, stale 0: learner - behaviour
    assert out["agree/vllm/stale0/diff_mean"] == pytest.approx(0.25)
    assert out["agree/vllm/stale0/diff_max"] == pytest.approx(0.5)
    assert out["agree/vllm/stale0/kl"] == pytest.approx(float((torch.exp(d0) - 1 - d0).mean()))
    assert out["agree/vllm/stale0/tokens"] == 2 and out["agree/vllm/stale1/tokens"] == 1
    assert out["agree/vllm/stale2+/diff_max"] == pytest.approx(0.2) and out["agree/vllm/tokens"] == 5
    assert out["agree/vllm/diff_max"] == pytest.approx(1.0)  # the masked-out 9.0 is not a policy token
    assert disagreement(out) is not None and disagreement({**out, "agree/vllm/stale0/kl": 0.0}) is None


def test_a_disagreeing_engine_is_warned_about_once() -> None:
    said: list[str] = []
    watch = RunWatch(said.append)
    watch.step({"agree/vllm/stale0/kl": WARN_KL / 10, "agree/vllm/stale1/kl": 0.5})  # stale tokens may differ
    assert said == []
    for _ in range(3):
        watch.step({"agree/vllm/stale0/kl": 0.02})
    assert len(said) == 1 and "vllm" in said[0] and "rlf_train.replay" in said[0]


@pytest.mark.timeout(600)
def test_every_async_step_reports_agreement_by_staleness(tmp_path: Path) -> None:
    """The local async engine samples with the weights the learner recomputes on: on fresh tokens they agree to
    float32 noise; tokens one update old differ by the update."""
    cfg = spec_cfg(tmp_path / "run", ["algorithm.steps=3", "rollout.mode=async", "rollout.async_worker=thread",
                                      "rollout.max_staleness=1"])
    Trainer(cfg).run()
    rl = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if r.get("stage") == "rl"]
    assert len(rl) == 3
    first = rl[0]
    assert first["agree/local/stale0/tokens"] > 0 and first["agree/local/stale0/diff_max"] < 1e-5
    stale = [r for r in rl if "agree/local/stale1/tokens" in r]
    assert stale and all(r["agree/local/stale1/diff_max"] > 1e-3 for r in stale)  # lr 5e-2: the policy moved


def _loss(agg: str, pieces: int, weight: str) -> float:
    """Episode A (value 1.0 on each of its 6 policy tokens) cut into `pieces` rows, episode B (value 4.0, 6 tokens)
    one row; the loss's aggregation of the two."""
    rows = [torch.full((6 // pieces,), 1.0) for _ in range(pieces)] + [torch.full((6,), 4.0)]
    values = torch.zeros((len(rows), 6))
    mask = torch.zeros((len(rows), 6))
    for i, r in enumerate(rows):
        values[i, :len(r)] = r
        mask[i, :len(r)] = 1
    episode_of_row = [0] * pieces + [1]
    w = segment_weights(episode_of_row, [len(r) for r in rows]) if weight == "episode" else None
    total_seqs = float(w.sum()) if w is not None else len(rows)
    return float(aggregate(values, mask, agg, float(mask.sum()), total_seqs, 6, w))  # type: ignore[arg-type]


@pytest.mark.parametrize("agg", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_an_episode_counts_once_however_many_segments(agg: str) -> None:
    by_pieces = [_loss(agg, k, "episode") for k in (1, 2, 3, 6)]
    assert by_pieces == pytest.approx([by_pieces[0]] * 4)
    per_segment = [_loss(agg, k, "segment") for k in (1, 2, 3)]
    assert per_segment[0] == pytest.approx(by_pieces[0])
    assert per_segment[2] < per_segment[1] < per_segment[0]  # the cut episode (the low one) weighs more and more


def test_an_unevenly_cut_episode_keeps_its_own_token_mean() -> None:
    """Segments of 1 and 5 tokens (values 3 and 0): the episode's token mean is 0.5, not the mean of its segments'."""
    values = torch.tensor([[3.0, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    mask = torch.tensor([[1.0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    w = segment_weights([0, 0], [1, 5])
    assert w.tolist() == pytest.approx([1 / 6, 5 / 6])
    assert float(aggregate(values, mask, "seq_mean_token_mean", 6.0, float(w.sum()), 5, w)) == pytest.approx(0.5)
    assert segment_weights([0, 0, 1], [0, 0, 4]).tolist() == pytest.approx([0.5, 0.5, 1.0])  # no tokens: 1/k


def test_token_mean_weighs_tokens_either_way() -> None:
    assert [_loss("token_mean", k, "episode") for k in (1, 2, 3)] == pytest.approx([2.5] * 3)
    assert [_loss("token_mean", k, "segment") for k in (1, 2, 3)] == pytest.approx([2.5] * 3)


def test_the_gradient_follows_the_weights() -> None:
    """policy_loss passes the weights on: the gradient on each of 3 segments of one episode is a third of what
    the same tokens get as one row."""
    logp = torch.zeros((2, 4), requires_grad=True)
    kw = {"clip_low": 0.2, "clip_high": 0.2, "agg": "seq_mean_token_mean"}
    mask = torch.ones((2, 4))
    adv = torch.ones((2, 4))
    policy_loss(logp, logp.detach(), adv, mask, total_seqs=4 / 3, row_weight=torch.tensor([1 / 3, 1.0]),
                **kw).loss.backward()  # type: ignore[arg-type]
    g = logp.grad.clone()  # type: ignore[union-attr]
    assert g[0].sum() == pytest.approx(g[1].sum() / 3)


def test_segment_weight_is_configurable() -> None:
    assert load_config(None, []).algorithm.segment_weight == "episode"
    assert load_config(None, ["algorithm.segment_weight=segment"]).algorithm.segment_weight == "segment"
    with pytest.raises(Exception, match="segment_weight"):
        load_config(None, ["algorithm.segment_weight=turn"])
