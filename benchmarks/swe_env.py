"""rlf/SWE-v0 at scale: episodes/s, env-step p50/p99 and the env's overhead per tool call against bare session
execs measured in the same run.

    python benchmarks/swe_env.py [--concurrency 16 64] [--calls 20] [--backend local] [--json out/swe_env.json]

For each concurrency N: N episodes of rlf's shipped train tasks at once (asyncio, one SweEnv each, `astep`, all on
rlf's loop), as a batch: each makes `--calls` tool calls (bash `true`, `ls | head`, `python3 -c pass`, an append +
`du`, in turn) and, once every episode's tool phase is done, `submit()` (workspace diff + hidden F2P/P2P run on a fresh
session). Reported:

- episodes/s (wall clock of the whole batch), env-step p50/p99 of the tool steps;
- the env's overhead per tool call beyond the command itself: each step's wall time minus the time spent inside
  `Session.exec` during it (measured around the session's own exec), p50/p99 (goal: p50 <= 25 ms), and the
  event-loop thread's CPU time per call (the env's own work, whatever the machine's load);
- baseline: N bare sessions running the same number of `exec("true")` calls at once, straight on the session API
  (no env, no tool layer, no hidden runs beside them): a `bash true` step's p50 against a bare exec's p50;
- the share of the batch's time in session start (the first call of an episode), tool execs, and the final step
  (diff + hidden-test run);
- disk: the workspace's size (`du -sk` of the workdir at the end of an episode) and rlf's repository cache.

Docker rows run when `--backend docker` and an engine answers. The numbers are for the machine they ran on
(load matters: say what else ran).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import statistics
import time
from pathlib import Path
from typing import Any

import gymnasium as gym

import rlf_envs  # noqa: F401 - registers the ids
from rlf_envs import runtime
from rlf_envs.envs.swe.baseline import tool_call
from rlf_envs.envs.swe.env import SweLimits, default_image, session_spec, shared_backend
from rlf_envs.envs.swe.tasks import SweTask, cache_dir, shipped_tasks

#: seconds spent inside Session.exec during the current env step (the command itself, as the session sees it)
_IN_EXEC: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar("in_exec", default=None)


def _time_execs() -> None:
    """Wrap the session classes' exec so a step's own command time is known (overhead = step - command)."""
    from rlf_envs.sandbox.sessions.local import LocalSession

    classes: list[Any] = [LocalSession]
    try:
        from rlf_envs.sandbox.sessions.docker import DockerSession

        classes.append(DockerSession)
    except ImportError:
        pass
    for cls in classes:
        orig = cls.exec

        async def timed(self: Any, *a: Any, _orig: Any = orig, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await _orig(self, *a, **kw)
            finally:
                acc = _IN_EXEC.get()
                if acc is not None:
                    acc.append(time.perf_counter() - t0)

        cls.exec = timed


def _q(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def actions(calls: int) -> list[str]:
    out = []
    for i in range(calls):
        k = i % 4
        if k == 0:
            out.append(tool_call("bash", command="true"))
        elif k == 1:
            out.append(tool_call("bash", command="ls | head -3"))
        elif k == 2:
            out.append(tool_call("bash", command="python3 -c pass"))
        else:
            out.append(tool_call("bash", command="echo '# x' >> NOTES.txt && du -sk . | cut -f1"))
    return out


_TASKS: list[Any] = []


def bench_tasks() -> list[Any]:
    return _TASKS or shipped_tasks("train")


async def run_envs(n: int, calls: int, backend: str) -> dict[str, Any]:
    tasks = bench_tasks()
    envs = [gym.make("rlf/SWE-v0", tasks=tasks, backend=backend, max_turns=calls + 2).unwrapped for _ in range(n)]
    plan = actions(calls)
    first: list[float] = []
    steps: list[float] = []
    overhead: list[float] = []
    true_steps: list[float] = []
    final: list[float] = []
    disk: list[int] = []
    rewards: list[float] = []
    infra = 0

    tools_done = 0
    all_tools_done = asyncio.Event()

    async def episode(k: int, env: Any) -> None:
        nonlocal infra, tools_done
        await env.areset(options={"task_index": k % len(tasks)})
        for i, a in enumerate(plan):
            acc: list[float] = []
            token = _IN_EXEC.set(acc)
            t0 = time.perf_counter()
            try:
                obs, *_ = await env.astep(a)
            finally:
                _IN_EXEC.reset(token)
            dt = time.perf_counter() - t0
            (first if i == 0 else steps).append(dt)
            if i > 0 and acc:
                overhead.append(dt - sum(acc))
            if i > 0 and i % 4 == 0:
                true_steps.append(dt)
            if i == len(plan) - 1:
                try:
                    disk.append(int(obs.split("<tool_response>\n", 1)[1].split("\n", 1)[0]))
                except (IndexError, ValueError):
                    pass
        tools_done += 1
        if tools_done == n:
            all_tools_done.set()
        await all_tools_done.wait()  # a batch: every episode's tool phase, then every episode's hidden run
        t0 = time.perf_counter()
        _, r, _, _, info = await env.astep(tool_call("submit"))
        final.append(time.perf_counter() - t0)
        rewards.append(r)
        infra += bool(info.get("infra_failed"))

    t0, cpu0 = time.perf_counter(), time.thread_time()
    await asyncio.gather(*(episode(k, e) for k, e in enumerate(envs)))
    wall, loop_cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    for e in envs:
        e.close()
    busy = sum(first) + sum(steps) + sum(final)
    return {"episodes": n, "wall_s": wall, "episodes_per_s": n / wall, "step_p50_ms": 1e3 * _q(steps, 0.5),
            "step_p99_ms": 1e3 * _q(steps, 0.99), "bash_true_p50_ms": 1e3 * _q(true_steps, 0.5),
            "env_overhead_p50_ms": 1e3 * _q(overhead, 0.5), "env_overhead_p99_ms": 1e3 * _q(overhead, 0.99),
            "loop_cpu_per_call_ms": 1e3 * loop_cpu / (n * (calls + 1)),
            "first_call_p50_ms": 1e3 * _q(first, 0.5), "final_p50_ms": 1e3 * _q(final, 0.5),
            "share_session_start": sum(first) / busy, "share_tool_execs": sum(steps) / busy,
            "share_hidden_tests": sum(final) / busy, "workspace_kb_p50": _q([float(d) for d in disk], 0.5),
            "infra_failed": infra, "mean_reward_untouched": statistics.fmean(rewards) if rewards else float("nan")}


async def run_bare(n: int, calls: int, backend: str) -> dict[str, Any]:
    t = SweTask.from_meta(bench_tasks()[0])
    spec, _ = session_spec(t, default_image(), SweLimits(), backend)
    b = shared_backend(backend)
    lat: list[float] = []

    async def one() -> None:
        s = await b.create(spec)
        try:
            for _ in range(calls):
                t0 = time.perf_counter()
                await s.exec("true")
                lat.append(time.perf_counter() - t0)
        finally:
            await s.aclose()

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return {"bare_exec_p50_ms": 1e3 * _q(lat, 0.5), "bare_exec_p99_ms": 1e3 * _q(lat, 0.99),
            "bare_wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--backend", default="local")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--task-file", help="SWE-bench-style JSONL instead of rlf's shipped train split")
    args = ap.parse_args()
    if args.task_file:
        from rlf_envs.envs.swe.tasks import load_swe_jsonl

        _TASKS.extend(load_swe_jsonl(args.task_file))
    _time_execs()
    rows = []
    for n in args.concurrency:
        bare = runtime.run(run_bare(n, args.calls, args.backend))
        env = runtime.run(run_envs(n, args.calls, args.backend))
        row = {"backend": args.backend, "concurrency": n, **env, **bare,
               "env_vs_bare_ratio": env["bash_true_p50_ms"] / bare["bare_exec_p50_ms"]}
        rows.append(row)
        print(f"N={n:>3} {args.backend}: {row['episodes_per_s']:.2f} episodes/s, step p50 {row['step_p50_ms']:.0f} ms "
              f"p99 {row['step_p99_ms']:.0f} ms | env overhead beyond the command p50 "
              f"{row['env_overhead_p50_ms']:.1f} ms p99 {row['env_overhead_p99_ms']:.1f} ms, loop CPU "
              f"{row['loop_cpu_per_call_ms']:.1f} ms/call | bash true "
              f"{row['bash_true_p50_ms']:.0f} ms vs bare exec {row['bare_exec_p50_ms']:.0f} ms "
              f"({row['env_vs_bare_ratio']:.2f}x) | time: start {row['share_session_start']:.0%}, tools "
              f"{row['share_tool_execs']:.0%}, hidden tests {row['share_hidden_tests']:.0%} | workspace "
              f"{row['workspace_kb_p50']:.0f} kB | infra failed {row['infra_failed']}", flush=True)
    repo_cache = sum(p.stat().st_size for p in (cache_dir() / "swe").rglob("*") if p.is_file())
    print(f"rlf repository cache ({cache_dir() / 'swe'}): {repo_cache / 1e6:.2f} MB for all tasks seen")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "repo_cache_bytes": repo_cache}, indent=1))


if __name__ == "__main__":
    main()
