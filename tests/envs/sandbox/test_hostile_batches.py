"""The second outside attack round on the sandbox (issue 40): one hostile episode must never break the batch or the
host. Each attack goes through the direct-worker, supervised and cold paths where it applies:

1. a deep directory tree (and directories of mode 000) left in the work dir: `run_python`, `run_tests`, the Code
   env's `step` and `close`, the vector env beside honest envs, `SandboxPool.close()` and the zygote's clean-up
   never raise, a correct solution still scores, and nothing stays on disk;
3. socket families a run does not need (AF_VSOCK, AF_NETLINK, AF_PACKET, ...) are refused, for `socket` and
   `socketpair`, and io_uring (which creates sockets without the `socket` call) is refused;
4. a solution's exception never reaches the tests as control flow (StopIteration, StopAsyncIteration,
   GeneratorExit, KeyboardInterrupt, SystemExit): `all(map(f, xs))` and its kin fail;
5. the memory limit holds for the whole run (every process of it), not per process.
"""

from __future__ import annotations

import asyncio
import os
import socket
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import pytest
from repo_paths import REPO

import rlf_envs  # noqa: F401 - registers the ids
from rlf_envs import runtime
from rlf_envs.sandbox import (
    SandboxDir,
    SandboxLimits,
    SandboxPool,
    SandboxResult,
    cleanup,
    default_pool,
    run_python,
    run_tests,
)
from rlf_envs.types import Task

pytestmark = pytest.mark.timeout(300)

FAST = SandboxLimits(timeout_s=30.0, cpu_s=20, file_mb=4, memory_mb=256)
#: a tree deeper than Python's recursion limit (and than PATH_MAX: 3000 levels of "d/"), then mode 000 on the way
DEEP_TREE = textwrap.dedent("""
    import os
    top = os.getcwd()
    for i in range(3000):
        os.mkdir("d")
        os.chdir("d")
    open("leaf", "w").write("x")
    os.chdir(top)
    for i in range(3):
        os.makedirs(f"locked{i}/inner")
        open(f"locked{i}/inner/f", "w").write("y" * 1000)
        os.chmod(f"locked{i}/inner", 0)
        os.chmod(f"locked{i}", 0)
    os.mkfifo("fifo")
""")


@pytest.fixture(scope="module", params=["direct", "supervised", "cold"])
def pool(request: pytest.FixtureRequest) -> Iterator[SandboxPool | bool]:
    if request.param == "cold":
        yield False
        return
    with SandboxPool(size=2, direct=request.param == "direct") as p:
        yield p


def run(code: str, pool: SandboxPool | bool, limits: SandboxLimits = FAST, **kw: Any) -> SandboxResult:
    r = asyncio.run(run_python(code, "", limits, pool=pool, **kw))
    assert r.error is None, r
    return r


def _sandbox_dirs(parent: str) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith(("rlf_sbx_", cleanup.TRASH_PREFIX)))


# ------------------------------------------------------------------------------------------ item 1: clean-up


def _base_of(pool: SandboxPool | bool) -> str:
    """Where a run's own work dir goes: its pool's base dir (the default pool's for the cold path)."""
    return pool.base_dir if isinstance(pool, SandboxPool) else default_pool().base_dir  # type: ignore[union-attr]


def test_a_deep_tree_neither_raises_nor_stays_run_python(pool: SandboxPool | bool) -> None:
    base = _base_of(pool)
    assert cleanup.flush(120)
    before = _sandbox_dirs(base)
    r = run(DEEP_TREE + "print('built')", pool)
    assert r.stdout.strip() == "built" and r.exit_code == 0, r
    assert cleanup.flush(120)
    assert set(_sandbox_dirs(base)) - set(before) == set()


def test_a_correct_solution_that_builds_a_deep_tree_still_scores(pool: SandboxPool | bool) -> None:
    base = _base_of(pool)
    assert cleanup.flush(120)
    before = _sandbox_dirs(base)
    solution = DEEP_TREE + "def add(a, b):\n    return a + b\n"
    r = asyncio.run(run_tests(solution, ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"], FAST, pool=pool))
    assert r.test_results == (True, True), r
    assert cleanup.flush(120)
    assert set(_sandbox_dirs(base)) - set(before) == set()


def _dir_for(pool: SandboxPool | bool, limits: SandboxLimits = FAST) -> SandboxDir:
    """A kept work dir in the pool's base dir (as the Code env makes them), where the pool's runs see its quota."""
    parent = pool.base_dir if isinstance(pool, SandboxPool) else None
    return SandboxDir(limits.drop_privileges, parent=parent, disk_mb=limits.disk_mb)


def test_a_kept_work_dir_with_a_deep_tree_is_removed_off_the_call(pool: SandboxPool | bool) -> None:
    d = _dir_for(pool)
    run(DEEP_TREE, pool, workdir=d)
    d.write("d", "a file where the run left a directory tree")  # replaces the tree: never raises
    assert (d.path / "d").read_text().startswith("a file")
    d.remove()
    assert not d.root.exists()
    assert cleanup.flush(120)


def test_pool_close_and_the_zygote_clean_up_survive_a_deep_tree() -> None:
    p = SandboxPool(size=1)
    d = SandboxDir(FAST.drop_privileges, parent=p.base_dir)
    run(DEEP_TREE, p, workdir=d)
    zygote = p.zygote_pid
    assert zygote is not None
    p.close()  # never raises
    assert not os.path.exists(p.base_dir)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{zygote}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{zygote}")
    assert cleanup.flush(120)
    parent = os.path.dirname(p.base_dir)
    assert not [n for n in os.listdir(parent) if n.startswith(f"{cleanup.TRASH_PREFIX}{os.getpid()}_")]


def test_a_hostile_episode_does_not_break_the_vector_batch() -> None:
    """Env 0 builds the deep tree (and mode-000 dirs) in its episode's work dir, envs 1 and 2 are honest; the whole
    batch steps, every env is scored (the hostile one too: its answer is right), every work dir is gone."""
    from rlf_envs.envs.code import CodeEnv  # noqa: F401 - (the id's entry point)

    tasks = [Task(f"t{k}", "Print 1.", "1", meta={"check": "numeric"}) for k in range(3)]
    venv = gym.make_vec("rlf/Code-v0", num_envs=3, tasks=tasks, limits=FAST)
    envs = list(venv.envs)  # type: ignore[attr-defined]

    def call(code: str) -> str:
        import json

        return f"<tool_call>\n{json.dumps({'name': 'python', 'arguments': {'code': code}})}\n</tool_call><|im_end|>"

    async def episode() -> tuple[list[Any], list[Any]]:
        await venv.areset_envs({k: {"task_index": k} for k in range(3)})  # type: ignore[attr-defined]
        await venv.astep_active({0: call(DEEP_TREE + "print(1)"), 1: call("print(1)"),  # type: ignore[attr-defined]
                                 2: call("print(1)")})
        dirs = [e.workdir for e in envs]
        done = await venv.astep_active({k: "<answer>1</answer><|im_end|>" for k in range(3)})  # type: ignore
        return dirs, [done[k] for k in range(3)]

    dirs, done = runtime.run(episode())
    assert [d.reward for d in done] == [1.0, 1.0, 1.0] and all(d.terminated for d in done)
    assert all(d is not None and not d.root.exists() for d in dirs)
    venv.close()
    assert cleanup.flush(120)


# --------------------------------------------------------------------------------- item 3: socket families

#: families a run never needs (the network namespace isolates AF_INET/AF_INET6; AF_UNIX is local to the run):
#: AF_VSOCK reaches the hypervisor and was shared by concurrent runs, the rest are kernel attack surface
REFUSED_FAMILIES = {"AF_AX25": 3, "AF_APPLETALK": 5, "AF_X25": 9, "AF_KEY": 15, "AF_NETLINK": 16, "AF_PACKET": 17,
                    "AF_RDS": 21, "AF_PPPOX": 24, "AF_LLC": 26, "AF_CAN": 29, "AF_TIPC": 30, "AF_BLUETOOTH": 31,
                    "AF_IEEE802154": 36, "AF_ALG": 38, "AF_NFC": 39, "AF_VSOCK": 40, "AF_QIPCRTR": 42, "AF_SMC": 43,
                    "AF_XDP": 44, "AF_MCTP": 45, "AF_MAX_PLUS": 200}

SOCKET_PROBE = textwrap.dedent("""
    import ctypes, errno, json, os, socket
    libc = ctypes.CDLL(None, use_errno=True)
    out = {}
    for name, fam in FAMILIES.items():
        seen = set()
        for typ in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_RAW, socket.SOCK_SEQPACKET):
            fd = libc.syscall(41, fam, typ, 0)  # socket(2) itself, not through Python's module
            seen.add(0 if fd >= 0 else ctypes.get_errno())
            if fd >= 0:
                os.close(fd)
            pair = (ctypes.c_int * 2)()
            r = libc.syscall(53, fam, typ, 0, pair)  # socketpair(2)
            seen.add(0 if r == 0 else ctypes.get_errno())
        try:
            socket.socket(fam, socket.SOCK_DGRAM).close()
            seen.add(0)
        except OSError as e:
            seen.add(e.errno)
        out[name] = sorted(seen)
    a, b = socket.socketpair()  # AF_UNIX: what a run does need
    a.send(b"ok")
    out["unix_pair"] = b.recv(2).decode()
    for fam in (socket.AF_INET, socket.AF_INET6):
        socket.socket(fam, socket.SOCK_STREAM).close()
    out["inet"] = "ok"
    params = (ctypes.c_uint32 * 30)()
    r = libc.syscall(425, 8, params)  # io_uring_setup: its IORING_OP_SOCKET would pass by socket(2)
    out["io_uring"] = 0 if r >= 0 else ctypes.get_errno()
    print(json.dumps(out))
""")


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the probe uses x86_64 syscall numbers")
def test_only_the_socket_families_a_run_needs_can_be_opened(pool: SandboxPool | bool) -> None:
    import errno
    import json

    r = run(f"FAMILIES = {REFUSED_FAMILIES!r}\n" + SOCKET_PROBE, pool)
    out = json.loads(r.stdout)
    assert "socket_families" in r.guards, r.missing_guards
    assert out.pop("unix_pair") == "ok" and out.pop("inet") == "ok"
    assert out.pop("io_uring") in (errno.ENOSYS, errno.EPERM)
    bad = {name: seen for name, seen in out.items() if seen != [errno.EAFNOSUPPORT]}
    assert bad == {}, bad


@pytest.mark.skipif(not hasattr(socket, "AF_VSOCK"), reason="no AF_VSOCK in this Python")
def test_vsock_is_no_channel_between_runs_or_to_the_scoring_process(pool: SandboxPool | bool) -> None:
    """Issue 40 item 3: concurrent runs shared the vsock port space (one's bind made the other's fail)."""
    code = textwrap.dedent("""
        import socket
        try:
            s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
            s.bind((socket.VMADDR_CID_ANY, 41234))
            print("bound")
        except OSError as e:
            print("refused", e.errno)
    """)
    r = run(code, pool)
    assert r.stdout.startswith("refused 97"), r.stdout


# ------------------------------------------------------------------ item 4: no control flow from a solution

CONTROL_FLOW = ("StopIteration", "StopAsyncIteration", "GeneratorExit", "KeyboardInterrupt", "SystemExit")
#: test shapes a built-in would end early (and pass) if the solution's exception arrived as StopIteration
SHAPES = (
    "assert all(map(f, [1, 2, 3]))",
    "assert not any(map(f, [1, 2, 3]))",
    "assert list(filter(f, [1, 2, 3])) == []",
    "assert sum(map(f, [1, 2, 3])) == 0",
    "assert next(map(f, [1]), 'default') == 'default'",
    "assert list(zip(map(f, [1, 2]), [1, 2])) == []",
    "def gen():\n    for x in [1, 2, 3]:\n        yield f(x)\nassert list(gen()) == []",
    "assert [x for x in map(f, [1, 2])] == []",
    "assert max(map(f, [1]), default=0) == 0",
)


@pytest.mark.parametrize("exc", CONTROL_FLOW)
def test_a_solution_exception_is_never_control_flow_in_the_tests(pool: SandboxPool | bool, exc: str) -> None:
    solution = f"def f(x):\n    raise {exc}('forged')\n"
    r = asyncio.run(run_tests(solution, list(SHAPES), FAST, pool=pool))
    assert r.test_results == (False,) * len(SHAPES), list(zip(SHAPES, r.test_results, r.test_errors, strict=True))
    assert all(exc in e for e in r.test_errors), r.test_errors  # the original name, for the record


def test_a_solution_iterator_still_ends_its_loop(pool: SandboxPool | bool) -> None:
    """The iteration protocol on a solution's own object (`next()` on its iterator) still ends a loop."""
    solution = "def evens(n):\n    return (i for i in range(0, n, 2))\nclass It:\n    def __iter__(self):\n" \
               "        return iter([1, 2])\n"
    tests = ["assert list(evens(7)) == [0, 2, 4, 6]", "assert sum(x for x in It()) == 3",
             "assert all(x % 2 == 0 for x in evens(9))"]
    r = asyncio.run(run_tests(solution, tests, FAST, pool=pool))
    assert r.test_results == (True, True, True), r.test_errors


# ------------------------------------------------------------------------- item 5: memory for the whole run

#: a run that forks 4 children each holding 150 MB (touched, in 10 MB steps), and reports how many were killed
MEMORY_HOG = textwrap.dedent("""
    import os, signal, time
    kids = []
    for i in range(4):
        pid = os.fork()
        if pid == 0:
            try:
                parts = [b"x" * (10 << 20) for _ in range(15)]
                time.sleep(3)
            finally:
                os._exit(0)
        kids.append(pid)
    killed = 0
    for pid in kids:
        _, status = os.waitpid(pid, 0)
        killed += os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    print(f"killed={killed}")
""")


def _pss_of_uid_mb(uid: int) -> float:
    """The memory the processes of `uid` hold together, seen from outside (as root): the sum of their proportional
    set sizes (a page shared by n processes counts 1/n in each; summing RSS would count the interpreter's pages that
    the forks share once per process)."""
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/smaps_rollup") as f:
                total += next(int(ln.split()[1]) for ln in f if ln.startswith("Pss:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def measure_memory_hog(pool: SandboxPool | bool, memory_mb: int = 256) -> tuple[SandboxResult, float]:
    """Run MEMORY_HOG with `memory_mb`; returns its result and the peak total PSS of its processes (sampled every
    10 ms from outside)."""
    lim = SandboxLimits(timeout_s=120.0, cpu_s=60, memory_mb=memory_mb, max_processes=16)
    d = _dir_for(pool, lim)
    assert d.uid is not None

    async def go() -> tuple[SandboxResult, float]:
        task = asyncio.ensure_future(run_python(MEMORY_HOG, "", lim, d, pool=pool))
        peak = 0.0
        while not task.done():
            peak = max(peak, _pss_of_uid_mb(d.uid))  # type: ignore[arg-type]
            await asyncio.sleep(0.01)
        return await task, peak

    try:
        return asyncio.run(go())
    finally:
        d.remove()


@pytest.mark.skipif(os.geteuid() != 0, reason="as non-root there is no cgroup (the documented fallback) and runs share "
                                               "our uid, so their memory cannot be told apart from outside")
def test_the_memory_limit_holds_for_the_whole_run(pool: SandboxPool | bool) -> None:
    """Item 5: memory_mb=256 and four children of 150 MB each: every process of the run is in one memory cgroup
    limited to 256 MB, whose own peak (the kernel's count: memory.peak, v1 memory.max_usage_in_bytes, not a sum of
    samples taken at different instants) stays under it, and the kernel's OOM killer acts inside it; before, each
    process had its own 256 MB of address space."""
    from rlf_envs.sandbox import _cgroup

    where = _cgroup._cgroup_parent()
    if isinstance(where, str):
        pytest.skip(f"no memory cgroup for runs here: {where}")
    lim = SandboxLimits(timeout_s=120.0, cpu_s=60, memory_mb=256, max_processes=16)
    d = _dir_for(pool, lim)
    assert d.uid is not None

    def exiting(pid: str) -> bool:
        """Gone, a zombie, or exiting (PF_EXITING: an exiting process leaves its cgroup before it is a zombie)."""
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return fields[0] in (b"Z", b"X") or bool(int(fields[6]) & 0x4)
        except (OSError, IndexError, ValueError):
            return True

    def run_cgroups() -> set[str]:
        """The cgroups (directory names under the runs' parent) of the run's live processes (its uid is the run's
        own); "?" for a live one in none of them."""
        found = set()
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                if os.stat(f"/proc/{name}").st_uid != d.uid or exiting(name):
                    continue
                with open(f"/proc/{name}/cgroup") as f:
                    paths = [os.path.basename(line.rstrip("\n").split(":", 2)[2]) for line in f]
            except (OSError, IndexError):
                continue
            ours = {p for p in paths if p.startswith(_cgroup.CGROUP_PREFIX)}
            if not ours and exiting(name):  # (it began to exit after the first look)
                continue
            found |= ours or {"?"}
        return found

    def read_int(cg: str, *names: str) -> int | None:
        for n in names:
            try:
                with open(os.path.join(where[0], cg, n)) as f:
                    return int(f.read())
            except (OSError, ValueError):
                continue
        return None

    async def go() -> tuple[SandboxResult, set[str], int, int | None]:
        task = asyncio.ensure_future(run_python(MEMORY_HOG, "", lim, d, pool=pool))
        seen: set[str] = set()
        peak, limit = 0, None
        while not task.done():
            now = run_cgroups()
            seen |= now
            for cg in now - {"?"}:
                peak = max(peak, read_int(cg, "memory.peak", "memory.max_usage_in_bytes") or 0)
                limit = read_int(cg, "memory.max", "memory.limit_in_bytes") or limit
            await asyncio.sleep(0.01)
        return await task, seen, peak, limit

    try:
        r, seen, peak, limit = asyncio.run(go())
    finally:
        d.remove()
    assert r.error is None, r
    assert "memory_cgroup" in r.guards, r.missing_guards
    print(f"cgroups {seen}, peak {peak / 2**20:.0f} MB, limit {limit}, {r.stdout.strip()}")
    assert len(seen) == 1 and "?" not in seen, seen  # every process of the run, in one cgroup of its own
    assert limit == 256 << 20, limit
    assert 0 < peak <= limit, (peak, limit)
    assert r.stdout.strip() != "killed=0", r.stdout
    assert not [n for n in _cgroup_dirs() if n.startswith(f"rlf-sbx-{os.getpid()}-")]


def _cgroup_dirs() -> list[str]:
    from rlf_envs.sandbox import _supervisor

    where = _supervisor._probe_cgroup_parent()
    return [] if isinstance(where, str) else [n for n in os.listdir(where[0]) if n.startswith("rlf-sbx-")]


# ---------------------------------------------------------------------------------- item 2: the disk quota

FILL = textwrap.dedent("""
    import errno, os
    written, err = 0, None
    try:
        for i in range(1000):
            with open(f"big{i}", "wb") as f:
                for _ in range(4):
                    f.write(b"x" * (1 << 20))
                    f.flush()
                    written += 1
    except OSError as e:
        err = e.errno
    files, ierr = 0, None
    try:
        for i in range(200000):
            os.close(os.open(f"e{i}", os.O_WRONLY | os.O_CREAT, 0o600))
            files += 1
    except OSError as e:
        ierr = e.errno
    print(written, err, files, ierr)
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="the work dir's quota is a tmpfs mounted in the trainer's namespace")
def test_a_run_cannot_write_past_its_work_dir_quota(pool: SandboxPool | bool) -> None:
    """Item 2: with disk_mb=16 a run gets ENOSPC after 16 MB of data and after 16k files; what it wrote is on the
    work dir's own tmpfs, not the host's disk, and the episode's next call still works."""
    import errno

    lim = SandboxLimits(timeout_s=60.0, cpu_s=30, file_mb=4, disk_mb=16)
    d = _dir_for(pool, lim)
    try:
        assert d.quota[0], d.quota
        r = run(FILL, pool, lim, workdir=d)
        assert r.guards.get("disk_quota"), r.missing_guards
        written, err, files, ierr = r.stdout.split()
        assert int(written) <= 16 and int(err) == errno.ENOSPC, r.stdout
        assert int(files) <= 16 * 1024 and int(ierr) == errno.ENOSPC, r.stdout
        assert os.stat(d.path).st_dev != os.stat(d.root.parent).st_dev  # its own filesystem, not the host's
        st = os.statvfs(d.path)
        assert st.f_blocks * st.f_frsize <= 16 << 20
        # the episode's next call: the trainer cannot write the script into the full work dir; an error result for
        # this episode, never an exception
        again = asyncio.run(run_python("print('still here')", "", lim, d, pool=pool))
        assert again.stdout.strip() == "still here" or "quota" in str(again.error), again
    finally:
        d.remove()
    assert cleanup.flush(120)


def test_scratch_dirs_bound_their_inodes_too(pool: SandboxPool | bool) -> None:
    """Empty files cost no blocks but kernel memory: /tmp (4 x file_mb = 16 MB here) takes 16k inodes at most."""
    code = textwrap.dedent("""
        import os
        n, err = 0, None
        try:
            for i in range(100000):
                os.close(os.open(f"/tmp/e{i}", os.O_WRONLY | os.O_CREAT, 0o600))
                n += 1
        except OSError as e:
            err = e.errno
        print(n, err)
    """)
    r = run(code, pool)
    if "private_tmp" not in r.guards:
        pytest.skip(f"no private /tmp here: {r.missing_guards}")
    n, err = r.stdout.split()
    assert int(n) <= 16 * 1024 and err == "28", r.stdout


KILLED_TRAINER = textwrap.dedent("""
    import asyncio, time
    from rlf_envs.sandbox import SandboxDir, SandboxLimits, SandboxPool, run_python
    p = SandboxPool(size=1)
    d = SandboxDir(parent=p.base_dir)
    code = "import os\\nfor i in range(2000):\\n    os.mkdir('d'); os.chdir('d')\\nprint('ok')"
    r = asyncio.run(run_python(code, "", SandboxLimits(), d, pool=p))
    print(r.stdout.strip(), d.quota[0], p.base_dir, p.zygote_pid, flush=True)
    time.sleep(300)
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="the work dir's mount and the run's cgroup exist as root only")
def test_a_killed_trainer_leaves_no_mount_dir_process_or_cgroup() -> None:
    """SIGKILL of the trainer with a work dir (its own tmpfs, a deep tree in it) in its pool: the zygote removes the
    base dir, which detaches the mounts the trainer left in its namespace; no process or cgroup of it stays."""
    import signal
    import subprocess
    import sys

    src = str(REPO / "rlf_envs" / "src")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_TRAINER], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": src})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[:2] == ["ok", "True"], line
        base, zygote = line[2], int(line[3])
        with open("/proc/self/mountinfo") as f:
            assert base in f.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (os.path.exists(base) or os.path.exists(f"/proc/{zygote}")):
        time.sleep(0.1)
    with open("/proc/self/mountinfo") as f:
        assert base not in f.read()
    assert not os.path.exists(base) and not os.path.exists(f"/proc/{zygote}")
    assert not [n for n in _cgroup_dirs() if n.startswith(f"rlf-sbx-{zygote}-")]


def test_a_builtin_exception_that_takes_more_than_a_message_still_arrives_as_its_kind(pool: SandboxPool | bool) -> None:
    solution = "def f(x):\n    return b'\\xff'.decode()\ndef g():\n    raise ExceptionGroup('eg', [ValueError(1)])\n"
    tests = ["try:\n    f(1)\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError('no error')",
             "try:\n    g()\nexcept Exception as e:\n    assert 'eg' in str(e), e\n"
             "else:\n    raise AssertionError('no error')"]
    r = asyncio.run(run_tests(solution, tests, FAST, pool=pool))
    assert r.test_results == (True, True), r.test_errors


NAMESPACE_PROBE = textwrap.dedent("""
    import ctypes, json, multiprocessing, os, subprocess, threading
    libc = ctypes.CDLL(None, use_errno=True)
    out = {}
    def call(name, nr, *args):
        r = libc.syscall(nr, *args)
        if r == 0 and name.startswith("clone"):
            os._exit(0)  # (the child of a clone that went through)
        out[name] = 0 if r >= 0 else ctypes.get_errno()
    call("unshare_user", 272, 0x10000000)
    call("unshare_net", 272, 0x40000000)
    call("setns", 308, 0, 0)
    call("clone_newuser", 56, 0x10000000 | 17, 0, 0, 0, 0)
    call("clone3", 435, 0, 0)
    call("bpf", 321, 5, 0, 0)
    call("perf_event_open", 298, 0, 0, -1, -1, 0)
    call("userfaultfd", 323, 0)
    # what a run does need still works: threads (clone3 refused, glibc falls back), fork, subprocess
    t = threading.Thread(target=lambda: out.setdefault("thread", "ok"))
    t.start(); t.join()
    out["subprocess"] = subprocess.run(["/bin/sh", "-c", "echo ok"], capture_output=True, text=True).stdout.strip()
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    out["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print(json.dumps(out))
""")


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the probe uses x86_64 syscall numbers")
def test_a_run_cannot_make_namespaces_or_reach_bpf_perf_userfaultfd(pool: SandboxPool | bool) -> None:
    """A nested user namespace would give the run every capability inside it (mounts, raw sockets...): the first step
    of most kernel exploits, like bpf, perf_event_open and userfaultfd. Threads, fork and subprocess still work."""
    import errno
    import json

    r = run(NAMESPACE_PROBE, pool)
    out = json.loads(r.stdout)
    assert "no_new_namespaces" in r.guards
    assert (out.pop("thread"), out.pop("subprocess"), out.pop("fork")) == ("ok", "ok", 7), (out, r.stderr)
    assert out.pop("clone3") == errno.ENOSYS
    assert out == dict.fromkeys(out, errno.EPERM) and len(out) == 7, out


# ------------------------------------------------------------------ the one seccomp program (runs and sessions)

def _bpf(prog: list[tuple[int, int, int, int]], arch: int, nr: int, arg0: int = 0) -> int:
    """Evaluate a classic BPF seccomp program on one call (the instructions `_seccomp_filter` emits)."""
    data = {0: nr & 0xFFFFFFFF, 4: arch, 16: arg0 & 0xFFFFFFFF}
    a, pc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        if code == 0x20:
            a = data[k]
        elif code == 0x06:
            return k
        elif code in (0x15, 0x35, 0x45):
            hit = a == k if code == 0x15 else a >= k if code == 0x35 else bool(a & k)
            pc += jt if hit else jf
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")
        pc += 1


def test_the_seccomp_program_refuses_foreign_abis_and_filters_the_native_one() -> None:
    """The filter every run and every session exec gets: the native arch's rules, and EPERM for every call of a
    foreign ABI (i386's int 0x80 and x32 on x86_64, arm on aarch64), which a native program never makes."""
    from rlf_envs.sandbox import _seccomp as sc

    allow, eperm = sc.SECCOMP_RET_ALLOW, sc.SECCOMP_RET_ERRNO | 1
    enosys, eafnosupport = sc.SECCOMP_RET_ERRNO | 38, sc.SECCOMP_RET_ERRNO | 97
    x86 = sc._seccomp_filter("x86_64")
    X, I386 = sc.AUDIT_ARCH_X86_64, sc.AUDIT_ARCH_I386
    assert _bpf(x86, X, 0) == allow  # read
    assert _bpf(x86, X, 41, 1) == allow and _bpf(x86, X, 41, 2) == allow and _bpf(x86, X, 53, 10) == allow
    assert [_bpf(x86, X, 41, fam) for fam in (16, 17, 38, 40)] == [eafnosupport] * 4  # netlink packet alg vsock
    assert _bpf(x86, X, 53, 40) == eafnosupport
    assert [_bpf(x86, X, nr) for nr in (248, 250, 272, 308, 321, 298, 323)] == [eperm] * 7
    assert _bpf(x86, X, 425) == enosys and _bpf(x86, X, 435) == enosys
    assert _bpf(x86, X, 56, 0x01200011) == allow and _bpf(x86, X, 56, 0x10000000 | 17) == eperm  # fork / NEWUSER
    assert _bpf(x86, X, 0x40000000 | 41, 40) == eperm and _bpf(x86, X, 0x40000000) == eperm  # x32
    assert _bpf(x86, I386, 102) == eperm and _bpf(x86, I386, 3) == eperm  # i386: socketcall, and even read
    arm = sc._seccomp_filter("aarch64")
    A = sc.AUDIT_ARCH_AARCH64
    assert _bpf(arm, A, 198, 40) == eafnosupport and _bpf(arm, A, 198, 1) == allow and _bpf(arm, A, 97) == eperm
    assert _bpf(arm, sc.AUDIT_ARCH_ARM, 3) == eperm
    assert sc._seccomp_filter("riscv128") == [(0x06, 0, 0, allow)]  # no tables: no filter rather than a wrong one
