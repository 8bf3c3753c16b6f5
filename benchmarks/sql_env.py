"""rlf/SQL-v0 env steps per second: reused connections + inline queries against the path before, in the same run.

    python benchmarks/sql_env.py [--envs 16 64] [--seconds 3] [--rounds 3] [--json out/sql_env.json]

Each episode is scripted: list_tables -> describe_table -> run_query(gold) -> answer(gold), i.e. four steps,
three SQL tool calls (five queries) and one verifier run (gold and predicted query). Steps/s through a
ToolVectorEnv of N SQL-v0 envs (all calls of a step concurrently) for:
  - fast:    SqlEnv() defaults: reused read-only connections per database, a query run on the event loop
             while it takes under 2 ms (else again in a worker thread), deterministic results remembered
  - before:  SqlEnv(reuse_connections=False, inline_s=0, cache_results=False): a fresh connection per query,
             every call in a thread, every query run
  - sync:    gymnasium SyncVectorEnv over the same (fast) SqlEnvs, one env after another
  - instant: Tools-v0 envs with an instant Python tool: the env machinery alone, the floor
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import scripted_env
from scripted_env import compare_rows, report, tool_call

from rlf_envs.env import ToolVectorEnv
from rlf_envs.envs.sql import SqlEnv


def script(env: Any) -> list[str]:
    task = env.trajectory.task
    table = task.ground_truth.split(" FROM ", 1)[1].split()[0]
    return [tool_call("list_tables"), tool_call("describe_table", table=table),
            tool_call("run_query", sql=task.ground_truth), f"<answer>{task.ground_truth}</answer><|im_end|>"]


def all_verified(rewards: Any) -> None:
    assert (rewards == 1.0).all(), rewards  # every scripted episode is verified correct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3, help="measurements of each rate, interleaved (median)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cpu", action="store_true", help="steps per CPU-second of this process instead of per wall "
                    "second (every SQL query and the floor's tool run in-process, so this is the whole cost)")
    args = ap.parse_args()
    if args.cpu:
        scripted_env.CLOCK = time.process_time
    secs = args.seconds
    base: dict[str, Any] = {"split": "train", "max_turns": 8, "max_total_tokens": 1 << 30}
    before = {**base, "reuse_connections": False, "inline_s": 0.0, "cache_results": False}
    def venv(cls: Any, kw: dict[str, Any]) -> Callable[[int], Any]:
        return lambda n: cls([lambda: SqlEnv(**kw) for _ in range(n)])

    rows = compare_rows(args.envs, {"fast": venv(ToolVectorEnv, base), "before": venv(ToolVectorEnv, before),
                                    "sync": venv(gym.vector.SyncVectorEnv, base)},
                        secs, args.rounds, script, all_verified, steps=4, max_turns=8)
    labels = {"fast": "SQL-v0, reuse + inline + cache (default)",
              "before": "SQL-v0, connection per query + thread (before)",
              "sync": "gymnasium SyncVectorEnv, SQL-v0 (default)", "instant": "Tools-v0, instant tool (floor)"}
    report("SQL-v0", "sql", "4-step episodes (3 SQL tool calls + verified answer)", rows, labels, args.json,
           after="fast", before="before", extra={"cpus": os.cpu_count(), "load_avg_1m_at_end": os.getloadavg()[0],
                                                 "clock": "cpu" if args.cpu else "wall"})


if __name__ == "__main__":
    main()
