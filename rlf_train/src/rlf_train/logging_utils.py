"""Run-directory outputs: metrics.jsonl (atomic line appends), TensorBoard, optional W&B, the reward
curve PNG, and a rich progress bar with the live reward."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlf_envs.records import atomic_write_text

log = logging.getLogger(__name__)


def write_json_atomic(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True))


@dataclass
class MetricsLogger:
    """metrics.jsonl rows `{"stage": sft|rl|eval, "step": N, ...}`. TensorBoard: one writer per stage under
    tb/<stage>, each stage on its own step axis from 0 (SFT steps; RL steps; eval at the RL step it ran
    after). W&B: `<stage>/<key>` against `<stage>/step`."""

    run_dir: Path
    tensorboard: bool = True
    wandb_project: str | None = None
    wandb_mode: str = "offline"
    config_dict: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.path = self.run_dir / "metrics.jsonl"
        self._tb: dict[str, Any] = {}
        self._purge: dict[str, int] = {}
        self._wandb = None
        if self.wandb_project and self.wandb_mode != "disabled":
            try:
                import wandb
            except ImportError as e:
                from rlf_envs.extras import pip_install

                raise RuntimeError("logging.wandb_project is set but wandb is not installed: "
                                   + pip_install("wandb", dist="rlf-train")) from e
            self._wandb = wandb.init(project=self.wandb_project, mode=self.wandb_mode, dir=str(self.run_dir),
                                     config=self.config_dict or {})
            for stage in ("sft", "rl", "eval"):
                wandb.define_metric(f"{stage}/step")
                wandb.define_metric(f"{stage}/*", step_metric=f"{stage}/step")

    def resume_from(self, kept: dict[str, float]) -> None:
        """On resume: drop the rows of each stage beyond `kept[stage]` (written after the checkpoint the run
        continues from; they are logged again), in metrics.jsonl and in that stage's TensorBoard events."""
        for stage, last in kept.items():
            if last != float("inf"):
                self._purge[stage] = int(last) + 1
        if not self.path.is_file():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line from a crash
            if rec.get("step", 0) > kept.get(rec.get("stage", ""), float("inf")):
                continue
            keep.append(line)
        tmp = self.path.with_name(".metrics.tmp")
        tmp.write_text("".join(k + "\n" for k in keep))
        os.replace(tmp, self.path)

    def _writer(self, stage: str) -> Any:
        if stage not in self._tb:
            # tensorboard imports TensorFlow, when it is installed, for file I/O (`tensorboard.compat.tf`), and TF
            # can take the GPU; a `tensorboard.compat.notf` module is tensorboard's own switch to its TF-free stub
            import types

            sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
            from torch.utils.tensorboard import SummaryWriter

            self._tb[stage] = SummaryWriter(log_dir=str(self.run_dir / "tb" / stage), purge_step=self._purge.get(stage))
        return self._tb[stage]

    def log(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True)
        with self.path.open("a") as f:
            f.write(line + "\n")
            f.flush()
        stage = record.get("stage", "rl")
        step = int(record.get("step", 0))
        scalars = {k: v for k, v in record.items()
                   if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"}
        if self.tensorboard:
            tb = self._writer(stage)
            for k, v in scalars.items():
                tb.add_scalar(f"{stage}/{k}", v, step)
            tb.flush()
        if self._wandb is not None:
            self._wandb.log({f"{stage}/step": step, **{f"{stage}/{k}": v for k, v in scalars.items()}})

    def text(self, tag: str, markdown: str, step: int) -> None:
        """A TensorBoard text summary on the eval stage's axis (a sample episode per eval); a no-op without
        TensorBoard."""
        if self.tensorboard:
            tb = self._writer("eval")
            tb.add_text(tag, markdown, step)
            tb.flush()

    def close(self) -> None:
        for tb in self._tb.values():
            tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def plot_reward_curve(run_dir: Path, out: Path | None = None) -> Path:
    """reward_curve.png: RL reward mean / success per step (smoothed) and eval points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(run_dir / "metrics.jsonl")
    rl = [r for r in recs if r.get("stage") == "rl"]
    evals = [r for r in recs if r.get("stage") == "eval"]
    out = out or run_dir / "reward_curve.png"
    fig, ax = plt.subplots(figsize=(7, 4))
    if rl:
        xs = [r["step"] for r in rl]
        ys = [r["success_rate"] for r in rl]
        ax.plot(xs, ys, color="tab:blue", alpha=0.3, lw=1, label="train success (sampled, per step)")
        k = max(1, len(ys) // 15)
        sm = [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]
        ax.plot(xs, sm, color="tab:blue", lw=2, label=f"train success (moving avg {k})")
    for key, color, label in (("success_greedy", "tab:green", "held-out success, greedy"),
                              ("success_sampled", "tab:orange", "held-out success, T=1")):
        pts = [(r["step"], r[key]) for r in evals if key in r]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o--", color=color, label=label)
    ax.set_xlabel("RL step (step 0 = after the SFT warm start)")
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    ax.set_title(run_dir.name)
    fig.tight_layout()
    tmp = out.with_name(f".{out.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out)
    return out


class Progress:
    """Progress of each stage. On a terminal: rich bars with the live reward. Otherwise (CI, `tee`, a cluster
    log): plain lines `SFT 150/1500 (10%) 0:00:41 elapsed, ~0:06:09 left | loss 0.412`, one each time a
    stage passes another `every` share of its steps (and at its last step). A no-op when disabled
    (messages still print)."""

    def __init__(self, enabled: bool, interactive: bool | None = None, every: float = 0.05) -> None:
        self.enabled = enabled
        self.interactive = sys.stdout.isatty() if interactive is None else interactive
        self.every = every
        self._p = None
        self._tasks: dict[str, Any] = {}
        self._plain: dict[str, list[float]] = {}  # name -> [done, total, started, last printed share, done at start]

    def __enter__(self) -> Progress:
        if self.enabled and self.interactive:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._p = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                   TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
            self._p.__enter__()
        return self

    def add(self, name: str, total: int, completed: int = 0) -> None:
        if self._p is not None:
            self._tasks[name] = self._p.add_task(name, total=total, completed=completed, info="")
        elif self.enabled:
            self._plain[name] = [completed, max(total, 1), time.monotonic(), completed / max(total, 1), completed]

    def update(self, name: str, advance: int = 1, info: str = "") -> None:
        if self._p is not None and name in self._tasks:
            self._p.update(self._tasks[name], advance=advance, info=info)
        elif name in self._plain:
            st = self._plain[name]
            st[0] += advance
            done, total, started, last, first = st
            share = done / total
            if share - last >= self.every - 1e-9 or done >= total:
                st[3] = share
                spent = time.monotonic() - started
                left = spent / max(done - first, 1) * (total - done)
                print(f"{name} {int(done)}/{int(total)} ({share:.0%}) {_hms(spent)} elapsed, ~{_hms(left)} left"
                      + (f" | {info}" if info else ""), flush=True)

    def print(self, msg: str) -> None:
        if self._p is not None:
            self._p.console.print(msg, markup=False, highlight=False)
        else:
            print(msg, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._p is not None:
            self._p.__exit__(None, None, None)


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
