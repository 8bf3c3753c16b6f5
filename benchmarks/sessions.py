"""Sandbox sessions: create and exec latency and episodes/s, local and docker, beside bare process starts measured in
the same run.

    python benchmarks/sessions.py [--runs 40] [--levels 16 64 256] [--docker-levels 16 64 256] [--json out.json]

Measured:
  bare      `subprocess.run(["true"])` (fork+exec from the benchmark process, no isolation): the baseline
  local     create from a warm pool (`LocalBackend(pool_size=4)`, the pool refilled between creates) and cold
            (pool_size=0); exec p50 of argv ["true"] and of the shell command "true" (bash -lc)
  docker    create (a container per session; sequential creates, so mostly from the backend's warm pool of 2 with the
            seed copied in, a cold container when the pool has not refilled yet), exec p50 of ["true"] through the
            session, beside `docker exec <c> true`
            (the CLI, what the goal compares with) and the SDK's raw `exec_run` on the same container
  episodes/s at each concurrency: N episodes at once, each create + 3 execs + write_file + read_file + diff + close;
            the bare baseline runs the same 3 commands per episode as plain subprocesses at the same concurrency
Docker runs when an engine answers (DOCKER_HOST honoured) and the image (--docker-image, default
rlf-debian-test:12) is there; otherwise it says why and skips.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlf_envs.sandbox.sessions import SessionBackend, SessionLimits, SessionSpec
from rlf_envs.sandbox.sessions.local import LocalBackend

LIM = SessionLimits(exec_timeout_s=120, session_timeout_s=1800, disk_mb=32, memory_mb=512, pids=128)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def bare_true(runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(["true"], check=True, timeout=60)
        out.append(time.perf_counter() - t)
    return out


async def bare_episodes(n: int) -> float:
    async def one() -> None:
        for cmd in (["true"], ["echo", "hi"], ["sh", "-c", "echo x > /dev/null"]):
            p = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.DEVNULL)
            await p.wait()

    t = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return n / (time.perf_counter() - t)


async def episodes(b: SessionBackend, spec: SessionSpec, n: int) -> tuple[float, int]:
    failures = 0

    async def one() -> None:
        nonlocal failures
        try:
            async with await b.create(spec) as s:
                await s.exec(["true"])
                await s.exec(["echo", "hi"])
                await s.exec("echo x > /dev/null")
                await s.write_file("f.txt", "data\n")
                await s.read_file("f.txt")
                await s.diff()
        except Exception as e:
            failures += 1
            print(f"  episode failed: {e!r}", file=sys.stderr)

    t = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return n / (time.perf_counter() - t), failures


async def exec_p50(b: SessionBackend, spec: SessionSpec, runs: int) -> dict[str, float]:
    async with await b.create(spec) as s:
        argv, shell = [], []
        for _ in range(runs):
            t = time.perf_counter()
            r = await s.exec(["true"])
            argv.append(time.perf_counter() - t)
            assert r.exit_code == 0, r
            t = time.perf_counter()
            await s.exec("true")
            shell.append(time.perf_counter() - t)
    return {"exec_argv_p50_s": statistics.median(argv), "exec_shell_p50_s": statistics.median(shell)}


async def local(runs: int, levels: list[int], seed: str) -> dict[str, Any]:
    res: dict[str, Any] = {}
    spec = SessionSpec(limits=LIM, seed_dir=seed)
    cold = LocalBackend(pool_size=0, creates_per_s=0)
    try:
        ts = []
        for _ in range(runs):
            t = time.perf_counter()
            s = await cold.create(spec)
            ts.append(time.perf_counter() - t)
            await s.aclose()
        res["create_cold_p50_s"], res["create_cold_p99_s"] = statistics.median(ts), pct(ts, 0.99)
    finally:
        await cold.aclose()
    warm = LocalBackend(pool_size=4, creates_per_s=0, max_starting=8)
    try:
        await (await warm.create(spec)).aclose()
        ts = []
        for _ in range(runs):
            for _ in range(400):  # a warm pool: let it refill between creates
                if len(warm._pool.get(("host", False), [])) >= 4:
                    break
                await asyncio.sleep(0.01)
            t = time.perf_counter()
            s = await warm.create(spec)
            ts.append(time.perf_counter() - t)
            await s.aclose()
        res["create_warm_p50_s"], res["create_warm_p99_s"] = statistics.median(ts), pct(ts, 0.99)
        res.update(await exec_p50(warm, spec, runs))
    finally:
        await warm.aclose()
    for n in levels:
        b = LocalBackend(pool_size=8)
        try:
            eps, fail = await episodes(b, spec, n)
        finally:
            await b.aclose()
        res[f"episodes_per_s_{n}"], res[f"failures_{n}"] = eps, fail
    return res


async def docker(runs: int, levels: list[int], image: str, seed: str) -> dict[str, Any]:
    from rlf_envs.sandbox.sessions.docker import DockerBackend

    res: dict[str, Any] = {}
    spec = SessionSpec(image=f"docker:{image}", limits=LIM, seed_dir=seed)
    b = DockerBackend(creates_per_s=0)
    try:
        ts = []
        for _ in range(max(5, runs // 4)):
            t = time.perf_counter()
            s = await b.create(spec)
            ts.append(time.perf_counter() - t)
            await s.aclose()
        res["create_p50_s"], res["create_p99_s"] = statistics.median(ts), pct(ts, 0.99)
        async with await b.create(spec) as s:
            ours, cli, raw = [], [], []
            cid = s._c.id  # type: ignore[attr-defined]
            for _ in range(runs):
                t = time.perf_counter()
                await s.exec(["true"])
                ours.append(time.perf_counter() - t)
                t = time.perf_counter()
                subprocess.run(["docker", "exec", cid, "true"], check=True, timeout=60)
                cli.append(time.perf_counter() - t)
                t = time.perf_counter()
                s._c.exec_run(["true"])  # type: ignore[attr-defined]
                raw.append(time.perf_counter() - t)
        res["exec_p50_s"] = statistics.median(ours)
        res["docker_exec_cli_p50_s"] = statistics.median(cli)
        res["sdk_exec_run_p50_s"] = statistics.median(raw)
    finally:
        await b.aclose()
    for n in levels:
        b = DockerBackend()
        try:
            eps, fail = await episodes(b, spec, n)
        finally:
            await b.aclose()
        res[f"episodes_per_s_{n}"], res[f"failures_{n}"] = eps, fail
    return res


def docker_reason(image: str) -> str | None:
    try:
        import docker as sdk
    except ImportError:
        return "the docker SDK is not installed (pip install 'rlf-envs[docker]')"
    if shutil.which("docker") is None:
        return "no docker CLI (the baseline is `docker exec`)"
    try:
        c = sdk.from_env(timeout=10)
        c.ping()
        c.images.get(image)
        c.close()
    except Exception as e:
        return f"no engine or no image {image}: {e}"
    return None


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--levels", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--docker-levels", type=int, nargs="*", default=[16, 64, 256])
    ap.add_argument("--docker-image", default="rlf-debian-test:12")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out: dict[str, Any] = {"machine": f"{platform.node()} {os.cpu_count()} cpus", "runs": a.runs}
    with tempfile.TemporaryDirectory() as seed:
        for i in range(20):
            Path(seed, f"f{i}.py").write_text("x = 1\n" * 50)
        bare = bare_true(a.runs)
        out["bare"] = {"subprocess_run_true_p50_s": statistics.median(bare)}
        for n in sorted(set(a.levels) | set(a.docker_levels)):
            out["bare"][f"episodes_per_s_{n}"] = await bare_episodes(n)
        out["local"] = await local(a.runs, a.levels, seed)
        why = docker_reason(a.docker_image)
        if why:
            out["docker"] = {"skipped": why}
        else:
            out["docker"] = await docker(a.runs, a.docker_levels, a.docker_image, seed)
    b50 = out["bare"]["subprocess_run_true_p50_s"]
    L = out["local"]
    print(f"bare subprocess.run(['true']) p50 {b50 * 1e3:.1f} ms")
    print(f"local  create warm p50 {L['create_warm_p50_s'] * 1e3:.1f} ms  p99 {L['create_warm_p99_s'] * 1e3:.1f} ms"
          f"  cold p50 {L['create_cold_p50_s'] * 1e3:.1f} ms  p99 {L['create_cold_p99_s'] * 1e3:.1f} ms")
    print(f"local  exec ['true'] p50 {L['exec_argv_p50_s'] * 1e3:.1f} ms ({L['exec_argv_p50_s'] / b50:.2f}x bare)"
          f"  exec 'true' (bash -lc) p50 {L['exec_shell_p50_s'] * 1e3:.1f} ms")
    for n in a.levels:
        print(f"local  {n:4d} concurrent episodes: {L[f'episodes_per_s_{n}']:.1f}/s "
              f"(bare commands {out['bare'][f'episodes_per_s_{n}']:.1f}/s), failures {L[f'failures_{n}']}")
    D = out["docker"]
    if "skipped" in D:
        print(f"docker skipped: {D['skipped']}")
    else:
        print(f"docker create p50 {D['create_p50_s'] * 1e3:.0f} ms  p99 {D['create_p99_s'] * 1e3:.0f} ms")
        print(f"docker exec p50 {D['exec_p50_s'] * 1e3:.1f} ms = {D['exec_p50_s'] / D['docker_exec_cli_p50_s']:.2f}x "
              f"`docker exec` ({D['docker_exec_cli_p50_s'] * 1e3:.1f} ms), "
              f"{D['exec_p50_s'] / D['sdk_exec_run_p50_s']:.2f}x the SDK's exec_run "
              f"({D['sdk_exec_run_p50_s'] * 1e3:.1f} ms)")
        for n in a.docker_levels:
            print(f"docker {n:4d} concurrent episodes: {D[f'episodes_per_s_{n}']:.1f}/s, failures {D[f'failures_{n}']}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
