"""rlf/SWE-v0 at scale: episodes/s, env-step p50/p99 and the env's overhead per tool call against bare session
execs measured in the same run.

    python benchmarks/swe_env.py [--concurrency 16 64] [--calls 20] [--backend local] [--json out/swe_env.json]

For each concurrency N: N episodes of rlf's shipped train tasks at once (asyncio, one SweEnv each, `astep`), each
made of `--calls` tool calls (bash `true`, `ls | head`, `python3 -c pass`, an append + `du`, in turn)
and then `submit()` (workspace diff + hidden F2P/P2P run on a fresh session). Reported:

- episodes/s (wall clock of the whole batch), env-step p50/p99 of the tool steps;
- baseline: N bare sessions running the same number of `exec("true")` calls at once, straight on the session API
  (no env, no tool layer); the env's overhead per call is the p50 of a `bash true` step minus the p50 of a bare
  `exec("true")` at the same concurrency (goal: <= 25 ms);
- the share of the batch's time in session start (the first call of an episode), tool execs, and the final step
  (diff + hidden-test run);
- disk: the workspace's size (`du -sk` of the workdir at the end of an episode) and rlf's repository cache.

Docker rows run when `--backend docker` and an engine answers. The numbers are for the machine they ran on
(load matters: say what else ran).
"""

from __future__ import annotations

import argparse
import asyncio
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
    true_steps: list[float] = []
    final: list[float] = []
    disk: list[int] = []
    rewards: list[float] = []
    infra = 0

    async def episode(k: int, env: Any) -> None:
        nonlocal infra
        await env.areset(options={"task_index": k % len(tasks)})
        for i, a in enumerate(plan):
            t0 = time.perf_counter()
            obs, *_ = await env.astep(a)
            dt = time.perf_counter() - t0
            (first if i == 0 else steps).append(dt)
            if i > 0 and i % 4 == 0:
                true_steps.append(dt)
            if i == len(plan) - 1:
                try:
                    disk.append(int(obs.split("<tool_response>\n", 1)[1].split("\n", 1)[0]))
                except (IndexError, ValueError):
                    pass
        t0 = time.perf_counter()
        _, r, _, _, info = await env.astep(tool_call("submit"))
        final.append(time.perf_counter() - t0)
        rewards.append(r)
        infra += bool(info.get("infra_failed"))

    t0 = time.perf_counter()
    await asyncio.gather(*(episode(k, e) for k, e in enumerate(envs)))
    wall = time.perf_counter() - t0
    for e in envs:
        e.close()
    busy = sum(first) + sum(steps) + sum(final)
    return {"episodes": n, "wall_s": wall, "episodes_per_s": n / wall, "step_p50_ms": 1e3 * _q(steps, 0.5),
            "step_p99_ms": 1e3 * _q(steps, 0.99), "bash_true_p50_ms": 1e3 * _q(true_steps, 0.5),
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
    rows = []
    for n in args.concurrency:
        bare = runtime.run(run_bare(n, args.calls, args.backend))
        env = runtime.run(run_envs(n, args.calls, args.backend))
        row = {"backend": args.backend, "concurrency": n, **env, **bare,
               "overhead_per_call_ms": env["bash_true_p50_ms"] - bare["bare_exec_p50_ms"],
               "env_vs_bare_ratio": env["bash_true_p50_ms"] / bare["bare_exec_p50_ms"]}
        rows.append(row)
        print(f"N={n:>3} {args.backend}: {row['episodes_per_s']:.2f} episodes/s, step p50 {row['step_p50_ms']:.0f} ms "
              f"p99 {row['step_p99_ms']:.0f} ms | bash true {row['bash_true_p50_ms']:.0f} ms vs bare exec "
              f"{row['bare_exec_p50_ms']:.0f} ms -> overhead {row['overhead_per_call_ms']:.1f} ms/call "
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
