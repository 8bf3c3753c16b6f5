"""PPO with a critic vs GRPO on the quickstart with a process reward (docs/guides/ppo.md).

Three arms, each a real run of the trainer from the same SFT warm start and budget:
  ppo        configs/quickstart-ppo.yaml: outcome + 0.2 per turn whose search result holds the answer, PPO + critic
  grpo+pr    configs/quickstart.yaml with the same process reward (per-turn rewards as GRPO returns-to-go)
  grpo       configs/quickstart.yaml as shipped (outcome only)

    python benchmarks/ppo_vs_grpo.py --seeds 0 1 2 --out out/ppo_vs_grpo        # runs what is missing, then plots
    python benchmarks/ppo_vs_grpo.py --runs /tmp/cmp --seeds 0 --plot docs/assets/ppo_vs_grpo.png

A run dir that already holds eval.json is reused. Prints held-out greedy success per eval step and arm (mean over
the seeds) and the steps each arm needed to first reach 0.7, and writes the figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {
    "ppo": ["--config", str(ROOT / "configs" / "quickstart-ppo.yaml")],
    "grpo+pr": ["--config", str(ROOT / "configs" / "quickstart.yaml"), "--set",
                "env.kwargs.turn_rewarder.answer_in_result_bonus=0.2"],
    "grpo": ["--config", str(ROOT / "configs" / "quickstart.yaml")],
}
DIRS = {"ppo": "ppo", "grpo+pr": "grpo", "grpo": "plain"}  # run dir prefixes: <prefix>-s<seed>


def run(arm: str, seed: int, run_dir: Path) -> None:
    if (run_dir / "eval.json").is_file():
        return
    cmd = [sys.executable, "-m", "rlf_train", *ARMS[arm], "--set", f"seed={seed}", "--set", "logging.progress=false",
           "--set", f"logging.run_dir={run_dir}"]
    print(f"running {arm} seed {seed}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def evals(run_dir: Path) -> dict[int, float]:
    ev = json.loads((run_dir / "eval.json").read_text())["evals"]
    return {int(e["step"]): float(e["success_greedy"]) for e in ev if "success_greedy" in e}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=ROOT / "out" / "ppo_vs_grpo", help="where the run dirs live")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--plot", type=Path, help="the figure (default: RUNS/ppo_vs_grpo.png)")
    ap.add_argument("--no-run", action="store_true", help="only read run dirs that exist")
    args = ap.parse_args()
    got: dict[str, list[dict[int, float]]] = {}
    for arm in args.arms:
        for seed in args.seeds:
            d = args.runs / f"{DIRS[arm]}-s{seed}"
            if not args.no_run:
                run(arm, seed, d)
            if (d / "eval.json").is_file():
                got.setdefault(arm, []).append(evals(d))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"ppo": "tab:green", "grpo+pr": "tab:red", "grpo": "tab:blue"}
    print(f"{'arm':8} {'seeds':>5}  held-out greedy success by step (mean)        first step >= 0.7")
    for arm, runs in got.items():
        steps = sorted(set.intersection(*(set(r) for r in runs)))
        mean = [sum(r[s] for r in runs) / len(runs) for s in steps]
        for r in runs:
            ax.plot(sorted(r), [r[s] for s in sorted(r)], color=colors[arm], alpha=0.25, lw=1)
        ax.plot(steps, mean, "o-", color=colors[arm], lw=2, label=f"{arm} ({len(runs)} seed{'s' * (len(runs) > 1)})")
        first = next((s for s, m in zip(steps, mean, strict=True) if m >= 0.7), None)
        print(f"{arm:8} {len(runs):>5}  " + "  ".join(f"{s}:{m:.3f}" for s, m in zip(steps, mean, strict=True))
              + f"   {first if first is not None else '-'}")
    ax.set_xlabel("RL step (step 0 = after the SFT warm start)")
    ax.set_ylabel("held-out success, greedy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    ax.set_title("quickstart + process reward (0.2 per search that found the answer)", fontsize=10)
    fig.tight_layout()
    out = args.plot or args.runs / "ppo_vs_grpo.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
