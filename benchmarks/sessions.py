"""Sandbox sessions: create and exec latency and episodes/s, local and docker, beside bare process starts measured in
the same run.

    python benchmarks/sessions.py [--runs 40] [--levels 16 64 256] [--docker-levels 16 64 256] [--json out.json]
                                  [--ray-levels 16 64] [--ray-nodes 2] [--ray-address ADDR] [--pairs 1]
                                  [--rounds 3]

Measured:
  bare      `subprocess.run(["true"])` (fork+exec from the benchmark process, no isolation): the baseline
  local     create from a warm pool (`LocalBackend(pool_size=4, recycle=False)`, the pool refilled between
            creates), cold (pool_size=0, recycle=False) and on the last closed session's recycled agent; exec p50 of
            argv ["true"] and of the shell command "true" (bash -lc)
  docker    create (a container per session; sequential creates, so mostly from the backend's warm pool of 2 with the
            seed copied in, a cold container when the pool has not refilled yet), exec p50 of ["true"] through the
            session, beside `docker exec <c> true`
            (the CLI, what the goal compares with) and the SDK's raw `exec_run` on the same container
  episodes/s at each concurrency: N episodes at once, each create + 3 execs + write_file + read_file + diff + close;
            the bare baseline runs the same 3 commands per episode as plain subprocesses at the same concurrency;
            beside it, back to back at each level, the whole episode unisolated (`unisolated_episode`: a copy of the
            seed, every step a shell command the way mini-swe-agent's LocalEnvironment runs it, a thread per
            episode) and, for docker, the whole episode in plain docker-py (`dockerpy_episode`); each side runs
            --rounds rounds of N episodes on one backend (a training run's steps: the local backend recycles the
            agents of closed sessions for the next round), episodes/s over all rounds, the first (cold) round's
            and the later rounds' beside it (`round_eps_<n>`); with --pairs N, N such pairs per level, the order
            alternating, their medians and every pair's ratio (`ratios_<n>`)
  ray       the ray backend (a host actor per node, each running the local backend there) on a multi-raylet
            cluster started here (`ray.cluster_utils.Cluster`: a head without sessions and --ray-nodes session
            nodes, all on this machine) or on --ray-address; beside a local backend in the same run: the hop's
            overhead per exec (["true"], ray and local calls interleaved, p50/p99), create p50 (warm pools of 8 on
            both sides), episodes/s at each of --ray-levels concurrent (the same episode as above; ray and local
            back to back at each level)
Docker runs when an engine answers (DOCKER_HOST honoured) and the image (--docker-image, default
rlf-debian-test:12) is there; otherwise it says why and skips. Ray runs when it is installed (the `ray` extra).
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
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rlf_envs.sandbox.sessions import SessionBackend, SessionLimits, SessionSpec
from rlf_envs.sandbox.sessions.local import LocalBackend

LIM = SessionLimits(exec_timeout_s=120, session_timeout_s=1800, disk_mb=32, memory_mb=512, pids=128)
#: rounds of N concurrent episodes per measurement (--rounds), on one backend
ROUNDS = 3


async def in_rounds(one_round: Callable[[], Awaitable[Any]]) -> tuple[float, list[float]]:
    """ROUNDS rounds of `one_round` (N episodes at once) back to back: the seconds of all, and each round's."""
    per = []
    t0 = time.perf_counter()
    for _ in range(ROUNDS):
        t = time.perf_counter()
        await one_round()
        per.append(time.perf_counter() - t)
    return time.perf_counter() - t0, per


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


def _mini_run(command: str, cwd: str) -> tuple[int, str]:
    """One action the way an unisolated agent runtime runs it: mini-swe-agent's LocalEnvironment (its own `execute`
    when the package is installed, else the same call: `Popen(command, shell=True, cwd=..., start_new_session=True)`,
    output piped, `communicate` with a timeout). No namespaces, no uid, no limits."""
    try:
        from minisweagent.environments.local import LocalEnvironment
    except ImportError:
        p = subprocess.Popen(command, shell=True, text=True, cwd=cwd, env=os.environ.copy(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
        out, _ = p.communicate(timeout=120)
        return p.returncode, out
    r = LocalEnvironment(cwd=cwd, timeout=120).execute({"command": command})
    return int(r["returncode"]), str(r["output"])


def unisolated_episode(seed: str) -> None:
    """The benchmark's episode without isolation: a copy of the seed as the workspace, every step a shell command
    (create, 3 commands, write, read, a git diff against the seed, close = remove the copy)."""
    ws = tempfile.mkdtemp(prefix="rlf-bench-ws-")
    try:
        shutil.copytree(seed, ws, dirs_exist_ok=True)
        for cmd in ("true", "echo hi", "echo x > /dev/null", "printf 'data\\n' > f.txt", "cat f.txt"):
            code, _ = _mini_run(cmd, ws)
            assert code == 0, cmd
        code, _ = _mini_run(f"git diff --no-index --binary -- {seed} . || true", ws)
    finally:
        shutil.rmtree(ws, ignore_errors=True)


async def unisolated_episodes(n: int, seed: str) -> float:
    """`unisolated_episode` n at once, each in a thread of its own (the runtime is synchronous)."""
    from concurrent.futures import ThreadPoolExecutor

    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=n) as pool:
        took, _ = await in_rounds(lambda: asyncio.gather(*(loop.run_in_executor(pool, unisolated_episode, seed)
                                                           for _ in range(n))))
        return n * ROUNDS / took


def dockerpy_episode(client: Any, image: str, seed_tar: bytes) -> None:
    """The benchmark's episode written directly with docker-py, as a user without rlf would: a container, the seed put
    in, every step an `exec_run`, removed at the end."""
    c = client.containers.run(image, ["sleep", "infinity"], detach=True, network_mode="none", mem_limit="512m")
    try:
        c.exec_run(["mkdir", "-p", "/work"])
        c.put_archive("/work", seed_tar)
        for cmd in (["true"], ["echo", "hi"], ["sh", "-c", "echo x > /dev/null"],
                    ["sh", "-c", "printf 'data\\n' > /work/f.txt"], ["cat", "/work/f.txt"]):
            r = c.exec_run(cmd, workdir="/work")
            assert r.exit_code == 0, (cmd, r)
        c.exec_run(["sh", "-c", "cd /work && git diff --no-index --binary -- /dev/null f.txt || true"])
    finally:
        c.remove(force=True)


async def dockerpy_episodes(n: int, image: str, seed: str) -> float:
    import io
    import tarfile
    from concurrent.futures import ThreadPoolExecutor

    import docker as sdk

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(seed, arcname=".")
    client = sdk.from_env(timeout=120, max_pool_size=max(10, n))
    loop = asyncio.get_running_loop()
    try:
        with ThreadPoolExecutor(max_workers=n) as pool:
            took, _ = await in_rounds(lambda: asyncio.gather(*(
                loop.run_in_executor(pool, dockerpy_episode, client, image, buf.getvalue()) for _ in range(n))))
            return n * ROUNDS / took
    finally:
        client.close()


async def episodes(b: SessionBackend, spec: SessionSpec, n: int,
                   rounds: list[float] | None = None) -> tuple[float, list[str]]:
    """ROUNDS rounds of n episodes at once: episodes/s over all, and each failed episode's error (kept in the JSON:
    `errors_<n>`); each round's episodes/s appended to `rounds`."""
    failures: list[str] = []

    async def one() -> None:
        try:
            async with await b.create(spec) as s:
                await s.exec(["true"])
                await s.exec(["echo", "hi"])
                await s.exec("echo x > /dev/null")
                await s.write_file("f.txt", "data\n")
                await s.read_file("f.txt")
                await s.diff()
        except Exception as e:
            failures.append(repr(e)[:500])
            print(f"  episode failed: {e!r}", file=sys.stderr)

    took, per = await in_rounds(lambda: asyncio.gather(*(one() for _ in range(n))))
    if rounds is not None:
        rounds += [n / t for t in per]
    return n * ROUNDS / took, failures


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


async def local(runs: int, levels: list[int], seed: str, pairs: int = 1) -> dict[str, Any]:
    res: dict[str, Any] = {}
    spec = SessionSpec(limits=LIM, seed_dir=seed)
    async def creates(name: str, b: LocalBackend, before: Callable[[], Awaitable[None]] | None = None) -> None:
        """create p50/p99 on `b` (`before` each, untimed), as create_<name>_p50_s / _p99_s."""
        ts = []
        for _ in range(runs):
            if before is not None:
                await before()
            t = time.perf_counter()
            s = await b.create(spec)
            ts.append(time.perf_counter() - t)
            await s.aclose()
        res[f"create_{name}_p50_s"], res[f"create_{name}_p99_s"] = statistics.median(ts), pct(ts, 0.99)

    cold = LocalBackend(pool_size=0, creates_per_s=0, recycle=False)
    try:
        await creates("cold", cold)
    finally:
        await cold.aclose()
    warm = LocalBackend(pool_size=4, creates_per_s=0, max_starting=8, recycle=False)

    async def refilled() -> None:  # a warm pool: let it refill between creates
        for _ in range(400):
            if len(warm.pool.idle(("host", False))) >= 4:
                break
            await asyncio.sleep(0.01)

    try:
        await (await warm.create(spec)).aclose()
        await creates("warm", warm, refilled)
        res.update(await exec_p50(warm, spec, runs))
    finally:
        await warm.aclose()
    again = LocalBackend(pool_size=0, creates_per_s=0)  # every create after the first on the last one's agent
    try:
        await (await again.create(spec)).aclose()
        await creates("recycled", again)
    finally:
        await again.aclose()
    for n in levels:  # rlf's local backend and the unisolated runtime back to back at each level
        rounds: list[float] = []

        async def ours(n: int, rounds: list[float] = rounds) -> tuple[float, list[str]]:
            b = LocalBackend(pool_size=8)
            try:
                return await episodes(b, spec, n, rounds)
            finally:
                res[f"recycled_{n}"] = res.get(f"recycled_{n}", 0) + b.recycled
                await b.aclose()

        await paired(res, n, pairs, ours, lambda n: unisolated_episodes(n, seed), "unisolated")
        res[f"round_eps_{n}"] = rounds
    return res


async def paired(res: dict[str, Any], n: int, pairs: int, ours: Callable[[int], Awaitable[tuple[float, list[str]]]],
                 base: Callable[[int], Awaitable[float]], name: str) -> None:
    """`pairs` back-to-back runs of rlf's episodes and the baseline's at concurrency n, the order alternating (the box's
    load drifts): the medians of each side as episodes_per_s_<n> / <name>_episodes_per_s_<n>, every pair's ratio
    in ratios_<n>, failures and their errors summed over the runs."""
    mine, theirs, ratios, errors = [], [], [], []
    for i in range(pairs):
        if i % 2:
            b = await base(n)
            eps, fail = await ours(n)
        else:
            eps, fail = await ours(n)
            b = await base(n)
        mine.append(eps)
        theirs.append(b)
        ratios.append(eps / b)
        errors += fail
    res[f"episodes_per_s_{n}"], res[f"{name}_episodes_per_s_{n}"] = statistics.median(mine), statistics.median(theirs)
    res[f"ratios_{n}"], res[f"failures_{n}"], res[f"errors_{n}"] = ratios, len(errors), errors


async def docker(runs: int, levels: list[int], image: str, seed: str, pairs: int = 1) -> dict[str, Any]:
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
    async def ours(n: int) -> tuple[float, list[str]]:
        b = DockerBackend()
        try:
            return await episodes(b, spec, n)
        finally:
            await b.aclose()

    for n in levels:  # rlf's docker backend and the same episode in plain docker-py back to back at each level
        await paired(res, n, pairs, ours, lambda n: dockerpy_episodes(n, image, seed), "dockerpy")
    return res


async def ray_bench(runs: int, levels: list[int], seed: str, address: str | None, n_nodes: int) -> dict[str, Any]:
    import ray

    from rlf_envs.sandbox.sessions.ray import RayBackend

    res: dict[str, Any] = {}
    cluster = None
    if address is None:
        from ray.cluster_utils import Cluster

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # the cluster's files (its address file included: a plain `ray.init()` elsewhere would connect to it) in a
        # directory of its own
        os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rlf-ray-", dir="/tmp")
        small = {"object_store_memory": 100 << 20, "num_cpus": 1}
        cluster = Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False})
        for _ in range(n_nodes):
            cluster.add_node(wait=False, **small, resources={"rlf_sessions": 1})
        cluster.wait_for_nodes()
        address = cluster.address
        res["cluster"] = f"{n_nodes} session raylets + a head, on this machine"
    else:
        res["cluster"] = address
    ray.init(address=address, log_to_driver=False, logging_level="warning")
    spec = SessionSpec(limits=LIM, seed_dir=seed)
    top = max(levels or [16])
    rb = RayBackend(node_selector="resource:rlf_sessions" if cluster is not None else None,
                    per_node_cap=max(8, top), creates_per_node_s=0, inner_kwargs={"pool_size": 8, "creates_per_s": 0})
    lb = LocalBackend(pool_size=8, creates_per_s=0)
    try:
        res["hosts"] = len([h for h in rb.hosts() if h.state == "up"])
        await (await rb.create(spec)).aclose()  # the seed shipped, the warm pools filling
        await (await lb.create(spec)).aclose()
        await asyncio.sleep(2.0)
        n = max(runs * 5, 200)
        async with await rb.create(spec) as rs, await lb.create(spec) as ls:
            t_ray, t_loc = [], []
            for _ in range(n):
                t = time.perf_counter()
                await ls.exec(["true"])
                t_loc.append(time.perf_counter() - t)
                t = time.perf_counter()
                await rs.exec(["true"])
                t_ray.append(time.perf_counter() - t)
        res["exec_p50_s"], res["exec_p99_s"] = statistics.median(t_ray), pct(t_ray, 0.99)
        res["local_exec_p50_s"], res["local_exec_p99_s"] = statistics.median(t_loc), pct(t_loc, 0.99)
        c_ray, c_loc = [], []
        for _ in range(runs):
            await asyncio.sleep(0.05)  # the warm pools refill between creates
            t = time.perf_counter()
            s = await rb.create(spec)
            c_ray.append(time.perf_counter() - t)
            await s.aclose()
            t = time.perf_counter()
            s2 = await lb.create(spec)
            c_loc.append(time.perf_counter() - t)
            await s2.aclose()
        res["create_p50_s"], res["local_create_p50_s"] = statistics.median(c_ray), statistics.median(c_loc)
        for lvl in levels:
            eps, fail = await episodes(rb, spec, lvl)
            res[f"episodes_per_s_{lvl}"], res[f"failures_{lvl}"], res[f"errors_{lvl}"] = eps, len(fail), fail
            eps, fail = await episodes(lb, spec, lvl)
            res[f"local_episodes_per_s_{lvl}"], res[f"local_failures_{lvl}"] = eps, len(fail)
            res[f"local_errors_{lvl}"] = fail
        spread = [h.load for h in rb.hosts()]
        res["hosts_load_after"] = spread
    finally:
        await lb.aclose()
        await rb.aclose()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
            shutil.rmtree(os.environ.pop("RAY_TMPDIR"), ignore_errors=True)
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


def print_local(L: dict[str, Any], b50: float, levels: list[int], bare: dict[str, Any]) -> None:
    print(f"local  create warm p50 {L['create_warm_p50_s'] * 1e3:.1f} ms  p99 {L['create_warm_p99_s'] * 1e3:.1f} ms"
          f"  cold p50 {L['create_cold_p50_s'] * 1e3:.1f} ms  p99 {L['create_cold_p99_s'] * 1e3:.1f} ms"
          f"  recycled p50 {L['create_recycled_p50_s'] * 1e3:.1f} ms  p99 {L['create_recycled_p99_s'] * 1e3:.1f} ms")
    print(f"local  exec ['true'] p50 {L['exec_argv_p50_s'] * 1e3:.1f} ms ({L['exec_argv_p50_s'] / b50:.2f}x bare)"
          f"  exec 'true' (bash -lc) p50 {L['exec_shell_p50_s'] * 1e3:.1f} ms")
    for n in levels:
        uni = L[f"unisolated_episodes_per_s_{n}"]
        per = L[f"round_eps_{n}"]
        first = [r for i, r in enumerate(per) if i % ROUNDS == 0]
        later = [r for i, r in enumerate(per) if i % ROUNDS]
        print(f"local  {n:4d} concurrent episodes: {L[f'episodes_per_s_{n}']:.1f}/s = "
              f"{L[f'episodes_per_s_{n}'] / uni:.2f}x unisolated (mini-swe-agent's way: {uni:.1f}/s; "
              f"bare commands {bare[f'episodes_per_s_{n}']:.1f}/s), failures {L[f'failures_{n}']}; "
              f"{ROUNDS} rounds: the first {statistics.median(first):.1f}/s"
              + (f", later ones {statistics.median(later):.1f}/s on {L[f'recycled_{n}']} recycled agents"
                 if later else "")
              + spread(L[f"ratios_{n}"]))


def spread(ratios: list[float]) -> str:
    """The pairs' ratios (median and range), where there was more than one pair."""
    if len(ratios) < 2:
        return ""
    return (f"; {len(ratios)} pairs: median {statistics.median(ratios):.2f}x, "
            f"{min(ratios):.2f}-{max(ratios):.2f}x")


def ray_reason() -> str | None:
    try:
        import ray  # noqa: F401
    except ImportError:
        return "Ray is not installed (pip install -e './rlf_envs[ray]')"
    if os.geteuid() != 0:
        return "the local backend under the ray hosts needs root"
    return None


def print_ray(R: dict[str, Any]) -> None:
    over50 = R["exec_p50_s"] - R["local_exec_p50_s"]
    print(f"ray    ({R['cluster']}, {R['hosts']} hosts) exec ['true'] p50 {R['exec_p50_s'] * 1e3:.1f} ms = "
          f"{R['exec_p50_s'] / R['local_exec_p50_s']:.2f}x local ({R['local_exec_p50_s'] * 1e3:.1f} ms; the hop "
          f"+{over50 * 1e3:.1f} ms), p99 {R['exec_p99_s'] * 1e3:.1f} ms = "
          f"{R['exec_p99_s'] / R['local_exec_p99_s']:.2f}x local ({R['local_exec_p99_s'] * 1e3:.1f} ms)")
    print(f"ray    create p50 {R['create_p50_s'] * 1e3:.1f} ms = {R['create_p50_s'] / R['local_create_p50_s']:.2f}x "
          f"local ({R['local_create_p50_s'] * 1e3:.1f} ms), warm pools")
    for k in sorted((k for k in R if k.startswith("episodes_per_s_")), key=lambda k: int(k.rsplit("_", 1)[1])):
        n = k.rsplit("_", 1)[1]
        print(f"ray    {int(n):4d} concurrent episodes: {R[k]:.1f}/s = {R[k] / R[f'local_episodes_per_s_{n}']:.2f}x "
              f"local ({R[f'local_episodes_per_s_{n}']:.1f}/s), failures {R[f'failures_{n}']} "
              f"(local {R[f'local_failures_{n}']})")
    print(f"ray    hosts' load after the run: {R['hosts_load_after']}")


async def main() -> None:
    global ROUNDS
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--levels", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--docker-levels", type=int, nargs="*", default=[16, 64, 256])
    ap.add_argument("--docker-image", default="rlf-debian-test:12")
    ap.add_argument("--json", default=None)
    ap.add_argument("--ray-levels", type=int, nargs="*", default=[16, 64])
    ap.add_argument("--ray-nodes", type=int, default=2, help="session raylets of the cluster started here")
    ap.add_argument("--ray-address", default=None, help="an existing cluster instead (its nodes without GPUs)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["local", "docker", "ray"])
    ap.add_argument("--pairs", type=int, default=1, help="back-to-back runs of rlf's episodes and the baseline's at "
                    "each level, the order alternating: medians and each pair's ratio reported")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="rounds of N episodes per measurement, on one "
                    "backend (a training run's steps)")
    a = ap.parse_args()
    ROUNDS = a.rounds
    out: dict[str, Any] = {"machine": f"{platform.node()} {os.cpu_count()} cpus", "runs": a.runs}
    with tempfile.TemporaryDirectory() as seed:
        for i in range(20):
            Path(seed, f"f{i}.py").write_text("x = 1\n" * 50)
        bare = bare_true(a.runs)
        out["bare"] = {"subprocess_run_true_p50_s": statistics.median(bare)}
        for n in sorted(set(a.levels) | set(a.docker_levels)):
            out["bare"][f"episodes_per_s_{n}"] = await bare_episodes(n)
        out["local"] = {"skipped": "--skip"} if "local" in a.skip else await local(a.runs, a.levels, seed, a.pairs)
        why = "--skip" if "docker" in a.skip else docker_reason(a.docker_image)
        if why:
            out["docker"] = {"skipped": why}
        else:
            out["docker"] = await docker(a.runs, a.docker_levels, a.docker_image, seed, a.pairs)
        why = "--skip" if "ray" in a.skip else ray_reason()
        if why:
            out["ray"] = {"skipped": why}
        else:
            out["ray"] = await ray_bench(a.runs, a.ray_levels, seed, a.ray_address, a.ray_nodes)
    b50 = out["bare"]["subprocess_run_true_p50_s"]
    print(f"bare subprocess.run(['true']) p50 {b50 * 1e3:.1f} ms")
    L = out["local"]
    if "skipped" not in L:
        print_local(L, b50, a.levels, out["bare"])
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
            dpy = D[f"dockerpy_episodes_per_s_{n}"]
            print(f"docker {n:4d} concurrent episodes: {D[f'episodes_per_s_{n}']:.1f}/s = "
                  f"{D[f'episodes_per_s_{n}'] / dpy:.2f}x plain docker-py ({dpy:.1f}/s), failures {D[f'failures_{n}']}"
                  f"{spread(D[f'ratios_{n}'])}")
    R = out["ray"]
    if "skipped" in R:
        print(f"ray skipped: {R['skipped']}")
    else:
        print_ray(R)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
