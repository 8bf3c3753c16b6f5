"""Rollout throughput of the local backend: the tiny policy on `rlf/Search-v0` (in-process BM25 index).

    python benchmarks/rollout.py [--config configs/quickstart.yaml] [--episodes 512] [--json out.json]

Reports rollout tokens/s and trajectories/s, and the share of rollout wall time spent outside
generation (env steps, tool calls, masking, bookkeeping); the baseline, measured in the same run on
the same thread, is generation alone on the same contexts (no env). Target: share <= 10%.

Two workloads, one run each, same policy and batch size:
  grpo      what the trainer rolls out: batch/G prompts x G samples (G = the config's samples_per_prompt)
  distinct  every episode on a different prompt (no prompt, query or observation repeats in a batch)
The first batch of each workload warms up (index, caches, first forward) and is not counted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.10


def measure(envs: Any, model: Any, tok: Any, params: Any, batch: int, episodes: int, group: int,
            first_task: int, seed: int) -> dict[str, Any]:
    from rlf_envs import runtime
    from rlf_train.rollout.env_factory import env_tasks
    from rlf_train.rollout.local import StopChecker, generate_batched, rollout

    n_tasks = len(env_tasks(envs.envs[0]))
    gen = torch.Generator().manual_seed(seed)
    per_batch = batch // group

    def tasks_of(b: int) -> list[int]:
        return [(first_task + b * per_batch + i // group) % n_tasks for i in range(per_batch * group)]

    rollout(envs, tasks_of(0), model, tok, params, batch_size=batch, gen=gen)  # warm-up, not counted
    tot = {"episodes": 0, "gen_tokens": 0, "all_tokens": 0, "wall": 0.0, "gen": 0.0, "env": 0.0, "turns": 0}
    contexts_per_turn: list[list[list[int]]] = []
    for b in range(1, 1 + max(1, episodes // (per_batch * group))):
        trajs, st = rollout(envs, tasks_of(b), model, tok, params, batch_size=batch, gen=gen)
        tot["episodes"] += len(trajs)
        tot["gen_tokens"] += st.gen_tokens
        tot["all_tokens"] += sum(len(t.token_ids or []) for t in trajs)
        tot["wall"] += st.total_seconds
        tot["gen"] += st.gen_seconds
        tot["env"] += st.env_seconds
        tot["turns"] += st.turns
        # the contexts of every turn, to time generation alone on the same work
        for k in range(max(len(t.turns) for t in trajs)):
            contexts_per_turn.append([(t.token_ids or [])[: t.turns[k].action_span[0]] for t in trajs
                                      if k < len(t.turns) and t.turns[k].action_span is not None])

    # baseline: generation only (same contexts, same length buckets), on rlf's loop thread like the rollout
    stop = StopChecker(tok, list(envs.envs[0].format.stop_strings), tok.eos_token_id)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    async def generate_only() -> tuple[float, int]:
        t0, n = time.perf_counter(), 0
        for ctx in contexts_per_turn:
            n += sum(len(out) for out in generate_batched(model, ctx, params, stop, pad, gen, batch))
        return time.perf_counter() - t0, n

    base_wall, base_tokens = runtime.run(generate_only())
    wall = tot["wall"]
    return {
        "group_size": group, "episodes": tot["episodes"], "batch": batch,
        "rollout_wall_s": wall, "generate_s": tot["gen"], "env_s": tot["env"],
        "generated_tokens_per_s": tot["gen_tokens"] / wall,
        "trajectory_tokens_per_s": tot["all_tokens"] / wall,
        "trajectories_per_s": tot["episodes"] / wall,
        "turns_per_episode": tot["turns"] / max(tot["episodes"], 1),
        "outside_generation_share": 1.0 - tot["gen"] / wall, "env_share": tot["env"] / wall,
        "baseline_generate_only_s": base_wall, "baseline_generated_tokens": base_tokens,
        "rollout_over_generate_only": wall / base_wall if base_wall > 0 else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    from rlf_train.config import load_config
    from rlf_train.policy.checkpoint import latest_checkpoint
    from rlf_train.policy.load import load_policy
    from rlf_train.policy.tokenizer import load_tokenizer
    from rlf_train.rollout.batch import SamplingParams
    from rlf_train.rollout.env_factory import make_envs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    p.add_argument("--checkpoint", type=Path, help="policy weights (default: the config's run, else random init)")
    p.add_argument("--episodes", type=int, default=512, help="measured episodes per workload")
    p.add_argument("--batch", type=int, default=64, help="episodes rolled out together")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--distinct-from", type=int, default=4000, help="first task of the distinct workload")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    cfg = load_config(args.config, args.overrides)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tok = load_tokenizer(cfg.model)
    ckpt = args.checkpoint or latest_checkpoint(cfg.resolved_run_dir())
    if ckpt is None:
        print(f"note: no checkpoint under {cfg.resolved_run_dir()}: a random policy (run the quickstart first "
              "for the trained policy's short, tool-using turns)")
    model = load_policy(cfg.model, tok, cfg.seed, weights_dir=ckpt)
    envs = make_envs(cfg, tok, "train", args.batch)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=cfg.rollout.max_new_tokens_per_turn)
    G = max(1, min(cfg.rollout.samples_per_prompt, args.batch))
    runs = {
        "grpo": measure(envs, model, tok, params, args.batch, args.episodes, G, first_task=0, seed=0),
        "distinct": measure(envs, model, tok, params, args.batch, args.episodes, 1,
                            first_task=args.distinct_from, seed=1),
    }
    res = {"config": str(args.config), "checkpoint": str(ckpt) if ckpt else None, "env": cfg.env.id,
           "threads": torch.get_num_threads(), "target_outside_share_max": TARGET, "workloads": runs}
    keys = ("group_size", "episodes", "trajectories_per_s", "generated_tokens_per_s", "trajectory_tokens_per_s",
            "turns_per_episode", "generate_s", "env_s", "rollout_wall_s", "baseline_generate_only_s",
            "rollout_over_generate_only", "outside_generation_share")
    print(f"{'metric':34s} " + " ".join(f"{name:>10s}" for name in runs))
    for k in keys:
        vals = [r[k] for r in runs.values()]
        print(f"{k:34s} " + " ".join(f"{v:10.3f}" if isinstance(v, float) else f"{v:10d}" for v in vals))
    for name, r in runs.items():
        share = r["outside_generation_share"]
        verdict = "OK" if share <= TARGET else "ABOVE TARGET"
        print(f"{name}: share of rollout time outside generation {share:.1%} (target <= {TARGET:.0%}: {verdict})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
