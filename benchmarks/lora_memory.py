"""Full fine-tuning vs LoRA (`model.lora`) for one GRPO update on CPU, at a Qwen3-0.6B shape built from config.

Each run is a fresh process (so its peak RSS is its own) that builds the policy (random init, Qwen3-0.6B's shape:
28 layers, hidden 1024, MLP 3072, 16 heads / 8 KV heads of 128, vocab 151,936, tied embeddings; `--layers` to
shorten it on a small box), then the KL reference the trainer would build:

- full: a second, frozen copy of the policy (what `Trainer._reference_model` loads), AdamW over every weight;
- lora: `rlf_train.policy.lora.attach` (peft) on q/k/v/o/gate/up/down, the reference `lora.AdapterOff` (the same
  weights, adapter switched off), AdamW over the adapter only (`lora.trainable`).

Then `--updates` GRPO updates on one synthetic batch (the same token ids, loss mask and advantages in both modes),
each as the trainer's `update` does it: old log-probs and reference log-probs (no grad), the policy's forward and
backward with `grpo.policy_loss` (PPO-clip + k3 KL, kl_coef 0.05), grad-norm clip, AdamW step. Reported per run:
RSS after the policy, after the reference, peak RSS (ru_maxrss), and seconds per update, wall and CPU time of the
process (the median after the first update, which also allocates the optimizer state; on a loaded shared box the
wall time mostly measures waiting for a core, the CPU time much less so). Modes alternate (full, lora, full, lora,
...) `--repeats` times so that load on a shared machine hits both alike; the table gives each run and the
LoRA/full ratios of the medians.

    python benchmarks/lora_memory.py --json out/lora_memory.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

QWEN3_0_6B = {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def one_run(mode: str, layers: int, batch: int, seq: int, policy_tokens: int, updates: int, rank: int,
            threads: int) -> dict[str, Any]:
    import copy

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rlf_train.config import LoraConfig
    from rlf_train.grpo import masked_logprobs, policy_loss
    from rlf_train.policy import lora

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    out: dict[str, Any] = {"mode": mode, "rss_start_mb": rss_mb()}
    shape = dict(QWEN3_0_6B, num_hidden_layers=layers)
    t0 = time.perf_counter()
    policy = Qwen3ForCausalLM(Qwen3Config(**shape, max_position_embeddings=4096))
    out["build_s"] = time.perf_counter() - t0
    out["params"] = sum(p.numel() for p in policy.parameters())
    out["rss_policy_mb"] = rss_mb()
    ref: Any
    if mode == "full":
        ref = copy.deepcopy(policy).eval()  # the trainer loads a second model: the same bytes
        for p in ref.parameters():
            p.requires_grad_(False)
    else:
        policy = lora.attach(policy, LoraConfig(rank=rank, alpha=2 * rank), seed=0)
        ref = lora.AdapterOff(policy)
        assert lora.shares_weights(policy, ref)
    params = lora.trainable(policy)
    out["trainable_params"] = sum(p.numel() for p in params)
    out["rss_ref_mb"] = rss_mb()
    opt = torch.optim.AdamW(params, lr=1e-5)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), generator=g)
    attn = torch.ones_like(ids)
    mask = torch.zeros(batch, seq - 1)
    mask[:, -policy_tokens:] = 1.0  # the policy's tokens: the end of each sequence
    adv = torch.randn(batch, generator=g)
    times, cpu = [], []
    for _ in range(updates):
        t, c = time.perf_counter(), time.process_time()
        with torch.no_grad():
            old = masked_logprobs(policy, ids[:, :-1], attn[:, :-1], ids[:, 1:], mask)[0]
            with lora.reference(ref) as m:
                ref_lp = masked_logprobs(m, ids[:, :-1], attn[:, :-1], ids[:, 1:], mask)[0]
        policy.train()
        opt.zero_grad(set_to_none=True)
        lp = masked_logprobs(policy, ids[:, :-1], attn[:, :-1], ids[:, 1:], mask, with_entropy=True)[0]
        res = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, ref_logp=ref_lp, kl_coef=0.05)
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    out["update_s"] = times
    out["update_cpu_s"] = cpu
    out["s_per_update"] = statistics.median(times[1:]) if len(times) > 1 else times[0]
    # CPU seconds of this process: what a loaded shared box distorts least (wall time waits for the CPU)
    out["cpu_s_per_update"] = statistics.median(cpu[1:]) if len(cpu) > 1 else cpu[0]
    out["rss_end_mb"] = rss_mb()
    out["peak_rss_mb"] = peak_mb()
    return out


def flag_args(kw: dict[str, Any]) -> list[str]:
    return [x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28, help="decoder layers (Qwen3-0.6B: 28)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per update")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--policy-tokens", type=int, default=64, help="policy (loss-mask) tokens per sequence")
    ap.add_argument("--updates", type=int, default=3, help="updates per run (the first is not timed)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", choices=("full", "lora"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    kw = dict(layers=a.layers, batch=a.batch, seq=a.seq, policy_tokens=a.policy_tokens, updates=a.updates,
              rank=a.rank, threads=a.threads)
    if a.child:
        print(json.dumps(one_run(a.child, **kw)))  # type: ignore[arg-type]
        return
    runs = []
    for rep in range(a.repeats):
        for mode in ("full", "lora"):
            argv = [sys.executable, __file__, "--child", mode, *flag_args(kw)]
            p = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
            if p.returncode != 0:
                raise SystemExit(f"{mode} run failed:\n{p.stderr[-3000:]}")
            r = json.loads(p.stdout.strip().splitlines()[-1])
            r["repeat"] = rep
            runs.append(r)
            print(f"{mode:4s} #{rep}: peak RSS {r['peak_rss_mb']:8.0f} MiB  (policy {r['rss_policy_mb']:.0f}, "
                  f"+ref {r['rss_ref_mb']:.0f})  {r['s_per_update']:6.2f} s/update (wall), "
                  f"{r['cpu_s_per_update']:6.2f} CPU s/update  updates {[round(x, 2) for x in r['update_s']]}",
                  flush=True)
            if a.json:  # so far (a long run on a loaded box can be stopped and still leaves its runs)
                a.json.parent.mkdir(parents=True, exist_ok=True)
                a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "runs": runs}, indent=1))

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["mode"] == mode)

    keys = ("peak_rss_mb", "rss_policy_mb", "rss_ref_mb", "s_per_update", "cpu_s_per_update", "trainable_params",
            "params")
    summary = {k: {m: med(m, k) for m in ("full", "lora")} for k in keys}
    ratios = {k: summary[k]["lora"] / summary[k]["full"] for k in ("peak_rss_mb", "s_per_update", "cpu_s_per_update")}
    print(f"\nQwen3-0.6B shape ({a.layers} layers, {summary['params']['full'] / 1e6:.0f}M params), batch "
          f"{a.batch} x {a.seq} tokens ({a.policy_tokens} policy tokens each), fp32, {a.threads} threads, "
          f"medians of {a.repeats} runs per mode")
    print(f"{'':6s} {'trainable':>12s} {'RSS policy':>11s} {'RSS +ref':>9s} {'peak RSS':>9s} {'s/update':>9s} "
          f"{'CPU s/upd':>9s}")
    for m in ("full", "lora"):
        print(f"{m:6s} {summary['trainable_params'][m] / 1e6:11.2f}M {summary['rss_policy_mb'][m]:9.0f}Mi "
              f"{summary['rss_ref_mb'][m]:7.0f}Mi {summary['peak_rss_mb'][m]:7.0f}Mi {summary['s_per_update'][m]:9.2f} "
              f"{summary['cpu_s_per_update'][m]:9.2f}")
    print(f"lora/full: peak RSS {ratios['peak_rss_mb']:.2f}x, s/update {ratios['s_per_update']:.2f}x (wall), "
          f"{ratios['cpu_s_per_update']:.2f}x (CPU time)")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "runs": runs, "summary": summary,
                                      "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
