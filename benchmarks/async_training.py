"""Synchronous vs asynchronous GRPO (`rollout.mode: async`) on the quickstart, in one process.

One SFT warm start (configs/quickstart.yaml's), then from the same weights: `--steps` GRPO updates with
`rollout.mode: sync` and the same with `rollout.mode: async` (`max_staleness`), each in a fast-tool setting
(the in-process search as shipped) and a slow-tool setting (every search waits `--base-ms`, and a
`--slow-share` of them `--slow-factor` times that: a retrieval server with a long tail). Reports, per run:
wall time per update step (eval and checkpoints excluded; the first step, which includes starting the
worker, is reported apart), the learner's idle fraction (sync: the
rollout; async: waiting for a batch), the rollout side's idle fraction (1 - generation time / wall time),
held-out greedy success after the updates, and the async/sync speed ratio of each setting.

    python benchmarks/async_training.py --steps 30 --out /tmp/async_training.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def slow_search(trainer: Any, base_s: float, share: float, factor: float, seed: int) -> None:
    """Wrap the train envs' `search` tool: every call sleeps `base_s` first, a `share` of them `factor` x."""
    rng = random.Random(seed)
    for env in trainer.train_envs.envs:
        tool = env.toolbox.tools["search"]
        if getattr(tool, "_delayed", False):
            continue
        inner = tool.call

        async def call(arguments: dict[str, Any], inner: Any = inner) -> str:
            await asyncio.sleep(base_s * (factor if rng.random() < share else 1.0))
            return await inner(arguments)

        tool.call = call
        tool._delayed = True


def run_rl(sft_dir: Path, root: Path, name: str, overrides: list[str], slow: dict[str, float] | None) -> dict[str, Any]:
    from rlf_train.config import dump_config, load_config
    from rlf_train.trainer import Trainer

    run = root / name
    shutil.copytree(sft_dir / "checkpoints", run / "checkpoints")
    cfg = load_config(sft_dir / "config.yaml", [f"logging.run_dir={run}", "eval.before_rl=false", *overrides])
    (run / "config.yaml").write_text(dump_config(cfg))
    tr = Trainer(cfg, run_dir=run, resume=True)
    if slow is not None:
        slow_search(tr, **slow)
    t0 = time.perf_counter()
    summary = tr.run()
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("stage") == "rl"]
    first_s = rl[0]["time_step"]  # includes the worker's start (a process: imports, envs, model)
    rl = rl[1:] if len(rl) > 1 else rl
    step_s = sum(r["time_step"] for r in rl)
    if cfg.rollout.mode == "async":
        learner_idle = sum(r["time_wait"] for r in rl) / step_s
        rollout_busy = sum(r["rollout_busy"] for r in rl) / step_s
    else:
        learner_idle = sum(r["time_rollout"] for r in rl) / step_s
        rollout_busy = sum(r["time_generate"] for r in rl) / step_s
    last = summary["evals"][-1]
    return {"name": name, "mode": cfg.rollout.mode, "worker": cfg.rollout.async_worker if cfg.rollout.mode == "async"
            else "-", "steps_timed": len(rl), "first_step_s": first_s, "s_per_step": step_s / len(rl),
            "learner_idle": learner_idle, "rollout_idle": max(0.0, 1.0 - rollout_busy),
            "success_greedy": last.get("success_greedy"), "reward_mean_last10": sum(
                r["reward_mean"] for r in rl[-10:]) / len(rl[-10:]),
            "staleness_max": max((r.get("staleness_max", 0) for r in rl), default=0), "wall_s": wall,
            "train_s_per_step": sum(r["time_train"] for r in rl) / len(rl),
            "tokens_per_episode": sum(r["tokens_total_mean"] for r in rl) / len(rl)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs" / "quickstart.yaml"))
    ap.add_argument("--steps", type=int, default=30, help="GRPO updates per run")
    ap.add_argument("--sft-steps", type=int, default=None, help="override sft.steps (default: the config's)")
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--eval-tasks", type=int, default=200)
    ap.add_argument("--base-ms", type=float, default=25.0, help="slow setting: every search's latency")
    ap.add_argument("--slow-share", type=float, default=0.1)
    ap.add_argument("--slow-factor", type=float, default=20.0)
    ap.add_argument("--settings", default="fast,slow")
    ap.add_argument("--workers", default="process", help="async worker kinds to run: process,thread")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    from rlf_train.config import dump_config, load_config
    from rlf_train.trainer import Trainer

    root = Path(tempfile.mkdtemp(prefix="rlf_async_bench_"))
    try:
        sft = root / "sft"
        base = [f"seed={args.seed}", f"logging.run_dir={sft}", "logging.progress=false", "logging.tensorboard=false",
                "algorithm.steps=0", "eval.greedy=true", "eval.sampled=false", f"eval.num_tasks={args.eval_tasks}",
                "eval.every=0", "logging.save_every=0", "logging.trajectories_every=0"]
        if args.sft_steps is not None:
            base.append(f"sft.steps={args.sft_steps}")
        cfg = load_config(args.config, base)
        t0 = time.perf_counter()
        warm = Trainer(cfg).run()
        print(f"SFT warm start: {time.perf_counter() - t0:.0f} s, "
              f"greedy success {warm['evals'][-1]['success_greedy']:.3f}")
        (sft / "config.yaml").write_text(dump_config(cfg))
        slow = {"base_s": args.base_ms / 1000, "share": args.slow_share, "factor": args.slow_factor,
                "seed": args.seed}
        results = []
        for setting in args.settings.split(","):
            for mode in ["sync", *(f"async-{w}" for w in args.workers.split(","))]:
                ov = [f"algorithm.steps={args.steps}", f"rollout.mode={mode.split('-')[0]}",
                      f"rollout.max_staleness={args.max_staleness}"]
                if mode != "sync":
                    ov.append(f"rollout.async_worker={mode.split('-')[1]}")
                res = run_rl(sft, root, f"{setting}-{mode}", ov, slow if setting == "slow" else None)
                res["setting"] = setting
                results.append(res)
                print(json.dumps(res))
        print(f"\n{'setting':8} {'mode':6} {'worker':8} {'s/step':>7} {'update s':>8} {'tok/ep':>6} "
              f"{'learner idle':>12} {'rollout idle':>12} {'held-out greedy':>15} {'max stale':>9}")
        for r in results:
            print(f"{r['setting']:8} {r['mode']:6} {r['worker']:8} {r['s_per_step']:7.2f} {r['train_s_per_step']:8.2f} "
                  f"{r['tokens_per_episode']:6.0f} {r['learner_idle']:12.0%} {r['rollout_idle']:12.0%} "
                  f"{r['success_greedy']:15.3f} {r['staleness_max']:9d}")
        ratios = {}
        for setting in args.settings.split(","):
            s = next(r for r in results if r["setting"] == setting and r["mode"] == "sync")
            for a in (r for r in results if r["setting"] == setting and r["mode"] == "async"):
                key = f"{setting}/{a['worker']}"
                ratios[key] = s["s_per_step"] / a["s_per_step"]
                print(f"{key}: async is {ratios[key]:.2f}x sync per update step (steps 2..N)")
        if args.out:
            Path(args.out).write_text(json.dumps({"args": vars(args), "sft_success": warm["evals"][-1],
                                                  "results": results, "speedup": ratios}, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
