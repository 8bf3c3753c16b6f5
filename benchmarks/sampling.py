"""Sampled vs greedy generation at a real vocabulary, and rlf's sampler vs the one it replaced (issue 37).

A tiny random-init Qwen3-shaped policy (2 layers, hidden 64, by default) with Qwen3's vocabulary size (151,669
tokens), so the per-step cost is the vocabulary's: the output head and the token choice. rlf's own
`rollout.generate` (KV cache, left padding) runs `--batch` rows for `--new-tokens` tokens each (no stop token: every
row runs to the end), in four modes, alternated `--repeats` times so that load on a shared machine hits all alike:

- greedy (temperature 0: argmax; the baseline every ratio is against);
- sampled (temperature 1, top-p 1) with `rlf_train.rollout.sampling` (two-stage inverse CDF on the logits' device);
- sampled top-p 0.9 (the random-init policy's logits are flat, so its nucleus is long and `grpo.nucleus` sorts
  the whole vocabulary, as before; a trained model's nucleus is short: see the sampler-alone line);
- sampled with the sampler before issue 37 (`torch.multinomial` on a host copy of the probabilities and a full
  log-softmax per step), the old/new ratio.

Also the sampler alone on one [batch, vocabulary] step of logits (no model), at top-p 1 and at top-p 0.9 on peaked
logits (a nucleus of 1-76 tokens, as a trained model's). Goal (issue 37): sampled generation
costs at most 1.5x greedy generation in the same run.

    python benchmarks/sampling.py --json out/sampling.json              # CPU
    python benchmarks/sampling.py --device cuda --dtype bfloat16        # one GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

QWEN3_VOCAB = 151_669  # len(Qwen3's tokenizer): 151,643 BPE tokens + 26 special


def old_sample(logits: torch.Tensor, temperature: float, top_p: float, seeds: torch.Tensor, step: int,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler before issue 37 (rollout._sample at 8039ab9): a host copy, torch.multinomial, a full log-softmax."""
    from rlf_train.rollout.sampling import sampling_logits

    if temperature == 0.0:
        tok = logits.argmax(dim=-1)
        return tok, torch.zeros(tok.shape)
    sl = sampling_logits(logits, temperature, top_p)
    probs = torch.softmax(sl, dim=-1)
    tok = torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)
    lp = torch.log_softmax(sl, dim=-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1).cpu()
    return tok, lp


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, list[list[int]]]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    qc = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                     num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=args.hidden // 4, max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(qc).to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
    g = torch.Generator().manual_seed(1)
    ctx = [torch.randint(1, args.vocab, (args.context,), generator=g).tolist() for _ in range(args.batch)]
    return model, ctx


def run_mode(mode: str, model: torch.nn.Module, ctx: list[list[int]], args: argparse.Namespace) -> float:
    import rlf_train.rollout.local as rollout
    from rlf_train.rollout.batch import SamplingParams
    from rlf_train.rollout.local import StopChecker, generate

    class NoStop(StopChecker):
        def __init__(self) -> None:
            self.stop_ids = torch.zeros(0, dtype=torch.long)
            self.text_check = False

    temp, top_p = {"greedy": (0.0, 1.0), "sampled": (1.0, 1.0), "sampled_top_p0.9": (1.0, 0.9),
                   "old_sampled": (1.0, 1.0)}[mode]
    params = SamplingParams(temperature=temp, top_p=top_p, max_new_tokens=args.new_tokens)
    gen = torch.Generator().manual_seed(2)
    new = rollout.sample
    if mode == "old_sampled":
        rollout.sample = lambda lg, t, p, s, k: old_sample(lg, t, p, s, k, gen)  # type: ignore[assignment]
    try:
        sync(torch.device(args.device))
        t0 = time.perf_counter()
        out = generate(model, ctx, params, NoStop(), 0, gen, [[] for _ in ctx])
        sync(torch.device(args.device))
        dt = time.perf_counter() - t0
    finally:
        rollout.sample = new
    assert all(len(o) == args.new_tokens for o in out)
    return dt


def sampler_alone(args: argparse.Namespace) -> dict[str, float]:
    """Milliseconds per [batch, vocab] step of logits: argmax, rlf's sampler, the old one (median of 5)."""
    from rlf_train.rollout.sampling import row_seeds, sample

    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(3)
    lg = (torch.randn(args.batch, args.vocab, generator=g) * 3).to(device=dev, dtype=getattr(torch, args.dtype))
    seeds = torch.tensor(row_seeds(args.batch, g), device=dev)
    # a trained model's next-token distribution is peaked: logits x 6 put the 0.9 nucleus at 1-76 tokens
    peaked = (torch.randn(args.batch, args.vocab, generator=g) * 6).to(device=dev, dtype=getattr(torch, args.dtype))
    fns = {"argmax": lambda: lg.argmax(-1), "rlf": lambda: sample(lg, 1.0, 1.0, seeds, 0),
           "old": lambda: old_sample(lg, 1.0, 1.0, seeds, 0, g),
           "rlf_top_p_peaked": lambda: sample(peaked, 1.0, 0.9, seeds, 0),
           "old_top_p_peaked": lambda: old_sample(peaked, 1.0, 0.9, seeds, 0, g)}
    out = {}
    for name, f in fns.items():
        f()
        ts = []
        for _ in range(5):
            sync(dev)
            t0 = time.perf_counter()
            f()
            sync(dev)
            ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts) * 1000
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--vocab", type=int, default=QWEN3_VOCAB)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, ctx = build(args)
    modes = ["greedy", "sampled", "sampled_top_p0.9", "old_sampled"]
    with torch.no_grad():
        run_mode("greedy", model, ctx[:4], argparse.Namespace(**{**vars(args), "new_tokens": 2}))  # warm-up
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.repeats):
            for m in modes:
                times[m].append(run_mode(m, model, ctx, args))
        alone = sampler_alone(args)
    med = {m: statistics.median(v) for m, v in times.items()}
    toks = args.batch * args.new_tokens
    print(f"device {args.device} {args.dtype}, vocab {args.vocab}, batch {args.batch} x {args.new_tokens} new tokens, "
          f"hidden {args.hidden} x {args.layers} layers, torch threads {torch.get_num_threads()}, "
          f"{args.repeats} alternated repeats (median)")
    print(f"{'mode':<18}{'s':>8}{'tokens/s':>10}{'x greedy':>10}")
    for m in modes:
        print(f"{m:<18}{med[m]:>8.2f}{toks / med[m]:>10.0f}{med[m] / med['greedy']:>10.2f}")
    ratio_old = med["old_sampled"] / med["sampled"]
    print(f"old sampler / rlf sampler (generation): {ratio_old:.2f}x")
    print(f"one [{args.batch}, {args.vocab}] step alone, ms: argmax {alone['argmax']:.1f}, rlf {alone['rlf']:.1f}, "
          f"old {alone['old']:.1f} (old/rlf {alone['old'] / alone['rlf']:.2f}x); top-p 0.9 on peaked logits: rlf "
          f"{alone['rlf_top_p_peaked']:.1f}, old {alone['old_top_p_peaked']:.1f} "
          f"(old/rlf {alone['old_top_p_peaked'] / alone['rlf_top_p_peaked']:.2f}x)")
    goal = med["sampled"] / med["greedy"] <= 1.5
    print(f"goal sampled <= 1.5x greedy: {'met' if goal else 'missed'} ({med['sampled'] / med['greedy']:.2f}x)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        res: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                               "seconds": times, "median_s": med, "tokens": toks,
                               "x_greedy": {m: med[m] / med["greedy"] for m in modes},
                               "old_over_new": ratio_old, "sampler_alone_ms": alone}
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
