"""Rollout throughput of the local backend: the tiny policy on `rlf/Search-v0` (in-process BM25 index).

    python benchmarks/rollout.py [--config configs/quickstart.yaml] [--episodes 256] [--json out.json]

Reports rollout tokens/s and trajectories/s, and the share of rollout wall time spent outside
generation (env steps, tool calls, masking, bookkeeping), against a baseline measured in the same
run: generation alone on the same contexts (no env). Target: env-side share <= 10%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    from rlf_train.checkpoint import latest_checkpoint
    from rlf_train.config import load_config
    from rlf_train.model import load_policy, load_tokenizer
    from rlf_train.rollout import SamplingParams, StopChecker, generate, run_episodes
    from rlf_train.trainer import env_tasks, make_envs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    p.add_argument("--checkpoint", type=Path, help="policy weights (default: the config's run, else random init)")
    p.add_argument("--episodes", type=int, default=256)
    p.add_argument("--batch", type=int, default=64, help="episodes rolled out together")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    cfg = load_config(args.config, args.overrides)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tok = load_tokenizer(cfg.model)
    ckpt = args.checkpoint or latest_checkpoint(cfg.resolved_run_dir())
    model = load_policy(cfg.model, tok, cfg.seed, weights_dir=ckpt)
    envs = make_envs(cfg, tok, cfg.env.train_split, args.batch)
    n_tasks = len(env_tasks(envs[0]))
    params = SamplingParams(temperature=args.temperature, max_new_tokens=cfg.rollout.max_new_tokens_per_turn)
    loop = asyncio.new_event_loop()
    gen = torch.Generator().manual_seed(0)

    # warm-up (index load, first forward)
    loop.run_until_complete(run_episodes(envs[:4], [0, 1, 2, 3], model, tok, params, gen=gen))

    tot = {"episodes": 0, "gen_tokens": 0, "all_tokens": 0, "wall": 0.0, "gen": 0.0, "env": 0.0, "turns": 0}
    contexts_per_turn: list[list[list[int]]] = []
    t_all = time.perf_counter()
    for s in range(0, args.episodes, args.batch):
        idx = [(s + i) % n_tasks for i in range(min(args.batch, args.episodes - s))]
        trajs, st = loop.run_until_complete(run_episodes(envs[:len(idx)], idx, model, tok, params,
                                                         batch_size=args.batch, gen=gen))
        tot["episodes"] += len(trajs)
        tot["gen_tokens"] += st.gen_tokens
        tot["all_tokens"] += sum(len(t.token_ids or []) for t in trajs)
        tot["wall"] += st.total_seconds
        tot["gen"] += st.gen_seconds
        tot["env"] += st.env_seconds
        tot["turns"] += st.turns
        # the contexts of every turn, to time generation alone on the same work
        for k in range(max(len(t.turns) for t in trajs)):
            ctx = []
            for t in trajs:
                if k < len(t.turns) and t.turns[k].action_span is not None:
                    ctx.append((t.token_ids or [])[: t.turns[k].action_span[0]])
            contexts_per_turn.append(ctx)
    wall_total = time.perf_counter() - t_all

    # baseline: generation only (same contexts, same batches), no env in the loop
    stop = StopChecker(tok, list(envs[0].format.stop_strings), tok.eos_token_id)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    t0 = time.perf_counter()
    base_tokens = 0
    for ctx in contexts_per_turn:
        for out in generate(model, ctx, params, stop, pad, gen):
            base_tokens += len(out)
    base_wall = time.perf_counter() - t0

    outside = 1.0 - tot["gen"] / tot["wall"] if tot["wall"] > 0 else 0.0
    res = {
        "config": str(args.config), "checkpoint": str(ckpt) if ckpt else None, "env": cfg.env.id,
        "episodes": tot["episodes"], "batch": args.batch, "threads": torch.get_num_threads(),
        "rollout_wall_s": tot["wall"], "generate_s": tot["gen"], "env_s": tot["env"],
        "generated_tokens_per_s": tot["gen_tokens"] / tot["wall"],
        "trajectory_tokens_per_s": tot["all_tokens"] / tot["wall"],
        "trajectories_per_s": tot["episodes"] / tot["wall"],
        "turns_per_episode": tot["turns"] / max(tot["episodes"], 1),
        "outside_generation_share": outside, "env_share": tot["env"] / tot["wall"] if tot["wall"] else 0.0,
        "baseline_generate_only_s": base_wall, "baseline_generated_tokens": base_tokens,
        "rollout_over_generate_only": tot["wall"] / base_wall if base_wall > 0 else float("nan"),
        "target_outside_share_max": 0.10, "wall_total_s": wall_total,
    }
    print(f"{'metric':38s} value")
    for k in ("episodes", "trajectories_per_s", "generated_tokens_per_s", "trajectory_tokens_per_s",
              "turns_per_episode", "generate_s", "env_s", "rollout_wall_s", "baseline_generate_only_s",
              "rollout_over_generate_only", "outside_generation_share", "env_share"):
        v = res[k]
        print(f"{k:38s} {v:.3f}" if isinstance(v, float) else f"{k:38s} {v}")
    verdict = "OK" if outside <= 0.10 else "ABOVE TARGET"
    print(f"share of rollout time outside generation: {outside:.1%} (target <= 10%: {verdict})")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
