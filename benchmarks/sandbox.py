"""Per-run cost of the sandbox vs a plain fork+exec of the same program, measured in the same run.

    python benchmarks/sandbox.py [--runs 30] [--concurrency 1 4] [--json out/sandbox.json]

Ways to run the same small program (print a sum), and to judge a solution against 3 asserts:
  plain     `python -I main.py` with asyncio.create_subprocess_exec, i.e. fork+exec (no limits: the baseline)
  pooled    `rlf_envs.sandbox.run_python` through the warm pool (the default): as root a direct worker (one fork of
            the clean template, no supervisor), else a supervisor forked from it and its forked worker
  supervised  the same through a pool with direct workers off (`SandboxPool(direct=False)`: every run supervised)
  cold      `run_python(..., pool=False)`: a new supervisor interpreter and a new worker interpreter (before)
  judged    `rlf_envs.sandbox.run_tests` pooled (the trusted test harness and its RPC on top)
  judged_cold  the same, pool=False
Reported: median and p90 seconds per run and runs/s at each concurrency, and the ratio to `plain`.
The guards that were in force are printed: the cost depends on them (namespaces, uid switch).
Then where a pooled run's CPU goes (`--breakdown-runs` sequential runs), for `pooled` and `supervised`: the
trainer process (this one), the zygote (the forks), and each run's processes (the zygote's reaped children: CPU
time, of which kernel time, and minor page faults, read from /proc/<zygote>/stat).

    python benchmarks/sandbox.py --cleanup-files 75000 [--cleanup-episodes 3]

Clean-up off the step path (issue 40): rlf/Code-v0 episodes whose python call creates N small files in the work dir;
the time of the `step` that answers (and so ends the episode and removes the work dir), with the work dir removed
inline by `shutil.rmtree` (before: the baseline, patched in for its episodes) and by `cleanup.discard` (now: a rename,
the reaper deletes in the background), beside an honest episode's answering step; episodes alternate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from rlf_envs.sandbox import SandboxLimits, SandboxPool, default_pool, run_python, run_tests

CODE = "print(sum(range(1000)))\n"
SOLUTION = "def add(a, b):\n    return a + b\n"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]
LIMITS = SandboxLimits(timeout_s=30.0, cpu_s=30)


async def plain() -> None:
    with tempfile.TemporaryDirectory(prefix="rlf_bench_") as d:
        Path(d, "main.py").write_text(CODE)
        proc = await asyncio.create_subprocess_exec(sys.executable, "-I", "main.py", cwd=d,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        assert out.strip() == b"499500", out


async def pooled(pool: SandboxPool | None = None) -> None:
    r = await run_python(CODE, "", LIMITS, pool=pool)
    assert r.stdout.strip() == "499500" and "fresh_worker" in r.guards, r


SUPERVISED: SandboxPool | None = None  # made in main (direct workers off)


async def supervised() -> None:
    await pooled(SUPERVISED)


async def cold() -> None:
    r = await run_python(CODE, "", LIMITS, pool=False)
    assert r.stdout.strip() == "499500" and "fresh_worker" not in r.guards, r


async def judged() -> None:
    r = await run_tests(SOLUTION, TESTS, LIMITS)
    assert r.test_results == (True, True, True), r


async def judged_cold() -> None:
    r = await run_tests(SOLUTION, TESTS, LIMITS, pool=False)
    assert r.test_results == (True, True, True), r


async def measure(fn: Callable[[], Awaitable[None]], runs: int, concurrency: int) -> dict[str, float]:
    await fn()  # warm-up (imports, page cache)
    gate = asyncio.Semaphore(concurrency)
    times: list[float] = []

    async def one() -> None:
        async with gate:
            t0 = time.perf_counter()
            await fn()
            times.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(runs)))
    wall = time.perf_counter() - t0
    times.sort()
    return {"median_s": statistics.median(times), "p90_s": times[int(0.9 * (len(times) - 1))],
            "runs_per_s": runs / wall}


def _zygote_stat(pid: int) -> tuple[int, int, int, int, int, int]:
    """(own minor faults, children's minor faults, own utime, own stime, children's utime, children's stime) in
    clock ticks, from /proc/<pid>/stat (children: reaped descendants, i.e. the supervisors and their workers)."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(f[7]), int(f[8]), int(f[11]), int(f[12]), int(f[13]), int(f[14])


async def breakdown(runs: int, pool: SandboxPool | None = None) -> dict[str, float]:
    """Per pooled run (sequential): CPU ms of this process, the zygote, and the runs' own processes. `pool`: the
    default pool if None."""
    for _ in range(5):
        await pooled(pool)
    pool = pool or default_pool()
    assert pool is not None and pool.zygote_pid is not None, "needs the default pool (unset RLF_SANDBOX_POOL=0)"
    zygote = pool.zygote_pid
    await asyncio.sleep(1.5)  # the warm-up's supervisors reaped
    z0, me0, t0 = _zygote_stat(zygote), os.times(), time.perf_counter()
    for _ in range(runs):
        await pooled(pool)
    wall = time.perf_counter() - t0
    await asyncio.sleep(1.5)  # the zygote reaps the last supervisors (it checks every second when idle)
    z1, me1 = _zygote_stat(zygote), os.times()
    ms = 1000 / os.sysconf("SC_CLK_TCK") / runs
    return {"wall_ms": 1000 * wall / runs,
            "trainer_cpu_ms": 1000 * (me1.user + me1.system - me0.user - me0.system) / runs,
            "zygote_cpu_ms": (z1[2] + z1[3] - z0[2] - z0[3]) * ms,
            "run_processes_cpu_ms": (z1[4] + z1[5] - z0[4] - z0[5]) * ms,
            "run_processes_kernel_ms": (z1[5] - z0[5]) * ms,
            "run_processes_minor_faults": (z1[1] - z0[1]) / runs,
            "zygote_minor_faults": (z1[0] - z0[0]) / runs}


MANY_FILES = ("import os\nfor i in range({n}):\n    os.close(os.open(f'f{{i}}', os.O_WRONLY | os.O_CREAT, 0o600))\n"
              "print(len(os.listdir('.')))\n")


def cleanup_step(n: int, episodes: int) -> dict[str, float]:
    """Median seconds of the answering `step` per way of removing the work dir (see the module docstring)."""
    import shutil

    from rlf_envs.envs.code import CodeEnv
    from rlf_envs.sandbox import SandboxDir, cleanup, quota
    from rlf_envs.types import Task

    def action(code: str) -> str:
        return f"<tool_call>\n{json.dumps({'name': 'python', 'arguments': {'code': code}})}\n</tool_call><|im_end|>"

    limits = SandboxLimits(timeout_s=120.0, cpu_s=120, disk_mb=max(64, n // 1024 + 32))
    env = CodeEnv(tasks=[Task("t", "Print 1.", "1", meta={"check": "numeric"})], limits=limits, max_turns=3)
    discard = SandboxDir.remove

    def inline_rmtree(self: SandboxDir) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    times: dict[str, list[float]] = {"honest": [], "rmtree_inline": [], "reaper": []}
    reaper_s: list[float] = []
    for _ in range(episodes):
        for mode in times:
            # before: the work dir on the host's disk (no quota) and removed inline
            SandboxDir.remove = inline_rmtree if mode == "rmtree_inline" else discard  # type: ignore[method-assign]
            shared = quota.is_shared_base
            if mode == "rmtree_inline":
                quota.is_shared_base = lambda path: False  # type: ignore[assignment]
            try:
                env.reset(seed=0, options={"task_index": 0})
                obs, *_ = env.step(action("print(1)" if mode == "honest" else MANY_FILES.format(n=n)))
                assert ("[stdout]\n1" if mode == "honest" else f"[stdout]\n{n + 1}") in obs, obs
                t0 = time.perf_counter()
                _, reward, term, _, _ = env.step("<answer>1</answer><|im_end|>")
                times[mode].append(time.perf_counter() - t0)
                assert term and reward == 1.0
            finally:
                SandboxDir.remove = discard  # type: ignore[method-assign]
                quota.is_shared_base = shared  # type: ignore[assignment]
            t1 = time.perf_counter()
            cleanup.flush(300)
            if mode == "reaper":
                reaper_s.append(time.perf_counter() - t1)
    env.close()
    out = {f"{k}_step_s": statistics.median(v) for k, v in times.items()}
    out["reaper_background_s"] = statistics.median(reaper_s)
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--breakdown-runs", type=int, default=200, help="sequential pooled runs for the CPU breakdown "
                    "(0: skip it)")
    ap.add_argument("--cleanup-files", type=int, default=0, help="only the clean-up benchmark, with this many files "
                    "per hostile episode (0: the per-run cost benchmark)")
    ap.add_argument("--cleanup-episodes", type=int, default=3)
    args = ap.parse_args()
    if args.cleanup_files:
        c = await asyncio.to_thread(cleanup_step, args.cleanup_files, args.cleanup_episodes)
        print(f"answering step of a Code-v0 episode (median of {args.cleanup_episodes}), load {os.getloadavg()[0]:.1f}:"
              f"\n  honest episode:                         {c['honest_step_s'] * 1000:8.1f} ms"
              f"\n  {args.cleanup_files} files, rmtree inline (before): {c['rmtree_inline_step_s'] * 1000:8.1f} ms"
              f"\n  {args.cleanup_files} files, rename + reaper (now):  {c['reaper_step_s'] * 1000:8.1f} ms "
              f"({c['reaper_step_s'] / c['rmtree_inline_step_s']:.3f}x before, "
              f"{c['reaper_step_s'] / c['honest_step_s']:.2f}x honest)"
              f"\n  the reaper's background removal:        {c['reaper_background_s'] * 1000:8.1f} ms")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"cleanup": c, "files": args.cleanup_files, "load_avg": os.getloadavg()},
                                            indent=2))
        return
    global SUPERVISED
    SUPERVISED = SandboxPool(direct=False)
    probe = await run_python("pass", "", LIMITS)
    print(f"guards in force: {', '.join(probe.guards)}")
    if probe.missing_guards:
        print(f"missing: {', '.join(probe.missing_guards)}")
    rows = []
    for c in args.concurrency:
        base = await measure(plain, args.runs, c)
        for name, fn in (("plain", plain), ("pooled", pooled), ("supervised", supervised), ("cold", cold),
                         ("judged", judged), ("judged_cold", judged_cold)):
            m = base if name == "plain" else await measure(fn, args.runs, c)
            rows.append({"mode": name, "concurrency": c, **m, "ratio_vs_plain": m["median_s"] / base["median_s"]})
    print(f"\n{'mode':<12} {'conc':>4} {'median':>9} {'p90':>9} {'runs/s':>8} {'x plain':>8}")
    for r in rows:
        print(f"{r['mode']:<12} {r['concurrency']:>4} {r['median_s'] * 1000:>7.1f}ms {r['p90_s'] * 1000:>7.1f}ms "
              f"{r['runs_per_s']:>8.1f} {r['ratio_vs_plain']:>7.2f}x")
    cpu: dict[str, dict[str, float]] = {}
    if args.breakdown_runs:
        cpu = {"pooled": await breakdown(args.breakdown_runs), "supervised": await breakdown(args.breakdown_runs,
                                                                                           SUPERVISED)}
    for name, c in cpu.items():
        print(f"\nper {name} run, {args.breakdown_runs} sequential runs: {c['wall_ms']:.1f} ms wall; CPU: trainer "
              f"{c['trainer_cpu_ms']:.2f} ms, zygote {c['zygote_cpu_ms']:.2f} ms, the run's processes "
              f"{c['run_processes_cpu_ms']:.2f} ms (kernel {c['run_processes_kernel_ms']:.2f} ms, "
              f"{c['run_processes_minor_faults']:.0f} minor page faults)")
    SUPERVISED.close()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "breakdown": cpu, "guards": probe.guards,
                                         "missing_guards": probe.missing_guards,
                                         "runs": args.runs, "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
                                         "python": platform.python_version()}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
