"""rlf/Code-v0 env steps per second: the warm sandbox pool against the cold path, in the same run.

    python benchmarks/code_env.py [--envs 16 64] [--seconds 5] [--rounds 3] [--json out/code_env.json]

Each episode is scripted: python(reference program) -> answer(its printed value), i.e. two steps, one sandboxed
Python run (every guard: namespaces, per-run uid, rlimits, whole-tree kill) and one verifier run (numeric /
exact match; "write a function" tasks are skipped so that every episode costs the same). Steps/s through a
ToolVectorEnv of N Code-v0 envs (all calls of a step concurrently, up to the tool's max_concurrency, default
the CPU count), for:
  - pool:    CodeEnv(pool=True), the default: a python call is a fork of a warm supervisor (`rlf_envs.sandbox.pool`)
  - cold:    CodeEnv(pool=False), the path before the pool: a new supervisor interpreter + worker interpreter per call
  - sync:    gymnasium SyncVectorEnv over the same pooled CodeEnvs (one env after another)
  - instant: Tools-v0 envs with an instant Python tool: the env machinery alone, the floor
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
from scripted_env import compare_rows, report, tool_call

from rlf_envs.env import ToolVectorEnv
from rlf_envs.envs.code import CodeEnv, code_tasks
from rlf_envs.sandbox import default_pool
from rlf_envs.types import Task


def tasks() -> list[Task]:
    return [t for t in code_tasks("train") if t.meta["check"] != "tests"]


def script(env: Any) -> list[str]:
    task = env.trajectory.task
    return [tool_call("python", code=str(task.meta["program"])), f"<answer>{task.ground_truth}</answer><|im_end|>"]


def all_verified(rewards: Any) -> None:
    assert (rewards == 1.0).all(), rewards  # every scripted episode is verified correct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3, help="measurements of each rate, interleaved (median)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    secs = args.seconds
    kwargs: dict[str, Any] = {"tasks": tasks(), "max_turns": 4, "max_total_tokens": 1 << 30}
    pool = default_pool()
    if pool is None:
        raise SystemExit("RLF_SANDBOX_POOL=0 turns the pool off: unset it to compare")

    def venv(cls: Any, pooled: bool) -> Callable[[int], Any]:
        return lambda n: cls([lambda: CodeEnv(pool=pooled, **kwargs) for _ in range(n)])

    rows = compare_rows(args.envs, {"pool": venv(ToolVectorEnv, True), "cold": venv(ToolVectorEnv, False),
                                    "sync": venv(gym.vector.SyncVectorEnv, True)},
                        secs, args.rounds, script, all_verified, steps=2, max_turns=4)
    labels = {"pool": "Code-v0, warm pool (pool=True, default)", "cold": "Code-v0, cold (pool=False, before)",
              "sync": "gymnasium SyncVectorEnv, pooled Code-v0", "instant": "Tools-v0, instant tool (floor)"}
    report("Code-v0", "code", "2-step episodes (1 sandboxed python run + verified answer)", rows, labels, args.json,
           after="pool", before="cold", extra={"pool_size": pool.size, "cpus": os.cpu_count(),
                                                "load_avg_1m_at_end": os.getloadavg()[0]})


if __name__ == "__main__":
    main()
