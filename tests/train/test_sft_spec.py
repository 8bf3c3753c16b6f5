"""SFT's batch layout and loss pinned to their specification (rlf_train.sft).

- pad_batch: the sequences right-padded with pad_id to the longest, inputs = that [:, :-1] with attention 1
  exactly on real tokens, targets = that [:, 1:], target_mask[t] = loss_mask[t + 1] and 0 on padding, all
  on the model's device; trajectories without token ids or loss mask are refused with the fix (token mode).
- sft_loss: token-mean cross-entropy over exactly the policy tokens (value and gradient equal a plain
  per-sequence reference), and the count it returns is the number of policy targets (0 when there are none,
  with a zero loss, not a NaN);
- a loss mask that does not fit its token ids (length, values other than 0/1) is refused.
"""

from __future__ import annotations

import pytest
import torch

from rlf_envs.types import Task, Trajectory
from rlf_train.sft import pad_batch, sft_loss
from tests.train.policy.test_checkpoint_spec import tiny

PAD = 63


def traj(ids: list[int] | None, mask: list[int] | None) -> Trajectory:
    return Trajectory(task=Task("t", "q"), prompt="", token_ids=ids, loss_mask=mask)


A = traj([5, 6, 7, 8, 9], [0, 0, 1, 1, 0])
B = traj([10, 11, 12], [0, 1, 1])
C = traj([13, 14, 15, 16], [1, 0, 1, 1])


def test_pad_batch_layout() -> None:
    ids, attn, tgt, mask = pad_batch([A, B, C], PAD, torch.device("cpu"))
    # the batch is padded to the longest sequence, then shifted: a shorter row keeps its last token as input
    assert ids.tolist() == [[5, 6, 7, 8], [10, 11, 12, PAD], [13, 14, 15, 16]]
    assert attn.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert tgt.tolist() == [[6, 7, 8, 9], [11, 12, PAD, PAD], [14, 15, 16, PAD]]
    assert mask.tolist() == [[0, 1, 1, 0], [1, 1, 0, 0], [0, 1, 1, 0]]
    assert ids.dtype == attn.dtype == tgt.dtype == torch.long and mask.dtype == torch.float32
    assert {t.device.type for t in (ids, attn, tgt, mask)} == {"cpu"}
    # a meta device shows the tensors are moved to the device asked for (the model's)
    assert {t.device.type for t in pad_batch([A, B], PAD, torch.device("meta"))} == {"meta"}
    for bad in (traj(None, [0, 1]), traj([1, 2], None)):
        with pytest.raises(ValueError, match=r"^trajectories lack token_ids/loss_mask: run the env in token mode "
                                             r"\(pass a tokenizer\)$"):
            pad_batch([A, bad], PAD, torch.device("cpu"))


def test_masks_must_fit_the_tokens() -> None:
    """Checked at run time (the trainer's batches go through pad_batch too): a mask that does not fit its
    tokens would train on the wrong tokens without any error."""
    with pytest.raises(ValueError, match=r"^trajectory 1: 3 token ids but 2 loss-mask entries; the env must give "
                                         r"one mask entry per token \(1 = policy token\)$"):
        pad_batch([traj([1, 2], [0, 1]), traj([1, 2, 3], [0, 1])], 0, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^trajectory 0: loss mask values must be 0 or 1, got \[2\]$"):
        pad_batch([traj([1, 2], [0, 2])], 0, torch.device("cpu"))


def reference_loss(model: torch.nn.Module, trajs: list[Trajectory]) -> tuple[torch.Tensor, int]:
    terms = []
    for t in trajs:
        ids = torch.tensor([t.token_ids])
        lp = torch.log_softmax(model(input_ids=ids[:, :-1]).logits[0].double(), -1)
        terms += [-lp[p, t.token_ids[p + 1]] for p in range(len(t.token_ids) - 1)  # type: ignore[index]
                  if t.loss_mask[p + 1]]  # type: ignore[index]
    return torch.stack(terms).sum() / len(terms), len(terms)


def test_sft_loss_value_and_gradient_are_token_mean_ce() -> None:
    model = tiny(3)
    batch = [A, B, C]
    loss, n = sft_loss(model, batch, PAD)
    loss.backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    ref, n_ref = reference_loss(model, batch)
    ref.backward()
    assert n == n_ref == 6
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    for k, p in model.named_parameters():
        assert p.grad is not None
        assert torch.allclose(got[k], p.grad.float(), rtol=1e-3, atol=1e-7), k


def test_sft_loss_with_zero_and_one_policy_token() -> None:
    model = tiny(3)
    loss, n = sft_loss(model, [traj([5, 6, 7], [1, 0, 0])], PAD)  # the only 1 is on the first token: no target
    assert n == 0
    assert loss.item() == 0.0
    one = traj([5, 6, 7], [0, 0, 1])
    loss, n = sft_loss(model, [one], PAD)
    ref, n_ref = reference_loss(model, [one])
    assert n == n_ref == 1 and loss.item() == pytest.approx(ref.item(), rel=1e-5)
