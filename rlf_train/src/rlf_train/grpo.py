"""GRPO math: group-normalised advantages (GRPO / Dr.GRPO), PPO-clip policy loss masked by the
loss mask, token-level aggregation, k3 KL to a frozen reference, entropy.

All functions are pure tensor code so they can be checked against hand-computed numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from rlf_envs.types import Trajectory
from rlf_train.rollout.sampling import sampling_logits

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


def group_advantages(rewards: torch.Tensor, group_size: int, std_normalize: bool, eps: float = 1e-6) -> torch.Tensor:
    """A_i = r_i - mean(group), divided by the group std (unbiased=False) when `std_normalize`: the
    one-token case of `token_advantages` (the function the trainer calls).

    `rewards` is [N] with N = groups * group_size, groups contiguous."""
    return token_advantages(rewards.unsqueeze(1), rewards, group_size, std_normalize, eps).squeeze(1)


def token_advantages(
    returns: torch.Tensor, episode_returns: torch.Tensor, group_size: int, std_normalize: bool, eps: float = 1e-6
) -> torch.Tensor:
    """Per-token advantages [N, T]: token t's return-to-go minus its group's mean episode return, divided
    by the group's std of episode returns (unbiased=False) + eps when `std_normalize` (GRPO; off for
    Dr.GRPO). `returns` is [N, T] (return-to-go of the turn each token belongs to), `episode_returns`
    [N]; groups are contiguous blocks of `group_size` rows, the layout the trainer's rollout produces
    (the trainer checks it). Without per-turn rewards every token's return equals the episode return, so
    each row is its episode's group advantage."""
    if episode_returns.ndim != 1 or episode_returns.numel() % group_size:
        raise ValueError(f"episode returns must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(episode_returns.shape)}")
    if returns.shape[0] != episode_returns.shape[0]:
        raise ValueError(f"returns has {returns.shape[0]} rows, episode returns {episode_returns.shape[0]}")
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
    """One micro-batch's loss (to backpropagate) and its statistics (for the logs)."""

    loss: torch.Tensor  # this micro-batch's share of the mini-batch loss (sum over micro-batches = total)
    pg_loss: float
    kl: float
    clip_frac: float
    ratio_mean: float
    is_weight_mean: float = 1.0  # mean truncated importance weight min(pi_prox / mu, C) (1 without behav_logp)


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: LossAgg, total_tokens: float, total_seqs: float,
              norm_len: int, row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Masked aggregation of per-token values [B, T]. Denominators are mini-batch totals so that
    summing micro-batch results gives the mini-batch value (exact gradient accumulation).

    `row_weight` [B] (`segment_weights`: rows that are segments of agent episodes, `algorithm.segment_weight`):
    each row's share of its episode, so that an episode counts once however it was cut. seq_mean_token_mean
    weighs each row's token mean by it (the episode's own token mean); `total_seqs` is then the mini-batch's sum
    of weights (its number of episodes), which is all seq_mean_token_sum_norm needs (an episode's token sum is
    the sum of its segments')."""
    m = mask.to(values.dtype)
    if agg == "token_mean":
        return (values * m).sum() / max(total_tokens, 1.0)
    if agg == "seq_mean_token_mean":
        per_seq = (values * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        if row_weight is not None:
            return (per_seq * row_weight.to(per_seq)).sum() / max(total_seqs, 1e-12)
        return per_seq.sum() / max(total_seqs, 1)
    if agg == "seq_mean_token_sum_norm":  # Dr.GRPO: constant normaliser, no length bias
        return (values * m).sum() / (max(total_seqs, 1e-12 if row_weight is not None else 1) * norm_len)
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
    total_seqs: float | None = None,
    norm_len: int = 1,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    behav_logp: torch.Tensor | None = None,
    is_cap: float = 2.0,
    row_weight: torch.Tensor | None = None,
) -> LossOut:
    """PPO-clip surrogate: -min(ratio * A, clip(ratio, 1-lo, 1+hi) * A), plus kl_coef * k3 KL, masked.

    Shapes: [B, T] for logp/old_logp/mask/behav_logp; advantages [B] or [B, T].

    With `behav_logp` (asynchronous RL: the log-probs the rollout recorded when it sampled each token, under
    the sampling distribution, possibly from an older policy version) this is the decoupled PPO objective
    (Hilton et al. 2021; AReaL) with a truncated importance weight, per policy token t:

        rho_t = pi_theta(a_t) / pi_prox(a_t)                      (old_logp = pi_prox: the policy at the
                                                                   start of this update)
        w_t   = min(pi_prox(a_t) / mu(a_t), is_cap)               (mu = behav_logp; no gradient through w)
        pg_t  = -w_t * min(rho_t * A_t, clip(rho_t, 1-lo, 1+hi) * A_t)

    The trust region is around pi_prox (so clipping does not depend on how stale a token is) and w_t
    corrects for the tokens having been drawn from mu rather than pi_prox. On-policy (mu = pi_prox) w_t = 1
    and this is the plain PPO-clip loss. `row_weight`: see `aggregate`."""
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
    is_weight_mean = 1.0
    if behav_logp is not None:
        # masked-out positions may hold -inf/0 pairs: zero them before exp so no nan reaches the sum
        d = torch.where(mask.bool(), (old_logp - behav_logp).detach(), torch.zeros_like(old_logp))
        w = torch.clamp(torch.exp(d), max=is_cap)
        pg = w * pg
        with torch.no_grad():
            is_weight_mean = float((w * m).sum() / m.sum().clamp(min=1.0))
    loss = aggregate(pg, m, agg, total_tokens, total_seqs, norm_len, row_weight)
    kl_val = 0.0
    if ref_logp is not None and kl_coef > 0:
        kl = k3_kl(logp, ref_logp)
        kl_term = aggregate(kl, m, agg, total_tokens, total_seqs, norm_len, row_weight)
        loss = loss + kl_coef * kl_term
        kl_val = float(kl_term.detach())
    with torch.no_grad():
        n = m.sum().clamp(min=1.0)
        clip_frac = float(((clipped < unclipped).to(m.dtype) * m).sum() / n)  # clipped term active
        ratio_mean = float((ratio * m).sum() / n)
    return LossOut(loss=loss, pg_loss=float(aggregate(pg.detach(), m, agg, total_tokens, total_seqs, norm_len,
                                                        row_weight)),
                   kl=kl_val, clip_frac=clip_frac, ratio_mean=ratio_mean, is_weight_mean=is_weight_mean)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   top_p: float = 1.0) -> torch.Tensor:
    """log p(target) per position under the sampling distribution: logits [B, T, V], targets [B, T] -> [B, T]."""
    keep = None
    if top_p < 1.0:
        keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        keep = keep.scatter(-1, targets.unsqueeze(-1), True)
    lp = torch.log_softmax(sampling_logits(logits, temperature, top_p, keep), dim=-1)
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def model_body(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """A causal LM's body (the transformer whose `last_hidden_state` the head reads) and its output head, through a
    peft wrapper; None for a model without that split."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model: its adapted model
    body = getattr(inner, getattr(inner, "base_model_prefix", "model"), None)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if body is None or head is None or body is inner:
        return None
    return body, head


def masked_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    targets: torch.Tensor, mask: torch.Tensor, with_entropy: bool = False,
                    temperature: float = 1.0, top_p: float = 1.0, hidden_out: list[torch.Tensor] | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) [B, T] computed only where `mask` is set (0 elsewhere), plus per-token entropy there,
    under the sampling distribution of `sampling_logits(temperature, top_p)` (1.0/1.0: the model's own).

    The vocabulary projection runs on the masked (policy) positions only: with short actions inside
    long prompts/observations this is most of the compute saved. `hidden_out`: the body's last hidden state
    [B, T, H] is appended to it (a PPO value head reads the same forward), when the model has a body."""
    split = model_body(model)
    sel = mask.bool()
    if split is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        lp = token_logprobs(logits, targets, temperature, top_p) * mask
        ent = entropy_from_logits(sampling_logits(logits, temperature, top_p)) * mask if with_entropy else None
        return lp, ent
    body, head = split
    hidden = body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    if hidden_out is not None:
        hidden_out.append(hidden)
    tgt = targets[sel]
    lp_sel, ent_sel = head_logprobs(head, hidden[sel], tgt, temperature, top_p, with_entropy)
    lp = torch.zeros(mask.shape, dtype=lp_sel.dtype, device=lp_sel.device)
    lp[sel] = lp_sel
    ent = None
    if ent_sel is not None:
        ent = torch.zeros(mask.shape, dtype=ent_sel.dtype, device=ent_sel.device)
        ent[sel] = ent_sel
    return lp, ent


#: the per-token log-prob / entropy pass works on at most this many [tokens x vocabulary] logits at once (128 MiB
#: per float32 copy, 221 tokens at Qwen3's 151,669 vocabulary; the pass holds about 7 such copies at its peak):
#: its peak memory follows the chunk, not the micro-batch. A small vocabulary (the quickstart's) stays one piece.
LOGPROB_CHUNK_ELEMENTS = 1 << 25


def _chunk_logprobs(head: torch.nn.Module, h: torch.Tensor, tgt: torch.Tensor, temperature: float, top_p: float,
                    with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(tgt) of one chunk of hidden states under `sampling_logits` ([C, H], [C] -> [C] float32) and the
    per-token entropy there (detached; empty unless `with_entropy`)."""
    raw = head(h)  # [C, V]
    keep = None
    if top_p < 1.0:
        keep = torch.zeros(raw.shape, dtype=torch.bool, device=raw.device).scatter(-1, tgt.unsqueeze(-1), True)
    logp_all = torch.log_softmax(sampling_logits(raw, temperature, top_p, keep), dim=-1)
    lp = logp_all.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        ent = _entropy(logp_all) if with_entropy else logp_all.new_zeros((0,))
    return lp, ent


def head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, tgt: torch.Tensor, temperature: float = 1.0,
                  top_p: float = 1.0, with_entropy: bool = False, chunk: int | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(tgt) ([K], differentiable) and entropy ([K], detached, or None) of the output head on
    hidden states [K, H] under `sampling_logits(temperature, top_p)`, `chunk` tokens at a time (default: as many
    as fit `LOGPROB_CHUNK_ELEMENTS` logits).

    Memory: the [K, vocabulary] float32 logits, their log-softmax and the entropy's products would each be
    materialised for the whole micro-batch (1.7 GiB per copy at 2,900 tokens and a 151k vocabulary), and autograd
    would keep them for the backward pass. Here each chunk's logits exist only while that chunk is computed; with
    gradients on, a chunk is recomputed in the backward pass (`torch.utils.checkpoint`) instead of being kept,
    so the peak grows with the chunk. The values equal the unchunked computation's (the same per-row ops)."""
    import torch.utils.checkpoint

    K = hidden.shape[0]
    weight = getattr(head, "weight", None)
    if chunk is None:  # a head without a plain weight (some wrapped heads): 1,024 tokens at a time
        chunk = max(1, LOGPROB_CHUNK_ELEMENTS // weight.shape[0]) if isinstance(weight, torch.Tensor) else 1024
    chunk = max(1, chunk)
    lps: list[torch.Tensor] = []
    ents: list[torch.Tensor] = []
    recompute = torch.is_grad_enabled() and chunk < K
    for a in range(0, K, chunk):
        h, t = hidden[a:a + chunk], tgt[a:a + chunk]
        if recompute:
            lp, ent = torch.utils.checkpoint.checkpoint(_chunk_logprobs, head, h, t, temperature, top_p,
                                                        with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(head, h, t, temperature, top_p, with_entropy)
        lps.append(lp)
        ents.append(ent.detach())
    if not lps:
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """-sum p log p over the last dim; tokens outside a top-p nucleus (logp -inf) contribute 0."""
    return -(logp.exp() * logp.masked_fill(torch.isinf(logp), 0.0)).sum(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    return _entropy(torch.log_softmax(logits.float(), dim=-1))


def token_returns(trajs: Sequence[Trajectory], T: int, per_turn: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-target-position returns [N, T] (target t = token t+1) and episode returns [N]."""
    N = len(trajs)
    ret = torch.zeros((N, T))
    ep = torch.zeros(N)
    for i, tr in enumerate(trajs):
        turn_r = [t.reward for t in tr.turns] if per_turn else []
        total = tr.reward + sum(turn_r)
        ep[i] = total
        ret[i, :] = total
        if per_turn and any(turn_r):
            togo = tr.reward
            for k in range(len(tr.turns) - 1, -1, -1):
                togo += turn_r[k]
                span = tr.turns[k].action_span
                if span is not None:
                    s, e = span
                    ret[i, max(s - 1, 0):max(e - 1, 0)] = togo
    return ret, ep


def check_groups(task_ids: Sequence[str], group_size: int) -> None:
    """Fail loudly unless rows i*G..(i+1)*G-1 share one task (the advantage groups of `token_advantages`)."""
    bad = [g // group_size for g in range(0, len(task_ids), group_size) if len(set(task_ids[g:g + group_size])) != 1]
    if len(task_ids) % group_size or bad:
        raise RuntimeError(f"GRPO group layout broken: {len(task_ids)} rows, group size {group_size}, groups {bad[:4]} "
                           f"mix tasks ({[list(task_ids[g * group_size:(g + 1) * group_size]) for g in bad[:2]]}): "
                           "advantages would compare samples of different prompts")


def row_advantages(episode_returns: torch.Tensor, episode_of_row: Sequence[int], T: int, group_size: int,
                   std_normalize: bool, eps: float = 1e-6) -> torch.Tensor:
    """[N, T] advantages when rows are segments of episodes (an agent's sessions, `rlf_train.rollout.agent_source`):
    row i gets its episode's group advantage (`token_advantages` over the episodes, groups of `group_size` episodes)."""
    ep_adv = token_advantages(episode_returns.unsqueeze(1), episode_returns, group_size, std_normalize, eps)
    return ep_adv[torch.tensor(list(episode_of_row), dtype=torch.long)].expand(len(episode_of_row), T).clone()


def segment_weights(episode_of_row: Sequence[int], tokens: Sequence[int] | None = None) -> torch.Tensor:
    """[N] each row's share of its episode (the shares of an episode's rows sum to 1): its policy tokens over the
    episode's (`tokens`, rows with none weigh 0), or 1/k for each of k rows without `tokens`."""
    rows: dict[int, int] = {}
    total: dict[int, int] = {}
    for i, e in enumerate(episode_of_row):
        rows[e] = rows.get(e, 0) + 1
        total[e] = total.get(e, 0) + (tokens[i] if tokens is not None else 0)
    return torch.tensor([tokens[i] / total[e] if tokens is not None and total[e] > 0 else 1.0 / rows[e]
                         for i, e in enumerate(episode_of_row)], dtype=torch.float32)


def behaviour_logprobs(trajs: Sequence[Trajectory], T: int) -> torch.Tensor:
    """[N, T] log-probs the rollout recorded when it sampled each policy token (target t = token t+1),
    from `Turn.behaviour_logprobs`; 0 at non-policy positions."""
    out = torch.zeros((len(trajs), T))
    for i, tr in enumerate(trajs):
        mask = tr.loss_mask or []
        for k, turn in enumerate(tr.turns):
            if turn.action_span is None:
                continue
            s, e = turn.action_span
            lps = turn.behaviour_logprobs
            if lps is None or len(lps) < e - s:
                raise RuntimeError(f"episode {i} turn {k}: {0 if lps is None else len(lps)} behaviour "
                                   f"log-probs recorded for {e - s} action tokens (the async rollout records "
                                   "one per sampled token)")
            if s >= 1:
                out[i, s - 1:e - 1] = torch.tensor(lps[:e - s])
        covered = torch.zeros(T, dtype=torch.bool)
        for turn in tr.turns:
            if turn.action_span is not None and turn.action_span[0] >= 1:
                covered[turn.action_span[0] - 1:turn.action_span[1] - 1] = True
        if any(m and not covered[t - 1] for t, m in enumerate(mask) if t >= 1 and t - 1 < T):
            raise RuntimeError(f"episode {i}: a policy token lies outside every turn's action span")
    return out
