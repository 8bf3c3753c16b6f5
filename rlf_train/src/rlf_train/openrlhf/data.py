"""The prompt datasets of backend openrlhf: one JSON line per prompt, `prompt` = the env's rendered prompt for
the task, `label` = the task and its stage ("train" or "eval") as JSON (OpenRLHF hands the label back to the
agent executor, which rebuilds the task from it), `datasource` = the env id. No OpenRLHF import here."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rlf_envs.records import atomic_write_text
from rlf_envs.tasks import task_from_dict
from rlf_envs.types import Task
from rlf_train.config import ConfigError, TrainConfig
from rlf_train.rollout.env_factory import Stage


def task_to_label(task: Task, stage: Stage) -> str:
    """The task and its stage (whose env kwargs apply) as the JSON label OpenRLHF passes back to `execute`;
    inverse of `task_from_label`."""
    return json.dumps({"stage": stage, "task": {
        "id": task.id, "question": task.question, "ground_truth": task.ground_truth,
        "messages": [m.to_dict() for m in task.messages], "meta": task.meta,
    }}, ensure_ascii=False)


def task_from_label(label: Any) -> tuple[Task, Stage]:
    d = json.loads(label) if isinstance(label, str) else label
    if not isinstance(d, dict) or "task" not in d:
        raise ValueError(f"not an rlf task label (write the prompt dataset with rlf_train's launcher): {label!r:.200}")
    return task_from_dict(d["task"]), "eval" if d.get("stage") == "eval" else "train"


def write_prompts(cfg: TrainConfig, data_dir: Path) -> tuple[Path, Path | None, int]:
    """The train and eval prompt files (see the module docstring); returns (train, eval, #train prompts)."""
    from rlf_train.rollout.env_factory import make_env

    def lines(kind: Stage, n: int | None, shuffle: bool) -> list[str]:
        env = make_env(cfg, None, kind)  # text mode: the observation after reset is the rendered prompt
        try:
            tasks = list(env.tasks)
            if not tasks:
                raise ConfigError(f"env {cfg.env.id!r} has no {kind} tasks (env.{kind}_split / env.kwargs)")
            if shuffle:
                random.Random(cfg.seed).shuffle(tasks)
            picked = tasks if n is None else [tasks[k % len(tasks)] for k in range(n)]
            out = []
            for t in picked:
                prompt, _ = env.reset(options={"task": t})
                out.append(json.dumps({"prompt": prompt, "label": task_to_label(t, kind), "datasource": cfg.env.id},
                                      ensure_ascii=False))
            return out
        finally:
            env.close()

    data_dir.mkdir(parents=True, exist_ok=True)
    n_train = cfg.algorithm.steps * cfg.rollout.prompts_per_step
    train = data_dir / "train.jsonl"
    atomic_write_text(train, _joined(lines("train", n_train, True)))
    ev = None
    if cfg.eval.greedy or cfg.eval.sampled:
        ev = data_dir / "eval.jsonl"
        atomic_write_text(ev, _joined(lines("eval", None, False)[: cfg.eval.num_tasks]))
    return train, ev, n_train


def _joined(lines: list[str]) -> str:
    return "\n".join(lines) + "\n"
