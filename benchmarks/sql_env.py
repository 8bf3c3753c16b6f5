"""rlf/SQL-v0 env steps per second: reused connections + inline queries against the path before, in the same run.

    python benchmarks/sql_env.py [--envs 16 64] [--seconds 3] [--rounds 3] [--cpu] [--rates fast instant ...]
                                 [--json out/sql_env.json]

Each episode is scripted: list_tables -> describe_table -> run_query(gold) -> answer(gold), i.e. four steps,
three SQL tool calls (five queries) and one verifier run (gold and predicted query). Steps/s through a
ToolVectorEnv of N SQL-v0 envs (all calls of a step concurrently) for:
  - fast:        SqlEnv() defaults: reused read-only connections per database, a query run on the event loop
                 while it takes under 2 ms (else again in a worker thread), deterministic results remembered
  - uncached:    SqlEnv(cache_results=False): reused connections and inline queries, but nothing remembered:
                 every query runs and every output is rendered (the scripted episodes repeat their tasks, so
                 "fast" answers most calls from memory; a policy's new queries cost what this row shows)
  - before:      SqlEnv(reuse_connections=False, inline_s=0, cache_results=False): a fresh connection per query,
                 every call in a thread, every query run
  - sync:        gymnasium SyncVectorEnv over the same (fast) SqlEnvs, one env after another
  - instant:     the instant-tool floor, what the env costs with tools that do nothing: ToolEnvs with SQL-v0's
                 tasks, system prompt and tool specs (the same prompts), stepped with the same actions (the same
                 parsing), whose three tools return "done" at once and whose verdict is given at once
  - tools_floor: the floor of earlier runs, Tools-v0 envs with one instant Python tool (pydantic-checked
                 arguments, exact-match verdict) and shorter actions (`scripted_env.instant_tool_rate`)

The actions of each task are built once (what the policy sends is not the env's work); every rate reads them
from the same plans. `--rates` measures only some rates (each rate's share of the floor needs "fast" and
"instant"; the speed-up needs "fast" and "before").
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
from scripted_env import instant_tool_rate, interleaved, report, scripted_rate, tool_call

from rlf_envs.env import ToolEnv, ToolVectorEnv
from rlf_envs.envs.sql import SYSTEM_PROMPT, SqlEnv, sql_tasks, sql_tools
from rlf_envs.rewards.base import Verifier
from rlf_envs.tools.base import Tool, ToolSpec
from rlf_envs.types import Score, Task, ToolStatus, Trajectory

RATES = ("fast", "uncached", "before", "sync", "instant", "tools_floor")
_PLANS: dict[str, list[str]] = {}


def script(env: Any) -> list[str]:
    """The episode's four actions for its task (built once per task)."""
    task = env.trajectory.task
    plan = _PLANS.get(task.id)
    if plan is None:
        table = task.ground_truth.split(" FROM ", 1)[1].split()[0]
        plan = _PLANS[task.id] = [
            tool_call("list_tables"), tool_call("describe_table", table=table),
            tool_call("run_query", sql=task.ground_truth), f"<answer>{task.ground_truth}</answer><|im_end|>"]
    return plan


def all_verified(rewards: Any) -> None:
    assert (rewards == 1.0).all(), rewards  # every scripted episode is verified correct


def tools_ran(env: Any) -> None:
    """Every tool call of the episode succeeded, or gave the one error the scripted plan meets by design (the gold
    query of some tasks returns more rows than `run_query` shows): the verifier runs the answer's query itself, so
    a broken tool would otherwise go unnoticed, and look fast. Checked on every row, the floor's included."""
    for turn in env.trajectory.turns:
        for result in turn.results:
            assert result.status is ToolStatus.OK or (
                result.call.name == "run_query" and " rows: add LIMIT" in result.content), result


class InstantTool(Tool):
    """A tool that does nothing, under a SQL tool's name and spec (so the prompt is SQL-v0's)."""

    idempotent = True
    validates_arguments = True

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec

    async def call(self, arguments: dict[str, Any]) -> str:
        return "done"


class InstantVerdict(Verifier):
    """A verdict given at once: 1 for an answer."""

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        return Score(float(trajectory.answer is not None))


def floor_env(**kw: Any) -> ToolEnv:
    """SQL-v0's tasks, prompt and tool specs without SQL: tools that do nothing and an instant verdict."""
    tools = [InstantTool(t.spec) for t in sql_tools()]
    return ToolEnv(tools=tools, tasks=sql_tasks(kw["split"]), system_prompt=SYSTEM_PROMPT, verifier=InstantVerdict(),
                   max_turns=kw["max_turns"], max_total_tokens=kw["max_total_tokens"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3, help="measurements of each rate, interleaved (median)")
    ap.add_argument("--rates", nargs="+", choices=RATES, default=list(RATES), help="the rates to measure")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cpu", action="store_true", help="steps per CPU-second of this process instead of per wall "
                    "second (every SQL query and the floor's tool run in-process, so this is the whole cost)")
    args = ap.parse_args()
    if args.cpu:
        scripted_env.CLOCK = time.process_time
    secs = args.seconds
    base: dict[str, Any] = {"split": "train", "max_turns": 8, "max_total_tokens": 1 << 30}
    before = {**base, "reuse_connections": False, "inline_s": 0.0, "cache_results": False}

    def venv(cls: Any, make: Callable[..., Any], kw: dict[str, Any]) -> Callable[[int], Any]:
        return lambda n: cls([lambda: make(**kw) for _ in range(n)])

    uncached = {**base, "cache_results": False}
    make = {"fast": venv(ToolVectorEnv, SqlEnv, base), "before": venv(ToolVectorEnv, SqlEnv, before),
            "uncached": venv(ToolVectorEnv, SqlEnv, uncached),
            "sync": venv(gym.vector.SyncVectorEnv, SqlEnv, base), "instant": venv(ToolVectorEnv, floor_env, base)}
    rows: dict[int, dict[str, float]] = {}
    for n in args.envs:
        measure: dict[str, Callable[[], float]] = {}
        for name in args.rates:
            if name == "tools_floor":
                measure[name] = lambda n=n: instant_tool_rate(n, secs, steps=4, max_turns=8)
            else:
                measure[name] = lambda mk=make[name], n=n: scripted_rate(mk(n), secs, script, all_verified, tools_ran)
        rows[n] = interleaved(measure, args.rounds)
    labels = {"fast": "SQL-v0, reuse + inline + cache (default)",
              "uncached": "SQL-v0, reuse + inline, nothing remembered",
              "before": "SQL-v0, connection per query + thread (before)",
              "sync": "gymnasium SyncVectorEnv, SQL-v0 (default)",
              "instant": "SQL-v0 actions, instant tools (floor)",
              "tools_floor": "Tools-v0, instant tool (earlier floor)"}
    extra: dict[str, Any] = {"cpus": os.cpu_count(), "load_avg_1m_at_end": os.getloadavg()[0],
                             "clock": "cpu" if args.cpu else "wall"}
    if {"fast", "tools_floor"} <= set(args.rates):
        extra["share_of_tools_v0_floor"] = {str(n): r["fast"] / r["tools_floor"] for n, r in rows.items()}
    if {"fast", "before", "instant"} <= set(args.rates):
        report("SQL-v0", "sql", "4-step episodes (3 SQL tool calls + verified answer)", rows, labels, args.json,
               after="fast", before="before", extra=extra)
        for n, share in extra.get("share_of_tools_v0_floor", {}).items():
            print(f"{n} envs: fast runs at {share:.3f} of the earlier Tools-v0 floor ({1 / share:.2f}x slower)")
        if "uncached" in args.rates:
            extra["uncached_share_of_instant"] = {str(n): r["uncached"] / r["instant"] for n, r in rows.items()}
            for n, share in extra["uncached_share_of_instant"].items():
                print(f"{n} envs: with nothing remembered SQL-v0 runs at {share:.3f} of the floor "
                      f"({1 / share:.2f}x slower), {rows[int(n)]['uncached'] / rows[int(n)]['before']:.2f}x the "
                      "path before")
    else:  # a subset: the rates and the ratios to the floor that were measured
        for n, rates in rows.items():
            print(f"\nrlf/SQL-v0 steps/s, {n} envs:")
            for name, rate in rates.items():
                share = f"   -> fast runs at {rates['fast'] / rate:.3f} of it ({rate / rates['fast']:.2f}x slower)" \
                    if "fast" in rates and name in ("instant", "tools_floor") else ""
                print(f"  {labels[name]:<44} {rate:>10,.1f}/s{share}")
        if args.json:
            from tool_calls import write_report

            write_report(args.json, {"sql_env": {"rows": {str(n): {f"{k}_steps_per_s": v for k, v in r.items()}
                                                          for n, r in rows.items()}, **extra}})
    print(f"load average at the end: {os.getloadavg()[0]:.2f} ({'CPU' if args.cpu else 'wall'} clock)")


if __name__ == "__main__":
    main()
