"""Recycled local agents: a closed session's agent serves the next session of its image, and nothing of the last
session reaches the next one -- no process, no file (workspace, /tmp, /var/tmp, /dev/shm, an image's overlay layer,
the workspace's directory), no SysV IPC object, no uid, no user-database line -- and an agent that cannot be shown
clean (a call in flight, a foreign process in its cgroup, a failed reset) is ended instead. Needs root."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from rlf_envs.sandbox.sessions import SessionLimits, SessionSpec, images, local, owners
from rlf_envs.sandbox.sessions.local import LocalBackend
from tests.envs.sandbox.sessions.test_local_sessions import _procs_of_uid
from tests.envs.sandbox.sessions.test_local_sessions import run as local_run

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the local session backend needs root")

FAST = SessionLimits(exec_timeout_s=20, session_timeout_s=120, memory_mb=512, pids=64, disk_mb=64)
DEBIAN = images.debian_test_image()

# what a session leaves everywhere it can write, and processes that try to outlive it
LITTER = """
echo a > /tmp/litter; echo a > /var/tmp/litter; echo a > /dev/shm/litter; echo a > litter
mkdir -p /tmp/d/e && echo a > /tmp/d/e/f
setsid sleep 1000 > /dev/null 2>&1 &
(sleep 1000 > /dev/null 2>&1 &) &
nohup sh -c 'trap "" TERM HUP; sleep 1000' > /dev/null 2>&1 &
python3 - <<'EOF'
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
shm = libc.shmget(0x5eed, 4096, 0o1666)  # IPC_CREAT | 0666
msg = libc.msgget(0x5eed, 0o1666)
print("ipc", shm >= 0, msg >= 0)
EOF
"""

# what the next session must not see: each check prints a line only when something is found
LOOK = """
ls -A /tmp /var/tmp /dev/shm | grep -v ':$' | grep . && echo FOUND-files
test -e litter && echo FOUND-workspace
ps -eo pid=,comm= | grep -v -e ' ps$' -e ' sh$' -e ' bash$' -e ' grep$' -e ' rlf-' | grep . && echo FOUND-procs
python3 - <<'EOF'
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
if libc.shmget(0x5eed, 0, 0) >= 0 or libc.msgget(0x5eed, 0) >= 0:
    print("FOUND-ipc")
EOF
grep -c '^sandbox:' /etc/passwd
"""


def run(fn: Callable[[LocalBackend], Awaitable[Any]], **kw: Any) -> Any:
    return local_run(fn, **{"recycle": True, "warm_up": False, **kw})


def _gone(uid: int, within_s: float = 10) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end and _procs_of_uid(uid):
        time.sleep(0.05)
    return not _procs_of_uid(uid)


def _seed(tmp: Path, name: str, files: dict[str, str]) -> str:
    d = tmp / name
    d.mkdir()
    for k, v in files.items():
        (d / k).parent.mkdir(parents=True, exist_ok=True)
        (d / k).write_text(v)
    return str(d)


def test_the_next_session_on_a_recycled_agent_finds_nothing_of_the_last(tmp_path: Path) -> None:
    seed_a = _seed(tmp_path, "a", {"a.py": "A = 1\n", "pkg/x.py": "x\n"})
    seed_b = _seed(tmp_path, "b", {"b.py": "B = 2\n"})

    async def go(b: LocalBackend) -> None:
        a = await b.create(SessionSpec(limits=FAST, seed_dir=seed_a, workdir="/work/deep/a"))
        r = await a.exec(LITTER)
        assert r.exit_code == 0 and "ipc True True" in r.stdout, r
        assert (await a.exec("ls /tmp /dev/shm litter")).exit_code == 0
        agent, uid_a, id_a = a._agent, a.uid, a.id
        await a.aclose()
        assert agent in b.pool.all_idle() and not agent.dead  # recycled, not ended
        assert _gone(uid_a)  # every process of the last session, even those that left its process group

        s = await b.create(SessionSpec(limits=FAST, seed_dir=seed_b))
        assert s._agent is agent and s.id != id_a and s.uid != uid_a and b.recycled == 1
        r = await s.exec(LOOK)
        assert "FOUND" not in r.stdout and r.stdout.split() == ["1"], r  # one user line: this session's
        assert (await s.exec("id -u; hostname")).stdout.split() == [str(s.uid), "sandbox"]
        assert (await s.exec("ls -A")).stdout.split() == ["b.py"]  # this session's seed only
        assert (await s.exec("test -e /work")).exit_code == 1  # the last workspace's directories are gone
        assert await s.diff() == ""  # the diff is against this session's seed
        await s.write_file("b.py", "B = 3\n")
        assert "-B = 2\n+B = 3" in await s.diff()
        assert (await s.exec("ls /.rlf")).exit_code != 0  # the seed, the staged root: root's only
        await s.aclose()

    run(go)


@pytest.mark.skipif(DEBIAN is None, reason="the Debian test image is not built: python -m "
                    "rlf_envs.sandbox.sessions.images build-debian")
def test_an_image_root_is_rebuilt_for_the_next_session_even_after_a_writable_root(tmp_path: Path) -> None:
    """An image's root is an overlay the session writes into (everywhere, with `writable_root`): a recycled agent's
    next root is a new overlay, so none of it is seen again, and the image itself is untouched."""
    assert DEBIAN is not None
    spec = SessionSpec(limits=FAST, image=DEBIAN, writable_root=True)

    async def go(b: LocalBackend) -> None:
        a = await b.create(spec)
        r = await a.exec("echo pwned > /etc/litter && echo x > /usr/bin/litter && mkdir -p /opt/litter && " + LITTER)
        assert r.exit_code == 0, r
        agent = a._agent
        await a.aclose()
        assert agent in b.pool.all_idle()
        s = await b.create(SessionSpec(limits=FAST, image=DEBIAN))
        assert s._agent is agent
        r = await s.exec("ls /etc/litter /usr/bin/litter /opt/litter 2>&1; touch /etc/x 2>&1; " + LOOK)
        assert r.stdout.count("No such file") == 3 and "Permission denied" in r.stdout, r  # not writable_root now
        assert "FOUND" not in r.stdout, r
        await s.aclose()

    run(go)
    assert not os.path.exists(os.path.join(DEBIAN, "etc", "litter"))


def test_a_call_cancelled_midway_ends_the_agent_and_the_next_session_gets_its_own_replies() -> None:
    async def go(b: LocalBackend) -> None:
        a = await b.create(SessionSpec(limits=FAST))
        ops: list[str] = []
        real_call = a._agent.call

        async def call(obj: dict[str, Any], *args: Any, **kw: Any) -> Any:
            ops.append(obj["op"])
            return await real_call(obj, *args, **kw)

        a._agent.call = call  # type: ignore[method-assign]
        t = asyncio.ensure_future(a.exec("sleep 0.5; echo late"))
        await asyncio.sleep(0.1)
        t.cancel()  # the reply is still on its way: this agent's next reply would be that one
        with pytest.raises(asyncio.CancelledError):
            await t
        agent = a._agent
        await a.aclose()
        assert agent.dead and agent not in b.pool.all_idle() and ops == ["exec"]  # no reset even tried
        s = await b.create(SessionSpec(limits=FAST))
        assert s._agent is not agent
        await asyncio.sleep(0.6)
        assert (await s.exec("echo mine")).stdout == "mine\n"
        await s.aclose()

    run(go)


def test_a_foreign_process_in_the_agents_cgroup_after_the_reset_ends_the_agent() -> None:
    """The agent says it killed everything; the trainer checks its cgroup itself, and a process there that is not
    the agent's own (here a host process moved in just after the reset) means the agent is ended, not reused."""
    async def go(b: LocalBackend) -> None:
        a = await b.create(SessionSpec(limits=FAST))
        if a._agent.cgroup is None:
            pytest.skip("no session cgroup on this host")
        agent = a._agent
        intruder = subprocess.Popen(["sleep", "60"])
        real_call = agent.call

        async def call(obj: dict[str, Any], *args: Any, **kw: Any) -> Any:
            got = await real_call(obj, *args, **kw)
            if obj.get("op") == "reset":
                with open(os.path.join(agent.cgroup[0], "cgroup.procs"), "w") as f:
                    f.write(str(intruder.pid))
            return got

        agent.call = call  # type: ignore[method-assign]
        try:
            await a.aclose()
            assert agent.dead and agent not in b.pool.all_idle()
        finally:
            intruder.kill()
            intruder.wait()

    run(go)


def test_a_failed_reset_ends_the_agent_and_the_backend_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    async def go(b: LocalBackend) -> None:
        a = await b.create(SessionSpec(limits=FAST))
        agent = a._agent
        await a.exec("sleep 1000 > /dev/null 2>&1 &")
        real_call = agent.call

        async def call(obj: dict[str, Any], *args: Any, **kw: Any) -> Any:
            if obj.get("op") == "reset":  # a reply that is not this reset's (a stale or forged one)
                obj = dict(obj, n=obj["n"] + 1)
            return await real_call(obj, *args, **kw)

        agent.call = call  # type: ignore[method-assign]
        uid = a.uid
        await a.aclose()
        assert agent.dead and agent not in b.pool.all_idle() and _gone(uid)
        async with await b.create(SessionSpec(limits=FAST)) as s:
            assert (await s.exec("echo ok")).stdout == "ok\n"

    run(go)


def test_idle_recycled_agents_are_bounded_by_the_peak_and_max_idle() -> None:
    async def go(b: LocalBackend) -> None:
        ss = await asyncio.gather(*(b.create(SessionSpec(limits=FAST)) for _ in range(3)))
        await asyncio.gather(*(s.aclose() for s in ss))
        assert len(b.pool.all_idle()) == 2  # max_idle, though 3 were open at once
        one = await b.create(SessionSpec(limits=FAST))
        await one.aclose()
        assert len(b.pool.all_idle()) == 2 and b.recycled == 1

    run(go, max_idle=2)


def test_past_max_idle_the_agent_idle_longest_of_any_image_makes_room() -> None:
    """A run moving from one image (here: one network setting) to another keeps the recent ones' agents."""
    async def go(b: LocalBackend) -> None:
        old = await b.create(SessionSpec(limits=FAST))
        await old.aclose()
        new = await b.create(SessionSpec(limits=FAST, network=True))
        await new.aclose()
        assert b.pool.all_idle() == [new._agent]
        await old._agent.wait_dead()
        assert old._agent.dead

    run(go, max_idle=1)


def test_an_expired_session_is_not_recycled() -> None:
    async def go(b: LocalBackend) -> None:
        a = await b.create(SessionSpec(limits=SessionLimits(exec_timeout_s=5, session_timeout_s=1, memory_mb=256,
                                                            pids=32, disk_mb=16)))
        await asyncio.sleep(2.5)
        agent = a._agent
        await a.aclose()
        assert agent.dead and agent not in b.pool.all_idle()

    run(go)


def test_without_the_mount_api_sessions_still_work_and_are_never_recycled(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def no_open_tree(path: str) -> int:
        raise OSError(errno.ENOSYS, "open_tree: not implemented")

    monkeypatch.setattr(local, "open_tree_clone", no_open_tree)
    seed = _seed(tmp_path, "s", {"f.txt": "hello\n"})

    async def go(b: LocalBackend) -> None:
        assert not b.recycle
        a = await b.create(SessionSpec(limits=FAST, seed_dir=seed))
        assert (await a.exec("cat f.txt")).stdout == "hello\n"
        await a.write_file("f.txt", "bye\n")
        assert "-hello\n+bye" in await a.diff()
        agent = a._agent
        await a.aclose()
        assert agent.dead and not b.pool.all_idle()

    run(go)


def test_the_seed_arrives_whole_on_fresh_and_recycled_agents(tmp_path: Path) -> None:
    """Modes, mtimes, symlinks (kept as links, never followed), a read-only directory's contents, all the session
    user's; a FIFO in the seed is left out rather than hanging the copy."""
    seed = tmp_path / "seed"
    (seed / "ro" / "deep").mkdir(parents=True)
    (seed / "ro" / "deep" / "f.txt").write_text("deep\n")
    (seed / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (seed / "run.sh").chmod(0o755)
    (seed / "secret").write_text("s\n")
    (seed / "secret").chmod(0o600)
    (seed / "link").symlink_to("/etc/shadow")
    (seed / "big.bin").write_bytes(os.urandom(3 << 20))
    os.mkfifo(seed / "fifo")
    os.utime(seed / "secret", ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    (seed / "ro").chmod(0o555)
    want = ["ro 555 d", "ro/deep 755 d", "ro/deep/f.txt 644 f", "run.sh 755 f", "secret 600 f", "link 777 l",
            "big.bin 644 f"]
    look = ("for p in ro ro/deep ro/deep/f.txt run.sh secret link big.bin; do stat -c '%n %a %F %u' $p; done; "
            "stat -c %Y secret; readlink link; ./run.sh; test -e fifo || echo no-fifo; sha256sum big.bin")

    async def go(b: LocalBackend) -> None:
        for _ in range(2):  # a fresh agent, then the same agent recycled
            async with await b.create(SessionSpec(limits=FAST, seed_dir=str(seed))) as s:
                r = await s.exec(look)
                lines = r.stdout.splitlines()
                kinds = {"directory": "d", "regular file": "f", "symbolic link": "l"}
                got = []
                for line in lines[:7]:
                    name, mode, *kind, uid = line.split()
                    assert int(uid) == s.uid, line
                    got.append(f"{name} {mode} {kinds[' '.join(kind)]}")
                assert got == want, r
                assert lines[7:11] == ["1000000000", "/etc/shadow", "ran", "no-fifo"], r
                assert lines[11].split()[0] == hashlib.sha256((seed / "big.bin").read_bytes()).hexdigest()
                assert await s.diff() == ""
        assert b.recycled == 1

    try:
        run(go)
    finally:
        (seed / "ro").chmod(0o755)


HOSTILE = [
    LITTER,
    ":(){ :|:& };: 2>/dev/null; sleep 1",  # a fork bomb, bounded by the pids limit
    "python3 -c 'b = bytearray(400 << 20)'; echo after",  # past the memory limit
    "dd if=/dev/zero of=/tmp/fill bs=1M count=100 2>/dev/null; dd if=/dev/zero of=fill bs=1M 2>/dev/null; true",
    "kill -STOP $(pgrep rlf-launcher); sleep 0.2",  # the launcher stopped
    "kill -9 -1",  # every process of the session's uid, the launcher included
    "for i in $(seq 50); do sleep 1000 & done",
    "sleep 30",  # past the exec's deadline
]


@pytest.mark.slow
def test_hostile_sessions_on_recycled_agents_never_see_the_last_and_leave_nothing() -> None:
    """200 sessions, 8 at a time, each running one of HOSTILE after checking that it finds nothing of the last
    session of its agent; afterwards no label, cgroup, session process or mount is left."""
    lim = SessionLimits(exec_timeout_s=10, session_timeout_s=120, memory_mb=256, pids=64, disk_mb=32)
    mounts = Path("/proc/self/mountinfo").read_text().count("\n")
    dirty: list[str] = []
    cgroups: set[str] = set()

    async def worker(b: LocalBackend, n: int, k: int) -> None:
        for i in range(n):
            s = await b.create(SessionSpec(limits=lim))
            cgroups.update(s._agent.cgroup or ())
            r = await s.exec(LOOK)
            if "FOUND" in r.stdout or r.stdout.split() != ["1"]:
                dirty.append(r.stdout)
            await s.exec(HOSTILE[(i + k) % len(HOSTILE)], timeout_s=3)
            await s.aclose()

    async def go(b: LocalBackend) -> LocalBackend:
        await asyncio.gather(*(worker(b, 25, k) for k in range(8)))
        assert dirty == [] and b.recycled >= 150, (dirty, b.recycled)
        return b

    b = run(go, pool_size=2)
    assert [lab for lab in owners.labels() if lab.id in b._made or lab.owner_pid == os.getpid()] == []
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _session_uid(p)]
    assert Path("/proc/self/mountinfo").read_text().count("\n") == mounts
    assert [d for d in cgroups if os.path.isdir(d)] == []


def _session_uid(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("Uid:") and int(line.split()[1]) >= local.UID_BASE for line in f)
    except OSError:
        return False


def test_rlf_session_recycle_0_turns_recycling_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLF_SESSION_RECYCLE", "0")

    async def go(b: LocalBackend) -> None:
        assert not b.recycle
        a = await b.create(SessionSpec(limits=FAST))
        await a.aclose()
        assert a._agent.dead and not b.pool.all_idle()

    run(go, recycle=None)
