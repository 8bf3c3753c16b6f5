"""rlf/SQL-v0 env steps per second, with baselines measured in the same run.

    python benchmarks/sql_env.py [--envs 64] [--seconds 3] [--json out/sql_env.json]

Each episode is scripted: list_tables -> describe_table -> run_query(gold) -> answer(gold), i.e. four steps,
three SQL tool calls (each on a fresh read-only connection in a worker thread) and one verifier run (gold and
predicted query). Rates are steps/s through:
  - rlf ToolVectorEnv of N SQL-v0 envs (all calls of a step concurrently);
  - gymnasium SyncVectorEnv over the same SqlEnvs (one env after another): the baseline;
  - rlf ToolVectorEnv of N Tools-v0 envs with an instant Python tool: the env machinery without SQLite;
  - and the raw work: the same SQLite queries run directly with `run_readonly_query`, one after another.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
from tool_calls import make_tool, write_report

from rlf_envs.env import ToolEnv, ToolVectorEnv
from rlf_envs.envs.sql import SqlEnv, sql_tasks
from rlf_envs.rewards.sql import run_readonly_query
from rlf_envs.types import Task


def _call(name: str, **args: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call><|im_end|>"


def script(task: Task) -> list[str]:
    table = task.ground_truth.split(" FROM ", 1)[1].split()[0]
    return [_call("list_tables"), _call("describe_table", table=table), _call("run_query", sql=task.ground_truth),
            f"<answer>{task.ground_truth}</answer><|im_end|>"]


def rate(venv: gym.vector.VectorEnv, seconds: float, scripted: bool = True) -> float:
    envs = [e.unwrapped for e in venv.envs]  # type: ignore[attr-defined]
    steps, seed = 0, 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or steps == 0:
        venv.reset(seed=seed)
        seed += 1
        plans = [script(e.trajectory.task) if scripted else [_call("work", x=1)] * 3 + ["<answer>x</answer>"]
                 for e in envs]
        for k in range(4):
            venv.step([p[k] for p in plans])
            steps += len(envs)
    return steps / (time.perf_counter() - t0)


def raw_queries_per_s(seconds: float) -> float:
    """The three tool queries + the verifier's two, run directly (the SQLite work of one episode)."""
    tasks = sql_tasks("train")
    n, i, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        t = tasks[i % len(tasks)]
        i += 1
        db = t.meta["db_path"]
        run_readonly_query(db, "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
        run_readonly_query(db, "SELECT * FROM sqlite_master LIMIT 3")
        for _ in range(3):
            run_readonly_query(db, t.ground_truth)
        n += 4  # as many steps as one scripted episode
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    n, secs = args.envs, args.seconds
    kwargs: dict[str, Any] = {"split": "train", "max_turns": 8, "max_total_tokens": 1 << 30}
    ours = rate(ToolVectorEnv([lambda: SqlEnv(**kwargs) for _ in range(n)]), secs)
    base = rate(gym.vector.SyncVectorEnv([lambda: SqlEnv(**kwargs) for _ in range(n)]), secs)

    tasks = [Task(id=str(i), question=f"q{i}", ground_truth=["x"]) for i in range(8)]
    work = make_tool(0.0)
    instant = rate(ToolVectorEnv([lambda: ToolEnv(tools=[work], tasks=tasks, max_turns=8) for _ in range(n)]), secs,
                   scripted=False)
    raw = raw_queries_per_s(secs)
    res = {"envs": n, "sql_vector_steps_per_s": ours, "sql_sync_vector_steps_per_s": base,
           "instant_tool_vector_steps_per_s": instant, "raw_sqlite_episode_steps_per_s": raw,
           "speedup_vs_sync": ours / base, "share_of_instant_tool": ours / instant, "vs_raw_sqlite": ours / raw}
    print(f"\nrlf/SQL-v0 steps/s, {n} envs, scripted 4-step episodes (3 SQL tool calls + verified answer):")
    print(f"  rlf ToolVectorEnv          {ours:>9,.0f}/s")
    print(f"  gymnasium SyncVectorEnv    {base:>9,.0f}/s   -> rlf {ours / base:.2f}x")
    print(f"  Tools-v0, instant tool     {instant:>9,.0f}/s   -> SQL-v0 runs at {ours / instant:.2f} of it")
    print(f"  raw SQLite, same queries   {raw:>9,.0f}/s   -> SQL-v0 runs at {ours / raw:.2f} of it")
    if args.json:
        write_report(args.json, {"sql_env": res})

if __name__ == "__main__":
    main()
