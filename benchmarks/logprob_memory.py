"""Peak memory of the update's per-token log-prob + entropy pass at Qwen3's vocabulary: chunked vs one piece.

`grpo.masked_logprobs` projects the policy tokens' hidden states onto the vocabulary and takes the log-softmax
(and the entropy) under the sampling distribution. In one piece that materialises several [policy tokens,
151,669] float32 tensors and autograd keeps them for the backward pass; `grpo.head_logprobs` does it
`LOGPROB_CHUNK_ELEMENTS` logits at a time and recomputes each chunk in the backward pass. Each setting runs in a
fresh process (so the peak RSS is its own): a small Qwen3-shaped model with the real vocabulary size, one forward
and backward of `masked_logprobs` (with entropy, temperature 0.7, top-p `--top-p`) over `--tokens`
policy tokens. Reported: the peak RSS above the process's RSS before the pass, and the seconds of the pass; the
ratio chunked / one piece. (RSS on CPU; on a GPU the same pass is what `torch.cuda.max_memory_allocated` sees.)

    python benchmarks/logprob_memory.py --tokens 1024 --json out/logprob_memory.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def rss_gib() -> float:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def child(elements: int, tokens: int, vocab: int, top_p: float) -> dict[str, Any]:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import rlf_train.grpo as grpo

    torch.manual_seed(0)
    qc = Qwen3Config(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(qc).train()
    B = 4
    T = tokens // B + 32
    ids = torch.randint(0, vocab, (B, T))
    attn = torch.ones_like(ids)
    mask = torch.zeros(B, T)
    mask[:, 32:] = 1.0  # a 32-token prompt, then `tokens` policy tokens in all
    grpo.LOGPROB_CHUNK_ELEMENTS = elements
    base = rss_gib()
    t0 = time.perf_counter()
    lp, ent = grpo.masked_logprobs(model, ids, attn, ids.roll(-1, 1), mask, with_entropy=True, temperature=0.7,
                                   top_p=top_p)
    lp.sum().backward()
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"peak_above_start_gib": peak - base, "peak_rss_gib": peak, "seconds": dt,
            "tokens": int(mask.sum()), "lp_sum": float(lp.sum()), "ent_sum": float(ent.sum()) if ent is not None else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024, help="policy tokens in the micro-batch")
    ap.add_argument("--vocab", type=int, default=151_669)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--_child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child is not None:
        print(json.dumps(child(args._child, args.tokens, args.vocab, args.top_p)))
        return
    import rlf_train.grpo as grpo

    settings = {"one piece": 1 << 62, "chunked (default)": grpo.LOGPROB_CHUNK_ELEMENTS,
                "chunked (64 tokens)": 64 * args.vocab}
    res: dict[str, Any] = {}
    for name, elements in settings.items():
        cmd = [sys.executable, __file__, "--_child", str(elements), "--tokens", str(args.tokens),
               "--vocab", str(args.vocab), "--top-p", str(args.top_p)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            sys.exit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        res[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    one = res["one piece"]
    print(f"log-prob + entropy pass, forward and backward: {one['tokens']} policy tokens x vocab {args.vocab}, "
          f"float32, top-p {args.top_p} (CPU peak RSS above the process's start)")
    print(f"{'setting':<22}{'peak GiB':>10}{'x one piece':>13}{'s':>8}{'x one piece':>13}")
    for name, r in res.items():
        mem = r["peak_above_start_gib"]
        print(f"{name:<22}{mem:>10.2f}{mem / one['peak_above_start_gib']:>13.2f}"
              f"{r['seconds']:>8.2f}{r['seconds'] / one['seconds']:>13.2f}")
    same = all(abs(r["lp_sum"] - one["lp_sum"]) <= 1e-3 * abs(one["lp_sum"]) for r in res.values())
    print(f"same log-prob sums: {same}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "runs": res}, indent=1))


if __name__ == "__main__":
    main()
