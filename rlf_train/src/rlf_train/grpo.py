"""GRPO math: group-normalised advantages (GRPO / Dr.GRPO), PPO-clip policy loss masked by the
loss mask, token-level aggregation, k3 KL to a frozen reference, entropy.

All functions are pure tensor code so they can be checked against hand-computed numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


def group_advantages(rewards: torch.Tensor, group_size: int, std_normalize: bool, eps: float = 1e-6) -> torch.Tensor:
    """A_i = r_i - mean(group), divided by the group std (unbiased=False) when `std_normalize`.

    `rewards` is [N] with N = groups * group_size, groups contiguous."""
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries")
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if std_normalize:
        adv = adv / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv.reshape(-1)


def token_advantages(
    returns: torch.Tensor, episode_returns: torch.Tensor, group_size: int, std_normalize: bool, eps: float = 1e-6
) -> torch.Tensor:
    """Per-token advantages with per-turn rewards: token t's return-to-go minus its group's mean episode
    return (over std). `returns` is [N, T] (return-to-go of the turn each token belongs to),
    `episode_returns` [N]. Without per-turn rewards every token's return equals the episode return,
    which reduces to `group_advantages` broadcast over tokens."""
    r = episode_returns.view(-1, group_size)
    mean = r.mean(dim=1).repeat_interleave(group_size).unsqueeze(1)
    adv = returns - mean
    if std_normalize:
        std = r.std(dim=1, unbiased=False).repeat_interleave(group_size).unsqueeze(1)
        adv = adv / (std + eps)
    return adv


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


@dataclass
class LossOut:
    loss: torch.Tensor  # this micro-batch's share of the mini-batch loss (sum over micro-batches = total)
    pg_loss: float
    kl: float
    clip_frac: float
    ratio_mean: float


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: LossAgg, total_tokens: float, total_seqs: int,
              norm_len: int) -> torch.Tensor:
    """Masked aggregation of per-token values [B, T]. Denominators are mini-batch totals so that
    summing micro-batch results gives the mini-batch value (exact gradient accumulation)."""
    m = mask.to(values.dtype)
    if agg == "token_mean":
        return (values * m).sum() / max(total_tokens, 1.0)
    if agg == "seq_mean_token_mean":
        per_seq = (values * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        return per_seq.sum() / max(total_seqs, 1)
    if agg == "seq_mean_token_sum_norm":  # Dr.GRPO: constant normaliser, no length bias
        return (values * m).sum() / (max(total_seqs, 1) * norm_len)
    raise ValueError(f"unknown loss_agg {agg!r}")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    agg: LossAgg = "token_mean",
    total_tokens: float | None = None,
    total_seqs: int | None = None,
    norm_len: int = 1,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> LossOut:
    """PPO-clip surrogate: -min(ratio * A, clip(ratio, 1-lo, 1+hi) * A), plus kl_coef * k3 KL, masked.

    Shapes: [B, T] for logp/old_logp/mask; advantages [B] or [B, T]."""
    m = mask.to(logp.dtype)
    if total_tokens is None:
        total_tokens = float(m.sum().item())
    if total_seqs is None:
        total_seqs = logp.shape[0]
    adv = advantages.unsqueeze(1) if advantages.ndim == 1 else advantages
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    pg = -torch.minimum(unclipped, clipped)
    loss = aggregate(pg, m, agg, total_tokens, total_seqs, norm_len)
    kl_val = 0.0
    if ref_logp is not None and kl_coef > 0:
        kl = k3_kl(logp, ref_logp)
        kl_term = aggregate(kl, m, agg, total_tokens, total_seqs, norm_len)
        loss = loss + kl_coef * kl_term
        kl_val = float(kl_term.detach())
    with torch.no_grad():
        n = m.sum().clamp(min=1.0)
        clip_frac = float(((clipped < unclipped).to(m.dtype) * m).sum() / n)  # clipped term active
        ratio_mean = float((ratio * m).sum() / n)
    return LossOut(loss=loss, pg_loss=float(aggregate(pg.detach(), m, agg, total_tokens, total_seqs, norm_len)),
                   kl=kl_val, clip_frac=clip_frac, ratio_mean=ratio_mean)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) per position: logits [B, T, V], targets [B, T] -> [B, T]."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def masked_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    targets: torch.Tensor, mask: torch.Tensor, with_entropy: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) [B, T] computed only where `mask` is set (0 elsewhere), plus per-token entropy there.

    The vocabulary projection runs on the masked (policy) positions only: with short actions inside
    long prompts/observations this is most of the compute saved."""
    body = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    sel = mask.bool()
    if body is None or head is None or body is model:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        lp = token_logprobs(logits, targets) * mask
        ent = entropy_from_logits(logits) * mask if with_entropy else None
        return lp, ent
    hidden = body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    logits = head(hidden[sel]).float()  # [K, V]
    logp_all = torch.log_softmax(logits, dim=-1)
    lp = torch.zeros(mask.shape, dtype=logits.dtype, device=logits.device)
    lp[sel] = logp_all.gather(-1, targets[sel].unsqueeze(-1)).squeeze(-1)
    ent = None
    if with_entropy:
        ent = torch.zeros(mask.shape, dtype=logits.dtype, device=logits.device)
        ent[sel] = -(logp_all.exp() * logp_all).sum(-1).detach()
    return lp, ent


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
