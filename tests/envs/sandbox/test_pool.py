"""The sandbox's warm pool (`rlf_envs.sandbox.pool`): a forked worker behaves like `python -I main.py`, no run
sees anything of an earlier one, and the pool leaves nothing behind on close(), interpreter exit and SIGTERM.

The rest of the sandbox's tests (tests/envs/sandbox/test_run_python.py, test_code_env.py, ...) run through the
default pool.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from repo_paths import REPO

from rlf_envs.sandbox import SandboxDir, SandboxLimits, SandboxPool, run_python, run_tests

FAST = SandboxLimits(timeout_s=10.0, cpu_s=10)
ROOT = REPO


@pytest.fixture(scope="module", params=[True, False], ids=["direct", "supervised"])
def pool(request: pytest.FixtureRequest) -> Iterator[SandboxPool]:
    """Both ways a pooled run goes: a direct worker (as root: one process, no supervisor) and a supervisor with
    its forked worker (what a non-root trainer, and every `run_tests` job, gets)."""
    with SandboxPool(size=2, direct=request.param) as p:
        yield p


def _gone(path: str, wait_s: float = 5.0) -> bool:
    deadline = time.monotonic() + wait_s
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(path)


# What a fresh `python -I main.py` shows; the forked worker must show the same (compared with a cold run).
PROBE = textwrap.dedent("""
    import atexit, os, signal, sys, threading
    print(__name__, os.path.basename(__file__), sys.argv[0] == __file__ or sys.argv[0], flush=True)
    print(sorted(os.environ), os.getcwd() == os.environ["HOME"])
    print([p for p in sys.path if "site-packages" not in p][:1], sys.flags.isolated, sys.flags.safe_path)
    print(signal.getsignal(signal.SIGPIPE), signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT).__name__,
          signal.getsignal(signal.SIGALRM), sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))
    print(sys.get_int_max_str_digits(), sys.getrecursionlimit(), sys.stdin.read().upper())
    print(sys.stdout.encoding, sys.stderr.errors, sys.stderr.line_buffering)
    print("fds", sorted(os.listdir("/proc/self/fd")))  # 0, 1, 2 (and the listing's own): no job, no result channel
    def later():
        import time
        time.sleep(0.2)
        print("thread joined", flush=True)
    threading.Thread(target=later).start()
    atexit.register(lambda: print("atexit ran"))
""")


@pytest.mark.asyncio
@pytest.mark.parametrize("tail, code", [
    ("", 0), ("sys.exit(7)", 7), ("sys.exit('bye')", 1), ("raise ValueError('boom')", 1), ("os._exit(5)", 5),
    ("x = (", 1), ("sys.exit(None)", 0),
])
async def test_a_forked_worker_behaves_like_a_fresh_interpreter(pool: SandboxPool, tail: str, code: int) -> None:
    program = PROBE + tail
    cold = await run_python(program, "in", FAST, pool=False)
    warm = await run_python(program, "in", FAST, pool=pool)
    assert "fresh_worker" in warm.guards and "fresh_worker" not in cold.guards
    assert warm.exit_code == cold.exit_code == code, (warm, cold)
    assert warm.stdout == cold.stdout, (warm.stdout, cold.stdout)
    # tracebacks name the script's own lines only, as python's do
    # (a run's own work dir is in its pool's base dir: the names differ)
    assert re.sub(r"rlf_(sbx|pool)_\w+", "", warm.stderr) == re.sub(r"rlf_(sbx|pool)_\w+", "", cold.stderr)
    assert "_supervisor" not in warm.stderr
    assert set(cold.guards) | {"fresh_worker"} == set(warm.guards)


LEAVE = textwrap.dedent("""
    import atexit, builtins, json, os, random, signal, subprocess, sys, threading
    open("/tmp/leak_tmp", "w").write("x")
    open("/dev/shm/leak_shm", "w").write("x")
    open("leak_cwd", "w").write("x")
    sys.modules["leak_module"] = type(sys)("leak_module")
    builtins.LEAK = 1
    builtins.len = lambda x: 42
    json.LEAK = 1
    sys.path.insert(0, "/leak")
    os.environ["LEAK"] = "1"
    os.putenv("LEAK_C", "1")
    signal.signal(signal.SIGUSR1, lambda *a: None)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    random.seed(12345)
    sys.setrecursionlimit(55555)
    threading.Thread(target=__import__("time").sleep, args=(60,), daemon=True).start()
    # a double-forked daemon that outlives us, if it can
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv("/bin/sleep", ["sleep", "MARKER"])
        os._exit(0)
    atexit.register(lambda: open("/tmp/leak_atexit", "w").write("x"))
    print("left", random.random(), flush=True)
""")

CHECK = textwrap.dedent("""
    import builtins, json, os, random, signal, sys, threading
    found = []
    for p in ("/tmp/leak_tmp", "/dev/shm/leak_shm", "leak_cwd", "/tmp/leak_atexit"):
        if os.path.exists(p):
            found.append(p)
    found += [f"listing {p}" for p in ("/tmp", "/dev/shm", ".") if [n for n in os.listdir(p) if "leak" in n]]
    if "leak_module" in sys.modules: found.append("module")
    if hasattr(builtins, "LEAK") or len("ab") != 2: found.append("builtins")
    if hasattr(json, "LEAK"): found.append("json global")
    if "/leak" in sys.path: found.append("sys.path")
    if "LEAK" in os.environ or os.getenv("LEAK_C"): found.append("environment")
    if signal.getsignal(signal.SIGUSR1) != signal.SIG_DFL or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        found.append("signal handler")
    if signal.pthread_sigmask(signal.SIG_BLOCK, []): found.append("signal mask")
    random.seed(12345); x = random.random(); random.seed()
    if sys.getrecursionlimit() == 55555: found.append("recursion limit")
    if threading.active_count() != 1: found.append("threads")
    procs = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
    for p in procs:
        try:
            if b"MARKER" in open(f"/proc/{p}/cmdline", "rb").read(): found.append("daemon visible")
        except OSError:
            pass
    print("FOUND", found)
""")


@pytest.mark.asyncio
async def test_no_run_sees_anything_of_an_earlier_one(pool: SandboxPool, leftovers: Callable[[str], list[int]]) -> None:
    marker = f"{3600 + secrets.randbelow(10**6) / 10**7:.7f}"
    for _ in range(2):  # the next supervisors of the same zygote: fresh copies of the template each time
        left = await run_python(LEAVE.replace("MARKER", marker), "", FAST, pool=pool)
        assert left.exit_code == 0 and "left" in left.stdout, left
        assert leftovers(marker) == []  # the daemon died with its run
        for checker in (run_python(CHECK.replace("MARKER", marker), "", FAST, pool=pool),):
            r = await checker
            assert r.exit_code == 0 and "FOUND []" in r.stdout, (r.stdout, r.stderr)
    # the same work dir on purpose (an episode): its files persist, nothing else does
    with SandboxDir(parent=pool.base_dir) as wd:
        await run_python(LEAVE.replace("MARKER", marker), "", FAST, wd, pool=pool)
        r = await run_python(CHECK.replace("MARKER", marker), "", FAST, wd, pool=pool)
        assert "FOUND ['leak_cwd', 'listing .']" in r.stdout, r.stdout
    # and the tests' side: a solution that rigs builtins, then another one judged by the same pool
    rigged = "import builtins\nbuiltins.AssertionError = Exception\nbuiltins.leak = 1\ndef f():\n    return 1\n"
    assert (await run_tests(rigged, ["assert f() == 2"], FAST, pool=pool)).test_results == (False,)
    clean = "def f():\n    import builtins\n    return hasattr(builtins, 'leak')\n"
    assert (await run_tests(clean, ["assert f() is False"], FAST, pool=pool)).test_results == (True,)


SCAN = textwrap.dedent("""
    import ctypes, re
    pat = re.compile(rb"RLF" + rb"SECRET-[0-9a-f]{16}")
    seen = set()
    with open("/proc/self/maps") as maps:
        regions = [line.split() for line in maps]
    for fields in regions:  # anonymous memory, heap and stack: where an interpreter keeps its objects
        if fields[1][0] != "r" or (len(fields) > 5 and fields[5] not in ("[heap]", "[stack]")):
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        for start in range(lo, hi, 1 << 24):
            data = ctypes.string_at(start, min(1 << 24, hi - start))
            seen.update(m.decode() for m in pat.findall(data))
    print("SEEN", sorted(seen), flush=True)
""")


@pytest.mark.asyncio
async def test_a_worker_holds_no_tests_nonce_or_earlier_input_in_its_memory(pool: SandboxPool) -> None:
    """The worker is a fork, so its memory is a copy of its supervisor's: scan all of it for the secrets of
    earlier runs (their tests and stdin) and of this run's tests; its own stdin is the positive control."""
    def secret() -> str:
        return "RLFSECRET-" + secrets.token_hex(8)

    earlier_tests, earlier_stdin, mine_tests, mine_stdin = secret(), secret(), secret(), secret()
    judged = await run_tests("def f():\n    return 0\n", [f"assert f() != {earlier_tests!r}"], FAST, pool=pool)
    assert judged.test_results == (True,)
    assert (await run_python("print(input())", earlier_stdin, FAST, pool=pool)).stdout.strip() == earlier_stdin
    limits = SandboxLimits(timeout_s=60.0, cpu_s=60, memory_mb=1024)
    r = await run_python(SCAN, mine_stdin, limits, pool=pool)
    assert r.exit_code == 0, r.stderr
    assert mine_stdin in r.stdout, r.stdout  # the scan finds what the worker was given
    solution = "import sys\nSTDIN = sys.stdin\nexec(" + repr(SCAN) + ")\ndef f():\n    return 0\n"
    judged = await run_tests(solution, [f"assert f() != {mine_tests!r}"], limits, pool=pool)
    assert judged.test_results == (True,), judged
    for s in (earlier_tests, earlier_stdin, mine_tests):
        assert s not in r.stdout and s not in judged.stdout, (s, r.stdout, judged.stdout)
    assert "SEEN" in judged.stdout


def _pids_with(marker: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        out.append(int(pid))
            except (OSError, IndexError):
                pass
    return out


def _wait_count(marker: str, want: int, wait_s: float = 10.0) -> int:
    deadline = time.monotonic() + wait_s
    while (n := len(_pids_with(marker))) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


@pytest.mark.asyncio
async def test_pool_is_bounded_refilled_restarted_and_closed(leftovers: Callable[[str], list[int]]) -> None:
    marker = f"{3600 + secrets.randbelow(10**6) / 10**7:.7f}"
    p = SandboxPool(size=3)
    try:
        r = await run_python("print(1)", "", FAST, pool=p)
        assert r.stdout == "1\n" and "fresh_worker" in r.guards
        # the zygote + 3 idle supervisors + (as root) 3 idle direct workers (all forks carry the zygote's command
        # line, which names base_dir)
        n = 1 + 3 + (3 if p.direct else 0)
        assert p.direct == (os.geteuid() == 0)
        assert _wait_count(p.base_dir, n) == n
        await asyncio.gather(*(run_python("print(2)", "", FAST, pool=p) for _ in range(5)))
        await asyncio.gather(*(run_tests("def f():\n    return 2\n", ["assert f() == 2"], FAST, pool=p)
                               for _ in range(5)))
        assert _wait_count(p.base_dir, n) == n  # refilled, never more
        zygote = p.zygote_pid
        assert zygote is not None
        os.kill(zygote, signal.SIGKILL)  # its supervisors die with it; the next run starts a new one
        assert (await run_python("print(3)", "", FAST, pool=p)).stdout == "3\n"
        assert p.zygote_pid not in (None, zygote)
        # close() with a run in flight: nothing is left, not the run's daemon, not the work dirs
        run = asyncio.ensure_future(run_python(f"import os\nos.execv('/bin/sleep', ['sleep', '{marker}'])", "",
                                               FAST, SandboxDir(parent=p.base_dir), pool=p))
        deadline = time.monotonic() + 10
        while not _pids_with(marker) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert _pids_with(marker)
        await asyncio.to_thread(p.close)
        r = await run
        assert r.exit_code is None  # killed with the pool
        assert leftovers(marker) == [] and leftovers(p.base_dir) == []
        assert _gone(p.base_dir)
        r = await run_python("print(4)", "", FAST, pool=p)  # a closed pool: cold start, still works
        assert r.stdout == "4\n" and "fresh_worker" not in r.guards
    finally:
        p.close()


TRAINER = textwrap.dedent("""
    import asyncio, os, sys
    from rlf_envs.sandbox import SandboxDir, run_python
    from rlf_envs.sandbox.pool import default_pool

    async def main():
        r = await run_python("print('warm')")
        assert "fresh_worker" in r.guards, r
        print(default_pool().base_dir, flush=True)
        d = SandboxDir()
        print(d.root, flush=True)
        if sys.argv[1] == "sigterm":  # (the marker is not on our own command line: only the run's sleep has it)
            marker = os.environ["RLF_TEST_MARKER"]
            await run_python(f"import os\\nos.execv('/bin/sleep', ['sleep', '{marker}'])", "", None, d)

    asyncio.run(main())
""")


@pytest.mark.parametrize("how", ["exit", "sigterm"])
def test_nothing_is_left_when_the_trainer_exits_or_gets_sigterm(how: str,
                                                                 leftovers: Callable[[str], list[int]]) -> None:
    marker = f"{3600 + secrets.randbelow(10**6) / 10**7:.7f}"
    env = {**os.environ, "RLF_SANDBOX_POOL": "2", "PYTHONPATH": str(ROOT / "rlf_envs" / "src"),
           "RLF_TEST_MARKER": marker}
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, how], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        base, workdir = proc.stdout.readline().strip(), proc.stdout.readline().strip()
        assert base and workdir.startswith(base), (base, workdir, proc.stderr.read() if proc.stderr else "")
        if how == "sigterm":
            deadline = time.monotonic() + 20
            while not _pids_with(marker) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _pids_with(marker), "the run never started"
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        expected = -signal.SIGTERM if how == "sigterm" else 0
        assert proc.returncode == expected, proc.stderr.read() if proc.stderr else ""
        assert leftovers(marker) == [] and leftovers(base) == []  # zygote, supervisors, workers, the daemon
        assert _gone(base)  # the work dirs too, although the trainer never cleaned up
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_forked_trainer_gets_its_own_default_pool() -> None:
    """A fork of the trainer (a data loader worker) must not talk on the parent's control socket."""
    from rlf_envs.sandbox import default_pool

    parent = default_pool()
    if parent is None:
        pytest.skip("RLF_SANDBOX_POOL=0: no default pool in this run")
    assert asyncio.run(run_python("print(4)", "", FAST)).stdout == "4\n"  # its zygote is up
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            child = default_pool()
            ok = child is not None and child is not parent and child.base_dir != parent.base_dir
            res = asyncio.run(run_python("print(5)", "", FAST))
            code = 0 if ok and res.stdout == "5\n" and "fresh_worker" in res.guards else 2
            assert child is not None
            child.close()
            for fin in (parent._finalizer, parent._dir_finalizer):  # what the child's exit would run
                if fin is not None:
                    fin()
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert got == b"\x00"
    assert os.path.isdir(parent.base_dir) and parent.zygote_pid is not None  # the child's exit left them alone
    assert asyncio.run(run_python("print(6)", "", FAST)).stdout == "6\n"  # the parent's pool still works


def _ns(pid: int, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except FileNotFoundError:  # exited (a zombie has no namespaces)
        return None


@pytest.mark.asyncio
async def test_idle_supervisors_are_already_confined_and_other_jobs_get_their_own() -> None:
    """Idle supervisors entered the default run's namespaces before any job; a job asking for the network or for
    no namespaces gets a supervisor forked for it, and a pre-confined one refuses such a job loudly."""
    with SandboxPool(size=2) as p:
        r = await run_python("print(1)", "", FAST, pool=p)
        if "pid_ns" not in r.guards:
            pytest.skip(f"no namespaces here: {r.missing_guards.get('namespaces')}")
        zygote = p.zygote_pid
        assert zygote is not None
        kinds = ("net", "ipc", "uts", "mnt")  # (pid_for_children has no link until the first fork)
        confined: set[int] = set()
        deadline = time.monotonic() + 10
        while len(confined) < 2 and time.monotonic() < deadline:  # the idle ones, refilled after the run
            with open(f"/proc/{zygote}/task/{zygote}/children") as f:
                children = [int(x) for x in f.read().split()]
            own = {pid: [_ns(pid, k) for k in kinds] for pid in children}
            confined = {pid for pid, ns in own.items() if None not in ns
                        and all(n != _ns(zygote, k) for n, k in zip(ns, kinds, strict=True))}
            await asyncio.sleep(0.05)
        assert len(confined) >= 2, (children, confined)  # (the run's own supervisor may not have exited yet)
        assert len({_ns(pid, "net") for pid in confined}) == len(confined)  # one network namespace each

        plain = p.lease(confined=False)
        try:
            assert all(_ns(plain.pid, k) == _ns(zygote, k) for k in kinds)  # nothing entered ahead
        finally:
            signal.pidfd_send_signal(plain.pidfd, signal.SIGKILL)
            for fd in (plain.pidfd, plain.job_fd, plain.err_fd):
                os.close(fd)

        no_ns = await run_python("print(2)", "", FAST.model_copy(update={"namespaces": False}), pool=p)
        assert no_ns.stdout == "2\n" and "fresh_worker" in no_ns.guards
        assert "pid_ns" not in no_ns.guards and "namespaces=False" in no_ns.missing_guards["namespaces"]

        # a pre-confined supervisor handed a network job (a runner bug) fails it instead of running it unconfined
        # or without the network it asked for
        p.lease = lambda confined=True: SandboxPool.lease(p, True)  # type: ignore[method-assign]
        wrong = await run_python("print('ran')", "", FAST.model_copy(update={"network": True}), pool=p)
        assert wrong.stdout == "" and wrong.error is not None and "pre-confined" in wrong.error, wrong


SIGNALS_PROBE = textwrap.dedent("""
    import signal
    print(signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGQUIT), signal.getsignal(signal.SIGUSR1),
          sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))
""")
LAUNCHER = textwrap.dedent("""
    import asyncio, signal, sys
    from rlf_envs.sandbox import run_python
    # what a trainer started as a shell's background job has (SIGINT, SIGQUIT ignored), plus more
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    for pool in (False, None):
        r = asyncio.run(run_python(sys.argv[1], pool=pool))
        print(r.exit_code, r.stdout.strip(), r.stderr.strip()[-300:], flush=True)
""")


def _default_signals() -> None:  # what a process started by a shell's foreground job has
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def test_runs_start_with_default_signals_whatever_the_trainer_ignores() -> None:
    # the reference: a fresh interpreter started with default dispositions (this test process itself may have
    # SIGINT ignored, e.g. when the test run was started in the background)
    fresh = subprocess.run([sys.executable, "-I", "-c", SIGNALS_PROBE], capture_output=True, text=True, timeout=60,
                           preexec_fn=_default_signals)
    assert "default_int_handler" in fresh.stdout, fresh
    env = {**os.environ, "PYTHONPATH": str(ROOT / "rlf_envs" / "src"), "RLF_SANDBOX_POOL": "1"}
    out = subprocess.run([sys.executable, "-c", LAUNCHER, SIGNALS_PROBE], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    cold, warm = out.stdout.splitlines()
    assert cold == warm == f"0 {fresh.stdout.strip()} ", (cold, warm, fresh.stdout)


def _idle_direct_workers(zygote: int, want: int) -> set[int]:
    """The zygote's children in a pid namespace of their own (idle direct workers), once there are `want`."""
    found: set[int] = set()
    deadline = time.monotonic() + 10
    while len(found) < want and time.monotonic() < deadline:
        with open(f"/proc/{zygote}/task/{zygote}/children") as f:
            found = {c for c in map(int, f.read().split()) if _ns(c, "pid") not in (None, _ns(zygote, "pid"))}
        time.sleep(0.02)
    return found


@pytest.mark.asyncio
async def test_a_default_run_as_root_is_one_process_forked_by_the_zygote(leftovers: Callable[[str], list[int]]) -> None:
    """As root, a default `run` job gets a direct worker: the zygote's own child, pid 1 of a pid namespace of its
    own, in mount/ipc/uts/net namespaces of its own entered while idle, with no supervisor process; the scoring
    process kills it (deadline) and the zygote reports its exit status. A supervised pool runs the same job in a
    worker whose parent is its supervisor."""
    if os.geteuid() != 0:
        pytest.skip("direct workers need root (a non-root trainer's runs are supervised)")
    kinds = ("pid", "net", "ipc", "uts", "mnt")
    for direct in (True, False):
        marker = f"{3600 + secrets.randbelow(10**6) / 10**7:.7f}"
        with SandboxPool(size=2, direct=direct) as p:
            r = await run_python("print(1)", "", FAST, pool=p)
            if "pid_ns" not in r.guards:
                pytest.skip(f"no namespaces here: {r.missing_guards.get('namespaces')}")
            assert p.direct is direct
            assert ("the scoring process holds" in r.guards["supervisor"]) is direct, r.guards["supervisor"]
            zygote = p.zygote_pid
            assert zygote is not None
            run = asyncio.ensure_future(run_python(f"import os\nos.execv('/bin/sleep', ['sleep', '{marker}'])", "",
                                                   FAST.model_copy(update={"timeout_s": 1.0}), pool=p))
            deadline = time.monotonic() + 10
            while not _pids_with(marker) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            (pid,) = _pids_with(marker)
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if direct:
                assert parent == zygote
                assert all(_ns(pid, k) != _ns(zygote, k) for k in kinds)
                nspid = Path(f"/proc/{pid}/status").read_text().split("NSpid:")[1].split("\n")[0].split()
                assert nspid[-1] == "1", nspid
            else:
                assert parent != zygote and int(Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1]
                                                 .split()[1]) == zygote  # its supervisor's child
            res = await run
            assert res.timed_out and res.exit_code is None, res
            assert leftovers(marker) == []
            if direct:  # the idle direct workers: each entered namespaces of its own before any job
                idle = _idle_direct_workers(zygote, 2)
                assert len(idle) == 2, idle
                assert all(_ns(c, k) not in (None, _ns(zygote, k)) for c in idle for k in kinds)
                assert len({_ns(c, "net") for c in idle}) == 2 and len({_ns(c, "pid") for c in idle}) == 2
            # the exit status is the code's own, whichever path
            assert (await run_python("import sys\nsys.exit(7)", "", FAST, pool=p)).exit_code == 7
            assert (await run_python("import os\nos._exit(5)", "", FAST, pool=p)).exit_code == 5


@pytest.mark.asyncio
async def test_direct_workers_killed_while_idle_cost_no_run() -> None:
    """Idle direct workers killed from outside: the next runs still run (on a fresh worker, or supervised if the
    zygote handed out a dead one before reaping it), and direct workers stay on."""
    if os.geteuid() != 0:
        pytest.skip("direct workers need root")
    with SandboxPool(size=2) as p:
        assert (await run_python("print(1)", "", FAST, pool=p)).stdout == "1\n"
        zygote = p.zygote_pid
        assert zygote is not None
        for _ in range(3):
            idle = _idle_direct_workers(zygote, 2)
            assert len(idle) == 2, idle
            for pid in idle:
                os.kill(pid, signal.SIGKILL)
            rs = await asyncio.gather(*(run_python(f"print({i})", "", FAST, pool=p) for i in range(3)))
            assert [r.stdout for r in rs] == ["0\n", "1\n", "2\n"], rs
            assert all(r.exit_code == 0 and "fresh_worker" in r.guards for r in rs)
        assert p.direct
