"""rlf/Code-v0 env steps per second, with baselines measured in the same run.

    python benchmarks/code_env.py [--envs 16] [--seconds 5] [--json out/code_env.json]

Each episode is scripted: python(reference program) -> answer(its printed value), i.e. two steps, one sandboxed
Python run (supervisor + worker processes, namespaces, rlimits, whole-tree kill) and one verifier run (numeric /
exact match; "write a function" tasks are skipped so that every episode costs the same). Rates are steps/s through:
  - rlf ToolVectorEnv of N Code-v0 envs (all calls of a step concurrently, up to the tool's max_concurrency,
    default the CPU count);
  - gymnasium SyncVectorEnv over the same CodeEnvs (one env after another): the baseline;
  - rlf ToolVectorEnv of N Tools-v0 envs with an instant Python tool: the env machinery without the sandbox;
  - and the raw work: the same programs run directly with `rlf_envs.sandbox.run_python`, one after another.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
from scripted_env import instant_tool_rate, report, scripted_rate, tool_call

from rlf_envs.env import ToolVectorEnv
from rlf_envs.envs.code import DEFAULT_LIMITS, CodeEnv, code_tasks
from rlf_envs.sandbox import SandboxDir, run_python
from rlf_envs.types import Task


def tasks() -> list[Task]:
    return [t for t in code_tasks("train") if t.meta["check"] != "tests"]


def script(env: Any) -> list[str]:
    task = env.trajectory.task
    return [tool_call("python", code=str(task.meta["program"])), f"<answer>{task.ground_truth}</answer><|im_end|>"]


def all_verified(rewards: Any) -> None:
    assert (rewards == 1.0).all(), rewards  # every scripted episode is verified correct


def raw_runs_per_s(seconds: float) -> float:
    """The same programs through `run_python` directly, one after another (2 steps' worth per run)."""
    ts = tasks()

    async def go() -> float:
        n, i, t0 = 0, 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds or n == 0:
            t = ts[i % len(ts)]
            i += 1
            with SandboxDir() as d:
                for name, text in (t.meta.get("files") or {}).items():  # type: ignore[union-attr]
                    d.write(name, str(text))
                r = await run_python(str(t.meta["program"]), "", DEFAULT_LIMITS, d)
            assert r.ok, r
            n += 2
        return n / (time.perf_counter() - t0)

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    n, secs = args.envs, args.seconds
    kwargs: dict[str, Any] = {"tasks": tasks(), "max_turns": 4, "max_total_tokens": 1 << 30}
    rates = {
        "ours": scripted_rate(ToolVectorEnv([lambda: CodeEnv(**kwargs) for _ in range(n)]), secs, script, all_verified),
        "sync": scripted_rate(gym.vector.SyncVectorEnv([lambda: CodeEnv(**kwargs) for _ in range(n)]), secs, script,
                              all_verified),
        "instant": instant_tool_rate(n, secs, steps=2, max_turns=4),
        "raw": raw_runs_per_s(secs),
    }
    report("Code-v0", "code", n, "2-step episodes (1 sandboxed python run + verified answer)", rates,
           ("sandbox", "raw run_python, sequential"), args.json, rate_digits=1, share_digits=4)


if __name__ == "__main__":
    main()
