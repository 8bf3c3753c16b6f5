"""The one token sampler of every local engine path (sync rollout, async workers, the agent endpoint's engine,
eval): an exact draw from `grpo.sampling_logits` (temperature, top-p), on the logits' own device, with no host
copy per step and no per-vocabulary-entry random numbers.

**How.** A two-stage inverse-CDF draw. The vocabulary is cut into blocks of `BLOCK` tokens; a block is drawn by
its probability mass (a cumulative sum over ~300 block masses), then a token inside it by its probability within
the block (a cumulative sum over `BLOCK` values). P(token) = P(block) x P(token | block) is the token's
probability, so the draw is exact; the sums are short, so they are exact enough in float64 (each block's mass is
a float32 sum of `BLOCK` values). A token of probability 0 (outside the top-p nucleus, or a masked logit) is never
drawn: its cumulative-sum interval is empty and the target is kept strictly below the total. The whole draw costs
a few passes over the logits (the exponentials and the block sums) instead of `torch.multinomial`'s host copy and
full cumulative sum.

**Precision.** Probabilities are exp(logit - max) in float32 (bf16 logits are promoted first, by
`sampling_logits`); each block's mass is a float32 sum of at most `BLOCK` values (relative error ~1e-7), and both
cumulative sums run in float64 over at most ~300 blocks and `BLOCK` tokens, against a 53-bit uniform. A token's
drawn probability is therefore its float32 softmax probability to about 1e-7 relative; the only tokens never
drawn although not masked are those whose probability underflows float32 (below ~1e-38 of the most likely one).
The log-prob returned is logit - max - log(total mass), equal to `log_softmax` to float32 rounding.

**Random numbers.** Two uniforms per row and step come from a counter-based hash of (row seed, step, k),
computed with torch integer ops on the logits' device (`uniforms`): a row's draws depend on its own seed and its
step only, never on which rows share its batch, how the batch is split, or the order requests arrived in. Row
seeds come from the run's seed (`row_seeds`: a base drawn from the caller's `torch.Generator`, or one seed per
agent-endpoint request, see `rlf_train.endpoint`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlf_train.grpo import sampling_logits
from rlf_train.seeds import mix_seed

#: tokens per block of the two-stage draw (about sqrt of a 151k vocabulary: both stages' sums stay short)
BLOCK = 512
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) held in int64, without ever overflowing int64 (c split in 16-bit
    halves), so the result is the same on every device."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser (a bijection on [0, 2**32) with full avalanche)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _hash(seeds: torch.Tensor, counter: int) -> torch.Tensor:
    """A 32-bit hash of (64-bit row seed, counter) per row: seeds int64 [B] -> int64 [B] in [0, 2**32)."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    h = _fmix32(torch.full_like(seeds, (counter * 0x9E3779B9 + 0x7F4A7C15) & _M32))
    h = _fmix32(h ^ lo)
    h = _fmix32((h + 0x632BE5AB) & _M32 ^ hi)
    return _fmix32((h + (counter & _M32)) & _M32)


def uniforms(seeds: torch.Tensor, step: int, n: int = 2) -> torch.Tensor:
    """[B, n] float64 uniforms in [0, 1) with 53 random bits each, a pure function of (seed, step, k)."""
    cols = []
    for k in range(n):
        a = _hash(seeds, (step * n + k) * 2) >> 5  # 27 bits
        b = _hash(seeds, (step * n + k) * 2 + 1) >> 6  # 26 bits
        cols.append((a * (1 << 26) + b).double() / float(1 << 53))
    return torch.stack(cols, dim=-1)


def row_seeds(n: int, gen: torch.Generator | None = None, seeds: Sequence[int | None] | None = None) -> list[int]:
    """Seeds for n rows: the given `seeds` (one per row, e.g. per endpoint request); a row without one (None, or
    no `seeds` at all) gets `mix_seed(base, k)`, k its index in this call, with one base drawn from `gen` (the
    global torch RNG when None), drawn only when some row needs it."""
    if seeds is not None and len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} rows")
    given = list(seeds) if seeds is not None else [None] * n
    base = int(torch.randint(0, 2**62, (1,), generator=gen)) if any(s is None for s in given) else 0
    return [mix_seed(base, k) if s is None else int(s) & ((1 << 63) - 1) for k, s in enumerate(given)]


def _pick(cum: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Index of the first cumulative sum above target ([B, n] float64, [B] float64), target kept strictly
    below the row's total so an index past the end (or a zero-mass entry at the end) cannot come out."""
    total = cum[:, -1]
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, target.unsqueeze(-1), right=True).squeeze(-1)


def sample_from_logits(logits: torch.Tensor, seeds: torch.Tensor, step: int,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One exact draw per row from softmax(logits) ([B, V], float32; -inf = probability 0) with the row's seed
    at `step`: (token ids [B] int64, their log-probs [B] float32), both on the logits' device."""
    B, V = logits.shape
    m = logits.amax(dim=-1, keepdim=True)
    p = torch.sub(logits, m).exp_()  # unnormalised probabilities, max 1
    full = V // BLOCK
    nb = -(-V // BLOCK)
    mass = p[:, :full * BLOCK].view(B, full, BLOCK).sum(-1)  # [B, nb] block masses (float32 sums of BLOCK)
    if nb > full:  # the last, shorter block
        mass = torch.cat([mass, p[:, full * BLOCK:].sum(-1, keepdim=True)], dim=-1)
    acc = torch.float32 if logits.device.type == "mps" else torch.float64  # (MPS has no float64)
    mass = mass.to(acc)
    u = uniforms(seeds.to(logits.device), step).to(acc)
    cum_b = mass.cumsum(-1)
    b = _pick(cum_b, u[:, 0] * cum_b[:, -1]).clamp_(max=nb - 1)
    idx = b.unsqueeze(-1) * BLOCK + torch.arange(BLOCK, device=p.device)  # [B, BLOCK] the block's token ids
    inner = p.gather(1, idx.clamp(max=V - 1)).to(acc).masked_fill_(idx >= V, 0.0)
    cum_t = inner.cumsum(-1)
    j = _pick(cum_t, u[:, 1] * cum_t[:, -1]).clamp_(max=BLOCK - 1)
    tok = b * BLOCK + j
    lp = (logits.gather(-1, tok.unsqueeze(-1)).squeeze(-1) - m.squeeze(-1)
          - torch.log(mass.sum(-1)).to(logits.dtype))
    return tok, lp


def sample(logits: torch.Tensor, temperature: float, top_p: float, seeds: torch.Tensor, step: int,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy at temperature 0 (log-probs 0), else an exact draw from `sampling_logits(logits, temperature,
    top_p)`, the distribution the update's log-probs are computed under: (tokens [B], log-probs [B] float32) on
    the logits' device. `seeds` int64 [B] (on any device), one per row; `step`: the row's decode step."""
    if temperature == 0.0:
        tok = logits.argmax(dim=-1)
        return tok, torch.zeros(tok.shape, dtype=torch.float32, device=logits.device)
    return sample_from_logits(sampling_logits(logits, temperature, top_p), seeds, step)
