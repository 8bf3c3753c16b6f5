"""`python -m rlf_train.eval --config X.yaml [--checkpoint DIR] [--json OUT]`: held-out EM / reward /
tool stats (greedy and sampled) on the eval split, as JSON. Sampled episodes go to the run dir's
`trajectories/step_K.jsonl` (K: the checkpoint's RL step) as sources `offline_eval_greedy` / `_sampled`,
for `python -m rlf_envs.view`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from rlf_train.config import ConfigError, TrainConfig, load_config
from rlf_train.model import load_policy, load_tokenizer
from rlf_train.rollout import SamplingParams, rollout


def evaluate_policy(cfg: TrainConfig, checkpoint: Path | None, records_dir: Path | None = None,
                    num_records: int = 8) -> dict[str, Any]:
    """Held-out stats per mode; with `records_dir`, also store `num_records` episodes per mode there."""
    from rlf_envs.records import write_trajectories
    from rlf_train.envs import env_tasks, make_envs
    from rlf_train.trainer import episode_stats, is_success

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tok = load_tokenizer(cfg.model)
    model = load_policy(cfg.model, tok, cfg.seed, weights_dir=checkpoint)
    n_env = min(cfg.eval.num_tasks, cfg.rollout.batch_size)
    envs = make_envs(cfg, tok, "eval", n_env)
    n_tasks = min(cfg.eval.num_tasks, len(env_tasks(envs.envs[0])))
    out: dict[str, Any] = {"checkpoint": str(checkpoint) if checkpoint else None, "split": cfg.env.eval_split,
                           "num_tasks": n_tasks}
    modes = ([("greedy", 0.0)] if cfg.eval.greedy else []) + (
        [("sampled", cfg.eval.temperature)] if cfg.eval.sampled else [])
    for mode, temp in modes:
        params = SamplingParams(temperature=temp, max_new_tokens=cfg.rollout.max_new_tokens_per_turn)
        gen = torch.Generator().manual_seed(10_000 + cfg.seed)
        trajs = []
        for s in range(0, n_tasks, n_env):
            idx = list(range(s, min(s + n_env, n_tasks)))
            tr, _ = rollout(envs, idx, model, tok, params, seeds=[s + i for i in range(len(idx))],
                            batch_size=cfg.rollout.batch_size, gen=gen)
            trajs.extend(tr)
        if records_dir is not None:
            write_trajectories(records_dir, _checkpoint_step(checkpoint), trajs, num_records, f"offline_eval_{mode}")
        st = episode_stats(trajs)
        st["em"] = sum(t.score_info.get("em", is_success(t)) for t in trajs) / max(len(trajs), 1)
        out[mode] = st
    return out


def _checkpoint_step(checkpoint: Path | None) -> int:
    """The RL step of a checkpoint (0 for the base model or an SFT checkpoint)."""
    if checkpoint is None:
        return 0
    from rlf_train.checkpoint import META

    path = checkpoint / META
    if not path.is_file():
        return 0
    meta = json.loads(path.read_text())
    return int(meta.get("step", 0)) if meta.get("stage") == "rl" else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlf_train.eval", description=__doc__)
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--checkpoint", type=Path, help="checkpoint dir (default: the run's latest, else the base model)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", type=Path, help="also write the result here")
    p.add_argument("--trajectories", type=int, default=None, metavar="N",
                   help="episodes stored per mode in RUN_DIR/trajectories/step_K.jsonl "
                        "(default: logging.trajectories of the config; 0: none)")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ckpt = args.checkpoint
    if ckpt is None:
        from rlf_train.checkpoint import latest_checkpoint

        ckpt = latest_checkpoint(cfg.resolved_run_dir())
    if ckpt is not None and not (ckpt / "model.safetensors").is_file() and not (ckpt / "config.json").is_file():
        print(f"error: {ckpt} is not a checkpoint dir (no model.safetensors)", file=sys.stderr)
        return 2
    n_rec = cfg.logging.trajectories if args.trajectories is None else args.trajectories
    try:
        res = evaluate_policy(cfg, ckpt, records_dir=cfg.resolved_run_dir(), num_records=n_rec)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(res, indent=2, sort_keys=True)
    if args.json:
        args.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
