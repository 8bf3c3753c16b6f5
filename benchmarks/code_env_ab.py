"""Code-v0 pool steps/s of two checkouts of rlf, measured alternately in the same run (before/after a change).

    python benchmarks/code_env_ab.py BEFORE_CHECKOUT [AFTER_CHECKOUT (default: this one)] [--envs 16]
                                     [--seconds 5] [--rounds 6] [--json out.json]

Each round runs `benchmarks/code_env.py`'s pool row (scripted 2-step Code-v0 episodes, every python call
checked) in a fresh interpreter for each checkout, one after the other (`PYTHONPATH=<checkout>/rlf_envs/src`;
both use this interpreter and its packages), so load from elsewhere falls on both alike; prints every round and
the medians' ratio after/before. Make the "before" checkout with e.g. `git worktree add /srv/rlf_before main` or
`git archive main | tar -x -C /srv/rlf_before` (outside /tmp: the sandbox hides /tmp from runs, so the old code's
behaviour would differ only there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

ONE = """
import json, os, sys
root, n, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
sys.path.insert(0, os.path.join(root, "benchmarks"))
import code_env as ce
from scripted_env import scripted_rate
from rlf_envs.env import ToolVectorEnv
from rlf_envs.envs.code import CodeEnv
import rlf_envs
assert rlf_envs.__file__.startswith(root), (rlf_envs.__file__, root)
kwargs = {"tasks": ce.tasks(), "max_turns": 4, "max_total_tokens": 1 << 30}
venv = ToolVectorEnv([lambda: CodeEnv(pool=True, **kwargs) for _ in range(n)])
rate = scripted_rate(venv, secs, ce.script, ce.all_verified, ce.python_ran)
print("RATE", json.dumps({"rate": rate, "load": os.getloadavg()[0]}), flush=True)
"""


def measure(checkout: Path, envs: int, seconds: float) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout / "rlf_envs" / "src")}
    out = subprocess.run([sys.executable, "-c", ONE, str(checkout), str(envs), str(seconds)], env=env,
                         capture_output=True, text=True, timeout=600, cwd="/")
    for line in out.stdout.splitlines():
        if line.startswith("RATE "):
            return json.loads(line[5:])
    raise SystemExit(f"{checkout}: no rate\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path, nargs="?", default=HERE.parent)
    ap.add_argument("--envs", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    before, after = args.before.resolve(), args.after.resolve()
    rows: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    print(f"Code-v0 pool, {args.envs} envs, {args.seconds:g} s per measurement, {args.rounds} rounds, alternating")
    for i in range(args.rounds):
        for name, checkout in (("before", before), ("after", after)) if i % 2 == 0 else (("after", after),
                                                                                      ("before", before)):
            m = measure(checkout, args.envs, args.seconds)
            rows[name].append(m)
            print(f"  round {i + 1} {name:6s} {m['rate']:8.1f} steps/s   (load {m['load']:.1f})", flush=True)
    med = {k: statistics.median(m["rate"] for m in v) for k, v in rows.items()}
    ratio = med["after"] / med["before"]
    print(f"median steps/s: before {med['before']:.1f} ({before}), after {med['after']:.1f} ({after}); "
          f"after/before {ratio:.3f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"envs": args.envs, "seconds": args.seconds, "rounds": rows, "median": med,
                                         "ratio": ratio, "before": str(before), "after": str(after)}, indent=1))


if __name__ == "__main__":
    main()
