"""`python -m rlf_train --config X.yaml` with `backend: openrlhf`: write the run dir, then start OpenRLHF.

The run dir gets
- `data/train.jsonl`, `data/eval.jsonl`: OpenRLHF prompt datasets, one line per prompt: `prompt` = the env's
  rendered prompt for the task, `label` = the task as JSON (the agent executor rebuilds the task from it);
  the train file holds exactly `algorithm.steps x rollout.prompts_per_step` prompts (one OpenRLHF episode);
- `config.yaml` (the resolved config), `openrlhf_plan.txt` (flags and notes), `openrlhf_command.sh` (the exact
  command, runnable as it is; secrets stay `$VARS`);
- `tiny_model/` when `model.name_or_path: tiny` (the offline tiny policy exported as a HF model).

Then, without `ray_address`, it runs OpenRLHF's driver here with `RAY_ADDRESS=local` (OpenRLHF's `ray.init`
starts a local Ray head whose workers inherit the env vars); with `ray_address`, it submits a Ray job whose
runtime env carries the env vars and uploads the run dir as the working dir.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlf_envs.extras import pip_install
from rlf_envs.records import atomic_write_text
from rlf_train.config import ConfigError, TrainConfig, dump_config
from rlf_train.openrlhf.data import write_prompts
from rlf_train.openrlhf.flags import FlagPlan, RunPaths, check_keys, openrlhf_flags

ENTRY = ["-m", "openrlhf.cli.train_ppo_ray"]
AGENT_FILE = Path(__file__).with_name("agent.py")
COMMAND_FILE = "openrlhf_command.sh"
SECRET_ENV = ("WANDB_API_KEY",)


@dataclass
class Launch:
    run_dir: Path
    argv: list[str]  # the command, with $SECRETS unexpanded
    env: dict[str, str]  # added to the environment of the command (and of every Ray worker)
    plan: FlagPlan
    checked: str  # whether OpenRLHF's own parser accepted the flags
    notes: list[str] = field(default_factory=list)

    def script(self) -> str:
        lines = ["#!/usr/bin/env bash", "# written by rlf_train (backend: openrlhf); run it as it is to start "
                 "the same run", "set -euo pipefail"]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in self.env.items()]
        lines.append(" \\\n    ".join(" ".join(_quote(a) for a in group) for group in _flag_groups(self.argv)))
        return "\n".join(lines) + "\n"


def _quote(arg: str) -> str:
    return arg if arg.startswith("$") and arg[1:] in SECRET_ENV else shlex.quote(arg)


def export_tiny_model(cfg: TrainConfig, out: Path) -> Path:
    """The offline tiny policy (built from config, seeded) and its tokenizer as a HF model directory."""
    from transformers.utils import logging as hf_logging

    from rlf_train.policy.model import build_tiny_model
    from rlf_train.policy.tokenizer import load_tokenizer

    if (out / "config.json").is_file():
        return out
    hf_logging.disable_progress_bar()
    tok = load_tokenizer(cfg.model)
    model = build_tiny_model(cfg.model, len(tok), cfg.seed, tok.pad_token_id)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def check_flags(flags: list[str]) -> str:
    """'checked by OpenRLHF X's parser' (raises ConfigError if it refuses), or why it was not checked."""
    from rlf_train.openrlhf.parser import OpenRLHFFlagError, openrlhf_version, parse_flags

    probe = [("dummy-secret" if f == "$WANDB_API_KEY" else f) for f in flags]
    try:
        parse_flags(probe)
    except ModuleNotFoundError:
        return f"not checked: openrlhf is not installed here ({pip_install('openrlhf', dist='rlf-train')})"
    except OpenRLHFFlagError as e:
        raise ConfigError(f"OpenRLHF {openrlhf_version()} refuses the generated flags: {e}") from None
    return f"checked by OpenRLHF {openrlhf_version()}'s own parser"


def prepare(cfg: TrainConfig, resume: bool = False) -> Launch:
    """Write the run dir and build the command (nothing is started)."""
    check_keys(cfg)  # before any work
    o = cfg.openrlhf
    run_dir = cfg.resolved_run_dir().resolve()
    if (run_dir / COMMAND_FILE).is_file() and not resume:
        raise FileExistsError(f"{run_dir} already holds an openrlhf run: continue it with --resume {run_dir}, "
                              "or set another name / logging.run_dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / ".write_test").touch()
        (run_dir / ".write_test").unlink()
    except OSError as e:
        raise ConfigError(f"logging.run_dir: cannot write {run_dir} ({e.strerror}); choose a writable path") from None
    remote = o.ray_address is not None
    if remote and o.shared_dir is None:
        raise ConfigError("openrlhf.shared_dir: required with openrlhf.ray_address (a directory every node sees, "
                          "for checkpoints and final weights; a Ray job's working dir is temporary)")
    model = cfg.model.name_or_path
    if model == "tiny":
        model = str(export_tiny_model(cfg, run_dir / "tiny_model"))
    train, ev, _ = write_prompts(cfg, run_dir / "data")
    (run_dir / "config.yaml").write_text(dump_config(cfg), encoding="utf-8")

    def local(p: Path) -> str:  # as the OpenRLHF driver sees it: relative to the job's working dir if remote
        return str(p.relative_to(run_dir)) if remote else str(p)

    if remote:
        shutil.copyfile(AGENT_FILE, run_dir / "rlf_agent.py")
        out = Path(o.shared_dir or "") / cfg.name
        if cfg.model.name_or_path == "tiny":
            model = "tiny_model"
    else:
        out = run_dir
    paths = RunPaths(
        model=model,
        agent="rlf_agent.py" if remote else str(AGENT_FILE),
        prompts=local(train),
        eval_prompts=local(ev) if ev is not None else None,
        checkpoints=str(out / "ckpt"),
        output=str(out / "model"),
        tensorboard=str(out / "tensorboard") if cfg.logging.tensorboard else None,
    )
    plan = openrlhf_flags(cfg, paths)
    checked = check_flags(plan.flags)
    env = {"RLF_OPENRLHF_CONFIG": json.dumps(cfg.model_dump(mode="json"), separators=(",", ":"))}
    if cfg.logging.wandb_project is not None:
        env["WANDB_MODE"] = cfg.logging.wandb_mode
    if cfg.sessions is not None:  # the rollout actors open the same session backend (a ray one: the session nodes)
        env.update(cfg.sessions.env_vars())
    env.update(o.env_vars)
    openrlhf = ["python", *ENTRY, *plan.flags]
    if remote:
        runtime_env = {"working_dir": str(run_dir), "env_vars": env,
                       "excludes": ["ckpt/", "model/", "tensorboard/", "*.tmp"]}
        argv = ["ray", "job", "submit", "--address", str(o.ray_address),
                "--runtime-env-json", json.dumps(runtime_env), "--", *openrlhf]
        launch_env: dict[str, str] = {}
    else:
        argv = [sys.executable, *ENTRY, *plan.flags]
        launch_env = {"RAY_ADDRESS": "local", **env}
    launch = Launch(run_dir, argv, launch_env, plan, checked)
    plan_lines = [f"# {checked}", *(f"# note: {n}" for n in plan.notes), *map(" ".join, _flag_groups(plan.flags))]
    atomic_write_text(run_dir / "openrlhf_plan.txt", "\n".join(plan_lines) + "\n")
    script = run_dir / COMMAND_FILE
    script.write_text(launch.script(), encoding="utf-8")
    script.chmod(0o755)
    return launch


def _flag_groups(argv: list[str]) -> list[list[str]]:
    """argv split before each --flag (a flag with its values on one line)."""
    out: list[list[str]] = []
    for a in argv:
        if a.startswith("--") or not out:
            out.append([a])
        else:
            out[-1].append(a)
    return out


def _missing_secrets(argv: list[str]) -> list[str]:
    return [a[1:] for a in argv if a.startswith("$") and a[1:] in SECRET_ENV and not os.environ.get(a[1:])]


def preflight(launch: Launch) -> None:
    """What must hold before starting (raises ConfigError saying what to install or set)."""
    if launch.checked.startswith("not checked"):
        raise ConfigError(f"backend openrlhf needs OpenRLHF here: {pip_install('openrlhf', dist='rlf-train')} "
                          "(--dry-run writes the run files and prints the command without it)")
    if launch.argv[0] == "ray":
        if shutil.which("ray") is None:
            raise ConfigError("openrlhf.ray_address is set but the `ray` CLI is not on PATH: "
                              "pip install 'ray[default]'")
    else:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("backend openrlhf needs NVIDIA GPUs and none is visible here (OpenRLHF 0.11's driver "
                              "asks Ray for GPU bundles and its DeepSpeed strategy calls torch.cuda); run on a GPU "
                              "machine, or set openrlhf.ray_address to submit to a Ray cluster (--dry-run works "
                              "anywhere; what runs on CPU: docs/guides/openrlhf-on-cpu.md)")
    missing = _missing_secrets(launch.argv)
    if missing:
        raise ConfigError(f"set {', '.join(missing)} in the environment (logging.wandb_project is set)")


def run(launch: Launch) -> int:
    """Start the command and wait; Ctrl-C stops the whole process group (OpenRLHF's driver and Ray)."""
    preflight(launch)
    env = {**os.environ, **launch.env}
    argv = [os.environ[a[1:]] if a.startswith("$") and a[1:] in SECRET_ENV else a for a in launch.argv]
    proc = subprocess.Popen(argv, env=env, cwd=launch.run_dir, start_new_session=True)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        _stop_group(proc)
        return 130
    finally:
        if proc.poll() is None:
            _stop_group(proc)


def _stop_group(proc: subprocess.Popen[Any]) -> None:
    for sig, wait_s in ((signal.SIGINT, 30.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
