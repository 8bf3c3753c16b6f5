"""Run-directory outputs: metrics.jsonl (atomic line appends), TensorBoard, optional W&B, the reward
curve PNG, and a rich progress bar with the live reward."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def write_text_atomic(path: Path, text: str) -> Path:
    """Write through a temporary file and rename: readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True))


@dataclass
class MetricsLogger:
    run_dir: Path
    tensorboard: bool = True
    wandb_project: str | None = None
    wandb_mode: str = "offline"
    config_dict: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.path = self.run_dir / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))
        if self.wandb_project and self.wandb_mode != "disabled":
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("logging.wandb_project is set but wandb is not installed: "
                                   "pip install 'rlf-train[wandb]'") from e
            self._wandb = wandb.init(project=self.wandb_project, mode=self.wandb_mode, dir=str(self.run_dir),
                                     config=self.config_dict or {})

    def truncate_after(self, step: int, stage: str = "rl") -> None:
        """On resume: drop lines of `stage` beyond `step` (written after the checkpoint)."""
        if not self.path.is_file():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line from a crash
            if rec.get("stage") == stage and rec.get("step", 0) > step:
                continue
            keep.append(line)
        tmp = self.path.with_name(".metrics.tmp")
        tmp.write_text("".join(k + "\n" for k in keep))
        os.replace(tmp, self.path)

    def log(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True)
        with self.path.open("a") as f:
            f.write(line + "\n")
            f.flush()
        stage = record.get("stage", "rl")
        gstep = int(record.get("global_step", record.get("step", 0)))
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, int | float) and not isinstance(v, bool) and k not in ("step", "global_step"):
                    self._tb.add_scalar(f"{stage}/{k}", v, gstep)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({f"{stage}/{k}": v for k, v in record.items() if isinstance(v, int | float)}, step=gstep)

    def text(self, tag: str, markdown: str, step: int) -> None:
        """A TensorBoard text summary (e.g. a sample episode per eval); a no-op without TensorBoard."""
        if self._tb is not None:
            self._tb.add_text(tag, markdown, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
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
    ax.set_xlabel("GRPO step (step 0 = after SFT warm start)")
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
    """A rich progress bar showing the live reward; a no-op when disabled."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._p = None
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._p = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                   TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
            self._p.__enter__()
        return self

    def add(self, name: str, total: int, completed: int = 0) -> None:
        if self._p is not None:
            self._tasks[name] = self._p.add_task(name, total=total, completed=completed, info="")

    def update(self, name: str, advance: int = 1, info: str = "") -> None:
        if self._p is not None and name in self._tasks:
            self._p.update(self._tasks[name], advance=advance, info=info)

    def print(self, msg: str) -> None:
        if self._p is not None:
            self._p.console.print(msg, markup=False, highlight=False)
        else:
            print(msg, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._p is not None:
            self._p.__exit__(None, None, None)
