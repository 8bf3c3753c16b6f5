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
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
from scripted_env import instant_tool_rate, report, scripted_rate, tool_call

from rlf_envs.env import ToolVectorEnv
from rlf_envs.envs.sql import SqlEnv, sql_tasks
from rlf_envs.rewards.sql import run_readonly_query


def script(env: Any) -> list[str]:
    task = env.trajectory.task
    table = task.ground_truth.split(" FROM ", 1)[1].split()[0]
    return [tool_call("list_tables"), tool_call("describe_table", table=table),
            tool_call("run_query", sql=task.ground_truth), f"<answer>{task.ground_truth}</answer><|im_end|>"]


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
    rates = {
        "ours": scripted_rate(ToolVectorEnv([lambda: SqlEnv(**kwargs) for _ in range(n)]), secs, script),
        "sync": scripted_rate(gym.vector.SyncVectorEnv([lambda: SqlEnv(**kwargs) for _ in range(n)]), secs, script),
        "instant": instant_tool_rate(n, secs, steps=4, max_turns=8),
        "raw": raw_queries_per_s(secs),
    }
    report("SQL-v0", "sql", n, "4-step episodes (3 SQL tool calls + verified answer)", rates,
           ("sqlite", "raw SQLite, same queries"), args.json)


if __name__ == "__main__":
    main()
