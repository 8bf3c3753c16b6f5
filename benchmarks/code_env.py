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
import json
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
from tool_calls import make_tool, write_report

from rlf_envs.env import ToolEnv, ToolVectorEnv
from rlf_envs.envs.code import DEFAULT_LIMITS, CodeEnv, code_tasks
from rlf_envs.sandbox import SandboxDir, run_python
from rlf_envs.types import Task


def _call(name: str, **args: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call><|im_end|>"


def tasks() -> list[Task]:
    return [t for t in code_tasks("train") if t.meta["check"] != "tests"]


def script(task: Task) -> list[str]:
    return [_call("python", code=str(task.meta["program"])), f"<answer>{task.ground_truth}</answer><|im_end|>"]


def rate(venv: gym.vector.VectorEnv, seconds: float, scripted: bool = True) -> float:
    envs = [e.unwrapped for e in venv.envs]  # type: ignore[attr-defined]
    steps, seed = 0, 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or steps == 0:
        venv.reset(seed=seed)
        seed += 1
        plans = [script(e.trajectory.task) if scripted else [_call("work", x=1), "<answer>x</answer>"] for e in envs]
        for k in range(2):
            _, rewards, *_ = venv.step([p[k] for p in plans])
            steps += len(envs)
        if scripted:
            assert (rewards == 1.0).all(), rewards  # every scripted episode is verified correct
    venv.close()
    return steps / (time.perf_counter() - t0)


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
    ours = rate(ToolVectorEnv([lambda: CodeEnv(**kwargs) for _ in range(n)]), secs)
    base = rate(gym.vector.SyncVectorEnv([lambda: CodeEnv(**kwargs) for _ in range(n)]), secs)

    instant_tasks = [Task(id=str(i), question=f"q{i}", ground_truth=["x"]) for i in range(8)]
    work = make_tool(0.0)
    instant = rate(ToolVectorEnv([lambda: ToolEnv(tools=[work], tasks=instant_tasks, max_turns=4) for _ in range(n)]),
                   secs, scripted=False)
    raw = raw_runs_per_s(secs)
    res = {"envs": n, "code_vector_steps_per_s": ours, "code_sync_vector_steps_per_s": base,
           "instant_tool_vector_steps_per_s": instant, "raw_sandbox_episode_steps_per_s": raw,
           "speedup_vs_sync": ours / base, "share_of_instant_tool": ours / instant, "vs_raw_sandbox": ours / raw}
    print(f"\nrlf/Code-v0 steps/s, {n} envs, scripted 2-step episodes (1 sandboxed python run + verified answer):")
    print(f"  rlf ToolVectorEnv          {ours:>9,.1f}/s")
    print(f"  gymnasium SyncVectorEnv    {base:>9,.1f}/s   -> rlf {ours / base:.2f}x")
    print(f"  Tools-v0, instant tool     {instant:>9,.1f}/s   -> Code-v0 runs at {ours / instant:.4f} of it")
    print(f"  raw run_python, sequential {raw:>9,.1f}/s   -> Code-v0 runs at {ours / raw:.2f} of it")
    if args.json:
        write_report(args.json, {"code_env": res})


if __name__ == "__main__":
    main()
