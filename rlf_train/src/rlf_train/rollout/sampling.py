"""The one token sampler of every local engine path (sync rollout, async workers, the agent endpoint's engine,
eval): an exact draw from `sampling_logits` (temperature, top-p), on the logits' own device, with no host copy per
step. Each row's draws depend on its own seed and step only (`uniforms`, `row_seeds`), never on its batch mates, so
runs are reproducible whatever the batching. How the two-stage draw works and how precise it is:
docs/guides/trainer-internals.md."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlf_train.rollout.seeds import mix_seed

#: tokens per block of the two-stage draw (about sqrt of a 151k vocabulary: both stages' sums stay short)
BLOCK = 512
_M32 = 0xFFFFFFFF


def sampling_logits(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0,
                    keep: torch.Tensor | None = None) -> torch.Tensor:
    """The logits of the distribution the rollout samples from: divided by `temperature`, and with every
    token outside the top-p nucleus set to -inf when `top_p` < 1 (the nucleus: the most likely tokens whose
    preceding cumulative probability is below top_p, so it is never empty). Float32.

    `keep` ([..., V] bool, optional) forces tokens into the nucleus: the update passes the sampled token,
    so its log-prob stays finite when a parameter update (or a rounding difference between the rollout's
    cached decode and the update's full forward) moves it just outside. `sample` draws from exactly this
    distribution, and the GRPO update's log-probs/ratios/KL are computed under it (`rlf_train.grpo`)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if top_p < 1.0:
        with torch.no_grad():
            inside = nucleus(torch.softmax(logits, dim=-1), top_p)
            if keep is not None:
                inside = inside | keep
        logits = logits.masked_fill(~inside, float("-inf"))
    return logits


#: top-p looks for the nucleus among this many most likely tokens first (a top-k: far cheaper than sorting a 151k
#: vocabulary on a CPU); only rows whose nucleus is longer are sorted whole
NUCLEUS_CANDIDATES = 1024


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] bool: the most likely tokens whose preceding cumulative probability (in descending order) is below
    `top_p`. Exact: when the last of the `NUCLEUS_CANDIDATES` candidates is outside, every less likely token is
    too; otherwise that row is sorted whole."""
    shape = probs.shape
    probs = probs.reshape(-1, shape[-1])
    V = probs.shape[-1]

    def inside_of(p: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        vals, idx = p.topk(k, dim=-1) if k < V else p.sort(dim=-1, descending=True)
        keep_sorted = vals.cumsum(-1) - vals < top_p
        return torch.zeros_like(p, dtype=torch.bool).scatter(-1, idx, keep_sorted), keep_sorted[:, -1]

    inside, open_end = inside_of(probs, min(V, NUCLEUS_CANDIDATES))
    if V > NUCLEUS_CANDIDATES and bool(open_end.any()):
        rows = open_end.nonzero().flatten()
        inside[rows] = inside_of(probs[rows], V)[0]
    return inside.reshape(shape)


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
