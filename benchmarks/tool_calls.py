"""Tool-call throughput: rlf's async caller vs one-call-at-a-time, and whole env steps per second.

    python benchmarks/tool_calls.py [--envs 64 512] [--latency-ms 50] [--turns 5] [--json out/tool_calls.json]

Part 1: N envs each make one call per turn to a tool that takes `latency` (asyncio.sleep), stepped
through rlf's vector env (all calls at once) vs the same calls awaited one at a time (the baseline).
efficiency = tool latency / async turn time (median over --turns; 1.0 = zero overhead);
overhead per call = (turn - latency) / N.

Part 2: an instant tool; whole env steps (parse -> call -> render, text mode) per second through a
ToolVectorEnv of 64, vs gymnasium's SyncVectorEnv stepping the same ToolEnvs one after another.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import gymnasium as gym

import rlf_envs
from rlf_envs import runtime
from rlf_envs.env import ToolEnv, ToolVectorEnv
from rlf_envs.tools import CallerConfig, FunctionTool
from rlf_envs.types import Task, ToolCall

TASKS = [Task(id=str(i), question=f"q{i}", ground_truth=["x"]) for i in range(8)]
CALL = '<tool_call>\n{"name": "work", "arguments": {"x": 1}}\n</tool_call><|im_end|>'


def make_tool(latency_s: float) -> FunctionTool:
    if latency_s > 0:

        async def work(x: int) -> str:
            """Fixed-latency work."""
            await asyncio.sleep(latency_s)
            return "done"

    else:

        async def work(x: int) -> str:
            """Instant work."""
            return "done"

    return FunctionTool(work)


def bench_latency(n: int, latency_s: float, turns: int) -> dict[str, float]:
    tool = make_tool(latency_s)
    cfg = CallerConfig(max_concurrency=max(1024, n), timeout_s=30)
    venv = ToolVectorEnv(num_envs=n, tools=[tool], tasks=TASKS, max_turns=10_000, max_total_tokens=1 << 30, caller=cfg)
    venv.reset(seed=0)
    actions = [CALL] * n
    venv.step(actions)  # warm-up
    times = []
    for _ in range(turns):
        t0 = time.perf_counter()
        venv.step(actions)
        times.append(time.perf_counter() - t0)
    async_turn = statistics.median(times)  # robust to a noisy (shared, virtualised) CPU

    caller = venv.envs[0].toolbox.caller

    async def sequential_turn() -> None:
        for _ in range(n):
            await caller.call(ToolCall("work", {"x": 1}))

    seq_turns = 1 if n * latency_s > 2 else 2
    t0 = time.perf_counter()
    for _ in range(seq_turns):
        runtime.run(sequential_turn())
    seq_turn = (time.perf_counter() - t0) / seq_turns
    venv.close()
    return {
        "envs": n,
        "latency_ms": latency_s * 1e3,
        "turn_seconds_async": async_turn,
        "turn_seconds_async_mean": statistics.fmean(times),
        "turn_seconds_sequential": seq_turn,
        "speedup": seq_turn / async_turn,
        "efficiency": latency_s / async_turn,
        "overhead_per_call_us": max(0.0, async_turn - latency_s) / n * 1e6,
    }


def bench_steps(n: int, seconds: float) -> dict[str, float]:
    tool = make_tool(0.0)
    kwargs = dict(tools=[tool], tasks=TASKS, max_turns=10_000, max_total_tokens=1 << 30)

    def rate(venv: gym.vector.VectorEnv) -> float:
        venv.reset(seed=0)
        actions = [CALL] * n
        venv.step(actions)
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            venv.step(actions)
            steps += n
        return steps / (time.perf_counter() - t0)

    ours = rate(ToolVectorEnv(num_envs=n, **kwargs))
    base = rate(gym.vector.SyncVectorEnv([lambda: ToolEnv(**kwargs) for _ in range(n)]))
    return {"envs": n, "steps_per_s": ours, "steps_per_s_sync_baseline": base, "speedup": ours / base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--turns", type=int, default=15, help="measured turns (the median turn is reported)")
    ap.add_argument("--step-envs", type=int, default=64)
    ap.add_argument("--step-seconds", type=float, default=3.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    rows = [bench_latency(n, args.latency_ms / 1e3, args.turns) for n in args.envs]
    print(f"\nTool calls: one {args.latency_ms:g} ms call per env per turn "
          "(async = rlf caller, baseline = one at a time)")
    head = ["envs", "async turn s", "sequential s", "speedup", "efficiency", "overhead/call"]
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, [6, 13, 13, 9, 11, 14], strict=True)))
    for r in rows:
        print(
            f"{r['envs']:>6} {r['turn_seconds_async']:>13.4f} {r['turn_seconds_sequential']:>13.3f} "
            f"{r['speedup']:>8.1f}x {r['efficiency']:>11.3f} {r['overhead_per_call_us']:>11.1f} us"
        )
    steps = bench_steps(args.step_envs, args.step_seconds)
    print(f"\nEnv steps/s (instant tool, text mode, {steps['envs']} envs): rlf ToolVectorEnv "
          f"{steps['steps_per_s']:,.0f}/s vs gymnasium SyncVectorEnv {steps['steps_per_s_sync_baseline']:,.0f}/s "
          f"= {steps['speedup']:.1f}x")
    if args.json:
        write_report(args.json, {"tool_calls": rows, "env_steps": steps})


def write_report(path: Path, results: dict[str, object]) -> None:
    """Write `results` plus the machine and rlf_envs version as JSON, atomically."""
    out = {**results, "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                                  "platform": platform.platform()}, "rlf_envs": rlf_envs.__version__}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2))
    tmp.replace(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
