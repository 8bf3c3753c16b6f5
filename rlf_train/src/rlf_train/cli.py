"""`python -m rlf_train --config X.yaml [--set a.b=c ...] [--resume RUN_DIR] [--dry-run]`, and
`python -m rlf_train export --checkpoint RUN_DIR/checkpoints/step_N --out DIR` (merged Hugging Face weights)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlf_train.config import ConfigError, TrainConfig, dump_config, load_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rlf_train",
        description="Train a tool-using LLM policy with RL (GRPO) on an rlf env. "
        "Backends: local (one process, CPU or one GPU) and openrlhf (Ray + vLLM + DeepSpeed on GPUs).",
    )
    p.add_argument("--config", type=Path, help="YAML config (see configs/quickstart.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set algorithm.steps=10 (repeatable; value parsed as YAML)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its latest checkpoint (uses RUN_DIR/config.yaml "
                        "unless --config is given)")
    p.add_argument("--dry-run", action="store_true",
                   help="check everything the real run checks before its work starts (config keys, tokenizer, "
                        "device, env id, env kwargs and splits, SFT demos, run dir), print the resolved config and "
                        "plan, exit; writes nothing (backend openrlhf: writes the run dir and prints the exact "
                        "OpenRLHF command; needs no GPU and no OpenRLHF)")
    return p


def plan(cfg: TrainConfig) -> str:
    r, a = cfg.rollout, cfg.algorithm
    lines = [f"backend: {cfg.backend}", f"run dir: {cfg.resolved_run_dir()}",
             f"policy: {cfg.model.name_or_path} on {cfg.model.device}", f"env: {cfg.env.id} {cfg.env.kwargs}"]
    if cfg.sft.enabled:
        src = cfg.sft.demos_path or (f"{cfg.sft.num_demos} scripted demos (no-search {cfg.sft.p_no_search:.0%}, "
                                     f"wrong query {cfg.sft.p_wrong_query:.0%})")
        lines.append(f"stage 1 SFT: {cfg.sft.steps} steps x {cfg.sft.batch_size} on {src}, lr {cfg.sft.lr}")
    if cfg.model.lora is not None:
        lo = cfg.model.lora
        lines.append(f"LoRA in RL: rank {lo.rank}, alpha {lo.alpha:g}, dropout {lo.dropout:g} on "
                     f"{', '.join(lo.target_modules)}; KL reference: the base (adapter off)")
    lines.append(f"stage 2 {a.name}: {a.steps} steps x {r.prompts_per_step} prompts x G={r.samples_per_prompt} "
                 f"(T={r.temperature}, max {r.max_turns} turns), lr {cfg.optim.lr}, std_norm={a.std_normalize}, "
                 f"agg={a.loss_agg}, kl={a.kl_coef}")
    lines.append(f"eval: {cfg.eval.num_tasks} {cfg.env.eval_split} tasks "
                 f"{'every ' + str(cfg.eval.every) + ' steps' if cfg.eval.every else 'at the end'}")
    return "\n".join(lines)


def preflight(cfg: TrainConfig, resume: bool = False) -> list[str]:
    """What `Trainer.__init__` checks before any training work, without its work: nothing is written and no
    policy is built. Raises what the real run raises (ConfigError, FileNotFoundError, ValueError), so `--dry-run`
    fails exactly where the run would (tests/train/test_dry_run.py runs both on the same configs). One exception:
    a run dir that already holds a run is a note (returned), not an error: a dry run checks a config anywhere,
    and the real run then says how to continue or move that run."""
    import os

    from rlf_train.policy.checkpoint import latest_checkpoint
    from rlf_train.policy.model import resolve_device
    from rlf_train.policy.tokenizer import load_tokenizer
    from rlf_train.rollout.env_factory import env_tasks, make_env
    from rlf_train.sft import load_demos

    notes: list[str] = []
    tokenizer = load_tokenizer(cfg.model)
    device = resolve_device(cfg.model.device)
    run_dir = cfg.resolved_run_dir()
    if resume:
        if not (run_dir / "config.yaml").is_file():
            raise FileNotFoundError(f"--resume {run_dir}: no run there (no config.yaml); check the path, or start a "
                                    "new run without --resume")
    elif (run_dir / "metrics.jsonl").exists() or latest_checkpoint(run_dir) is not None:
        notes.append(f"run dir {run_dir} already holds a run: the real run refuses to start there; continue it with "
                     f"--resume {run_dir}, or pick another logging.run_dir / name (or delete that dir)")
    train_env = make_env(cfg, tokenizer, "train")
    train_tasks = env_tasks(train_env)
    if cfg.rollout.agent is not None:
        from rlf_train.rollout.agent_source import AgentSource

        AgentSource.check(cfg.rollout.agent, train_env.format)
    env_tasks(make_env(cfg, tokenizer, "eval"))
    if cfg.group_reward is not None:  # as the real run: the mapping's keys, then the judge's endpoint
        from rlf_train.group_reward import GroupReward

        group = GroupReward.from_config(cfg.group_reward, train_env)
        if group is not None:
            try:
                group.check_endpoint()
            finally:
                group.close()
    c = cfg.sft
    if c.enabled and c.steps > 0 and not c.demos_path:
        from rlf_train.sft import check_scripted_demos

        check_scripted_demos(train_env, cfg.env.id)
    if c.enabled and c.steps > 0 and c.demos_path:
        bad = [d.task_index for d in load_demos(c.demos_path) if not 0 <= d.task_index < len(train_tasks)]
        if bad:
            raise ConfigError(f"sft.demos_path {c.demos_path}: task_index {bad[0]} is out of range (the "
                              f"{cfg.env.train_split!r} split has {len(train_tasks)} tasks; {len(bad)} demos "
                              "affected); fix the file or point sft.demos_path elsewhere")
    existing = run_dir.resolve()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not (existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)):
        raise ConfigError(f"logging.run_dir: cannot write to {run_dir} ({existing} is not a writable directory); "
                          "set logging.run_dir (or name) to a writable directory")
    if cfg.rollout.engine == "vllm" and cfg.model.name_or_path == "tiny":
        from rlf_train.rollout.vllm import check_policy_shape

        check_policy_shape(cfg.model.tiny.hidden_size, cfg.model.tiny.num_heads, device.type == "cpu")
    return notes


def export_main(argv: list[str]) -> int:
    """`python -m rlf_train export`: a checkpoint (LoRA: base + adapter, merged) as a Hugging Face model dir."""
    p = argparse.ArgumentParser(prog="python -m rlf_train export",
                                description="Write a run's checkpoint as a Hugging Face model dir (config.json, "
                                            "model.safetensors, tokenizer) that transformers and vLLM load; a LoRA "
                                            "checkpoint's adapter is merged into its base.")
    p.add_argument("--checkpoint", type=Path, required=True, help="a checkpoint dir: RUN_DIR/checkpoints/step_N")
    p.add_argument("--out", type=Path, required=True, help="the model dir to write")
    args = p.parse_args(argv)
    from rlf_train.policy.load import export_merged

    try:
        out = export_merged(args.checkpoint, args.out)
    except (ConfigError, FileNotFoundError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        return export_main(argv[1:])
    args = build_parser().parse_args(argv)
    config_path = args.config
    if config_path is None and args.resume is not None:
        config_path = args.resume / "config.yaml"
        if not config_path.is_file():
            print(f"error: --resume {args.resume}: no run there (no config.yaml); check the path, or start a new "
                  "run with --config", file=sys.stderr)
            return 2
    if config_path is None:
        print("error: --config is required (or --resume RUN_DIR)", file=sys.stderr)
        return 2
    try:
        cfg = load_config(config_path, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.resume is not None:
        cfg.logging.run_dir = str(args.resume)
    if cfg.backend == "openrlhf":
        return run_openrlhf(cfg, resume=args.resume is not None, dry_run=args.dry_run)
    if args.dry_run:
        try:
            notes = preflight(cfg, resume=args.resume is not None)
        except (ConfigError, FileNotFoundError, FileExistsError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(dump_config(cfg))
        print("plan:\n" + plan(cfg))
        for note in notes:
            print(f"note: {note}")
        return 0
    from rlf_train.rollout.agent_source import AgentFailed
    from rlf_train.trainer import Trainer

    try:
        trainer = Trainer(cfg, resume=args.resume is not None)
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError) as e:
        # found before any training work: the key and the fix, on one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        summary = trainer.run()
    except KeyboardInterrupt:  # Ctrl-C: the engine and agents are closed (bounded); checkpoints are atomic
        print(f"\ninterrupted; checkpoints written so far are complete: continue with --resume {trainer.run_dir}",
              file=sys.stderr)
        return 130
    except AgentFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    last = summary["evals"][-1] if summary["evals"] else {}
    first = summary["evals"][0] if summary["evals"] else {}
    parts = [f"{label} {first[key]:.3f} -> {last[key]:.3f}"
             for label, key in (("greedy", "success_greedy"), (f"T={cfg.eval.temperature}", "success_sampled"))
             if key in first and key in last]
    result = f"held-out success {', '.join(parts)}; " if parts else ""
    print(f"done in {summary['seconds']:.0f}s; {result}see {summary['run_dir']}")
    return 0


def run_openrlhf(cfg: TrainConfig, resume: bool, dry_run: bool) -> int:
    """backend: openrlhf: write the run dir, print the plan, start OpenRLHF (unless dry_run)."""
    from rlf_train.openrlhf.launcher import COMMAND_FILE, prepare, run

    try:
        launch = prepare(cfg, resume=resume)
    except (ConfigError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("plan:\n" + plan(cfg))
    for note in launch.plan.notes:
        print(f"note: {note}")
    print(f"flags: {launch.checked}")
    print(f"run dir: {launch.run_dir} (command: {launch.run_dir / COMMAND_FILE})")
    if dry_run:
        print(launch.script(), end="")
        return 0
    try:
        return run(launch)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
