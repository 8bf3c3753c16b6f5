"""Sandbox sessions, local backend: a stateful workspace per episode (exec, files, diff, close), its limits, and
hostile commands that must neither escape nor outlive their deadline. Needs root (mount namespaces, per-session uids):
skipped with the reason otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from rlf_envs.sandbox.sessions import (
    SessionClosed,
    SessionError,
    SessionInfraError,
    SessionLimits,
    SessionSpec,
    open_backend,
    owners,
)
from rlf_envs.sandbox.sessions.local import LocalBackend

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the local session backend needs root")

FAST = SessionLimits(exec_timeout_s=20, session_timeout_s=120, memory_mb=512, pids=64, disk_mb=64)


def run(fn: Callable[[LocalBackend], Awaitable[Any]], **kw: Any) -> Any:
    """`fn` on a fresh backend. Recycling is on unless `recycle=False`: a first session (closed before `fn` runs)
    leaves its agent recycled, so `fn`'s first session of the default image runs on an agent another session used
    (every promise below holds for a recycled agent as for a fresh one); `warm_up=False`: no such first session."""
    warm_up = kw.pop("warm_up", True)

    async def main() -> Any:
        b = LocalBackend(pool_size=kw.pop("pool_size", 0), **kw)
        try:
            if warm_up and b.recycle and b.pool_size == 0:
                s = await b.create(SessionSpec(limits=FAST))
                await s.exec("echo used > /tmp/used; sleep 1000 > /dev/null 2>&1 &")
                await s.aclose()
                assert s._agent in b.pool.all_idle(), "the first session's agent was not recycled"
            return await fn(b)
        finally:
            await b.aclose()

    return asyncio.run(main())


@pytest.fixture()
def seed(tmp_path: Path) -> Path:
    d = tmp_path / "seed"
    (d / "pkg").mkdir(parents=True)
    (d / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    (d / "README").write_text("hello\n")
    (d / "gone.txt").write_text("bye\n")
    (d / "blob.bin").write_bytes(bytes(range(256)) * 4)
    (d / ".git").mkdir()
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return d


def test_exec_shell_argv_stdin_cwd_env_and_exit_codes(seed: Path) -> None:
    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(seed_dir=str(seed), limits=FAST, env={"FOO": "bar"})) as s:
            r = await s.exec("echo $FOO; pwd; cat README; exit 3")
            assert (r.exit_code, r.stdout, r.timed_out) == (3, "bar\n/workspace\nhello\n", False), r
            r = await s.exec(["cat"], stdin="from stdin")
            assert r.stdout == "from stdin" and r.exit_code == 0
            r = await s.exec(["pwd"], cwd="/workspace/pkg", env={"X": "1"})
            assert r.stdout == "/workspace/pkg\n"
            r = await s.exec("echo err >&2; kill -9 $$")
            assert r.stderr == "err\n" and r.exit_code == 128 + 9 and not r.timed_out
            r = await s.exec(["no-such-program-xyz"])
            assert r.exit_code == 127 and "no-such-program-xyz" in r.stderr
            # state persists across calls
            await s.exec("echo kept > state.txt && export GONE=1")
            r = await s.exec("cat state.txt; echo ${GONE:-unset}")
            assert r.stdout == "kept\nunset\n"
            r = await s.exec("id -u; whoami")
            assert r.stdout.split() == [str(s.uid), "sandbox"] and s.uid != 0

    run(go)


def test_deadline_kills_everything_the_call_started(seed: Path) -> None:
    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(seed_dir=str(seed), limits=FAST)) as s:
            await s.exec("sleep 1000 > /dev/null 2>&1 &")  # a background process of an earlier call survives it
            t0 = time.monotonic()
            # a double-forked setsid daemon, a process ignoring SIGTERM, and output held open
            r = await s.exec("setsid sh -c 'sleep 1000 & sleep 1000' & trap '' TERM; sleep 1000", timeout_s=1.0)
            assert r.timed_out and r.exit_code == 124, r
            assert time.monotonic() - t0 < 15
            ps = await s.exec(["sh", "-c", "for p in /proc/[0-9]*; do cat $p/cmdline | tr '\\0' ' '; echo; done"])
            sleeps = [line for line in ps.stdout.splitlines() if line.startswith("sleep 1000")]
            assert len(sleeps) == 1, ps.stdout  # only the earlier call's background sleep

    run(go)


def test_output_is_capped_and_flagged() -> None:
    lim = SessionLimits(output_bytes=1000, exec_timeout_s=20, disk_mb=32)

    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(limits=lim)) as s:
            r = await s.exec("head -c 5000000 /dev/zero | tr '\\0' x; echo tail >&2")
            assert r.truncated and len(r.stdout) == 1000 and r.stderr == "tail\n" and r.exit_code == 0

    run(go)


def test_files_read_write_binary_and_errors(seed: Path) -> None:
    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(seed_dir=str(seed), limits=FAST)) as s:
            await s.write_file("new/dir/x.py", "print('hi')\n")
            assert await s.read_file("new/dir/x.py") == b"print('hi')\n"
            r = await s.exec("python3 new/dir/x.py; stat -c %u new/dir/x.py")
            assert r.stdout == f"hi\n{s.uid}\n", r
            await s.write_file("/workspace/b.bin", b"\x00\xff" * 10)
            assert await s.read_file("b.bin") == b"\x00\xff" * 10
            with pytest.raises(FileNotFoundError):
                await s.read_file("nope.txt")
            await s.exec("mkfifo fifo")
            with pytest.raises(SessionError, match="not a regular file"):
                await asyncio.wait_for(s.read_file("fifo"), 30)  # never blocks on a FIFO
            with pytest.raises(SessionError):
                await s.write_file("/usr/evil", "x")  # read-only, and not the session user's
            with pytest.raises(SessionError):
                await s.read_file("/etc/shadow")

    run(go)


def test_diff_is_a_git_patch_that_reproduces_the_workspace(seed: Path, tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")

    async def go(b: LocalBackend) -> str:
        async with await b.create(SessionSpec(seed_dir=str(seed), limits=FAST)) as s:
            assert await s.diff() == ""
            await s.exec("printf 'def f():\\n    return 2\\n' > pkg/mod.py && rm gone.txt && echo hi > new.txt"
                         " && printf '\\x00\\x01\\x02' > blob.bin && chmod +x README && ln -s README link"
                         " && printf 'no newline' > nonl.txt && echo x > .git/HEAD"
                         " && mkdir 'sp ace' && echo q > 'sp ace/q\"uote\ttab.txt'")
            return await s.diff()

    patch = run(go)
    assert "diff --git a/pkg/mod.py b/pkg/mod.py" in patch and "deleted file mode 100644" in patch
    assert "GIT binary patch" in patch and "new mode 100755" in patch and ".git/HEAD" not in patch
    work = tmp_path / "apply"
    shutil.copytree(seed, work, symlinks=True)
    (tmp_path / "p.diff").write_text(patch)
    subprocess.run(["git", "apply", "--binary", str(tmp_path / "p.diff")], cwd=work, check=True, timeout=60)
    assert (work / "pkg" / "mod.py").read_text() == "def f():\n    return 2\n"
    assert not (work / "gone.txt").exists() and (work / "new.txt").read_text() == "hi\n"
    assert (work / "blob.bin").read_bytes() == b"\x00\x01\x02" and os.access(work / "README", os.X_OK)
    assert os.readlink(work / "link") == "README" and (work / "nonl.txt").read_text() == "no newline"
    assert (work / "sp ace" / 'q"uote\ttab.txt').read_text() == "q\n"


def test_diff_reads_the_workspace_with_the_session_users_rights(seed: Path) -> None:
    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(seed_dir=str(seed), limits=FAST)) as s:
            await s.exec("ln -s /proc/1/environ env_link && echo x > secret && chmod 000 secret")
            with pytest.raises(SessionError, match="ermission denied"):
                await s.diff()  # the agent (root) does not read what the session's user cannot
            await s.exec("chmod 600 secret")
            patch = await s.diff()
            assert "+/proc/1/environ" in patch and "new file mode 120000" in patch  # a link, never followed

    run(go)


def test_close_is_idempotent_and_calls_after_close_fail(seed: Path) -> None:
    async def go(b: LocalBackend) -> None:
        s = await b.create(SessionSpec(seed_dir=str(seed), limits=FAST))
        pids = [p for p, _ in s._agent.label.procs]
        await s.aclose()
        await s.aclose()
        await s.close()
        with pytest.raises(SessionClosed):
            await s.exec("true")
        assert not os.path.exists(s._agent.label.path())
        for p in pids:
            assert not owners.alive(p, None) or _zombie(p)

    run(go, recycle=False)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_calls_of_one_session_are_serialised_and_sessions_run_in_parallel() -> None:
    async def go(b: LocalBackend) -> None:
        a, c = await asyncio.gather(b.create(SessionSpec(limits=FAST)), b.create(SessionSpec(limits=FAST)))
        try:
            cmd = "echo start >> log; sleep 0.3; echo end >> log"
            await asyncio.gather(*(a.exec(cmd) for _ in range(3)))
            assert (await a.read_file("log")).decode().split() == ["start", "end"] * 3
            await c.write_file("mine.txt", "c")
            r = await a.exec("ls /workspace; ls /proc | grep -c '^[0-9]'")
            assert "mine.txt" not in r.stdout  # nothing of the other session
            t0 = time.monotonic()
            await asyncio.gather(a.exec("sleep 2"), c.exec("sleep 2"))
            assert time.monotonic() - t0 < 3.9  # in parallel (sequential would take 4 s)
        finally:
            await a.aclose()
            await c.aclose()

    run(go)


def test_isolation_no_network_no_host_files_read_only_system(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")

    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(limits=FAST)) as s:
            r = await s.exec(f"cat {secret}; ls {tmp_path}")
            assert "s3cret" not in r.stdout and r.exit_code != 0 and "No such file" in r.stderr
            r = await s.exec("tail -n +3 /proc/net/dev | cut -d: -f1")
            assert r.stdout.split() == ["lo"], r.stdout
            r = await s.exec("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=3)\"")
            assert r.exit_code != 0
            r = await s.exec("touch /usr/x /etc/x /x 2>&1; echo done")
            assert r.stdout.count("ermission denied") + r.stdout.count("Read-only") >= 3, r.stdout
            r = await s.exec("grep CapEff /proc/self/status; cat /proc/1/environ")
            assert "0000000000000000" in r.stdout and r.exit_code != 0
            # the agent (pid 1, root) can be neither killed, traced nor entered
            r = await s.exec("kill -9 1; ls /proc/1/root/ /proc/1/fd/; echo end")
            assert r.stdout == "end\n" and r.stderr.count("ermission denied") + r.stderr.count("not permitted") >= 2
            assert (await s.exec("echo alive")).stdout == "alive\n"

    run(go)


def test_seccomp_denies_keyrings_io_uring_and_new_user_namespaces() -> None:
    probe = textwrap.dedent("""
        import ctypes, os, platform
        libc = ctypes.CDLL(None, use_errno=True)
        nrs = {"x86_64": (250, 425, 272), "aarch64": (219, 425, 97)}[platform.machine()]
        out = []
        for nr, args in ((nrs[0], (0, 0)), (nrs[1], (1, 0)), (nrs[2], (0x10000000,))):
            r = libc.syscall(nr, *args)
            out.append(f"{r}:{ctypes.get_errno()}")
        pid = os.fork()  # an ordinary fork (clone without CLONE_NEWUSER) still works
        if pid == 0:
            os._exit(7)
        out.append(str(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])))
        print(" ".join(out))
    """)

    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(limits=FAST)) as s:
            r = await s.exec(["python3", "-c", probe])
            assert r.stdout.split() == ["-1:1", "-1:38", "-1:1", "7"], r
            r = await s.exec("grep Seccomp: /proc/self/status; unshare -U true; echo rc=$?")
            assert "Seccomp:\t2" in r.stdout and "rc=0" not in r.stdout, r

    run(go)


def test_network_only_when_asked() -> None:
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    probe = f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5); print('up')\""

    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(limits=FAST)) as s:
            assert (await s.exec(probe)).stdout == ""
        async with await b.create(SessionSpec(limits=FAST, network=True)) as s:
            r = await s.exec(probe)
            assert r.stdout == "up\n", r

    try:
        run(go)
    finally:
        srv.close()


def test_limits_disk_pids_memory() -> None:
    lim = SessionLimits(disk_mb=16, pids=32, memory_mb=256, exec_timeout_s=30)

    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(limits=lim)) as s:
            r = await s.exec("dd if=/dev/zero of=big bs=1M count=64 2>&1; ls -s big")
            assert r.exit_code == 0 and int(r.stdout.split()[-2]) <= 17 * 1024, r.stdout  # capped at ~16 MB
            r = await s.exec("for i in $(seq 100); do sleep 5 & done 2>&1 | grep -c 'fork' ; true", timeout_s=20)
            assert r.stdout.strip() not in ("", "0"), r  # forks past the pids limit fail
            r = await s.exec(["python3", "-c", "b = bytearray(512 << 20)"], timeout_s=20)
            assert r.exit_code != 0 and "MemoryError" in r.stderr, r

    run(go)


def test_memory_cgroup_bounds_the_whole_session() -> None:
    lim = SessionLimits(memory_mb=200, disk_mb=16, pids=64, exec_timeout_s=60)

    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(limits=lim)) as s:
            if s._agent.cgroup is None:
                pytest.skip("no session cgroup on this host (rlimits only)")
            cg = s._agent.cgroup
            assert all(os.path.isdir(d) for d in cg)
            # 4 processes of 150 MB each: each under RLIMIT_AS (200 MB), together over the session's cgroup
            r = await s.exec("for i in 1 2 3 4; do python3 -c 'b = bytearray(150 << 20); import time; "
                             "time.sleep(3)' & done; wait; echo done", timeout_s=60)
            assert r.stdout == "done\n"
            r = await s.exec("for i in 1 2 3 4; do python3 -c 'b = bytearray(150 << 20); import time; time.sleep(3)' "
                             "& done; fails=0; for j in 1 2 3 4; do wait -n || fails=$((fails+1)); done; echo $fails")
            assert int(r.stdout) >= 1, r  # the kernel's OOM killer inside the session's cgroup
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(os.path.isdir(d) for d in cg):
            await asyncio.sleep(0.1)
        assert not any(os.path.isdir(d) for d in cg)  # removed with the session

    run(go, recycle=False)


def test_session_wall_clock() -> None:
    async def go(b: LocalBackend) -> None:
        s = await b.create(SessionSpec(limits=SessionLimits(session_timeout_s=2, exec_timeout_s=30)))
        r = await s.exec("sleep 10")  # the call's deadline is cut to what the session has left
        assert r.timed_out
        await asyncio.sleep(2.0)
        with pytest.raises(SessionClosed, match="wall clock"):
            await s.exec("true")
        await s.aclose()

    run(go)


def test_a_session_killed_from_outside_is_an_infra_error() -> None:
    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(limits=FAST)) as s:
            c_pid = s._agent.label.procs[0][0]
            os.kill(c_pid, signal.SIGKILL)
            with pytest.raises(SessionInfraError):
                await s.exec("true")

    run(go)


def test_agents_are_forked_by_one_zygote_whose_death_is_an_infra_failure_and_is_recovered() -> None:
    """Agents are forked by the backend's zygote (one interpreter for all of them, not one per session: no agent is a
    child of the trainer, so nothing of ours reaps a process behind asyncio's child watcher, which then logged
    "Unknown child process pid N"); a zygote killed from outside takes its sessions with it (the host's failure:
    SessionInfraError), and the next create starts a new zygote."""
    async def go(b: LocalBackend) -> None:
        s1 = await b.create(SessionSpec(limits=FAST))
        s2 = await b.create(SessionSpec(limits=FAST))
        z = b._zygote.proc
        assert z is not None and z.returncode is None
        for s in (s1, s2):
            p_pid = s._agent.proc.pid
            with open(f"/proc/{p_pid}/stat") as f:
                assert int(f.read().rsplit(")", 1)[1].split()[2]) == z.pid  # P's parent is Z
        os.kill(z.pid, signal.SIGKILL)
        for s in (s1, s2):
            with pytest.raises(SessionInfraError):
                await s.exec("true")
            await s.aclose()
        async with await b.create(SessionSpec(limits=FAST)) as s3:
            assert (await s3.exec(["echo", "again"])).stdout == "again\n"
            assert b._zygote.proc is not None and b._zygote.proc.pid != z.pid

    run(go)


LAUNCHER_PROBE = r"""
L=$PPID
test "$(cat /proc/$L/comm)" = rlf-launcher || { echo "parent is $(cat /proc/$L/comm)"; exit 9; }
ls /proc/$L/fd >/dev/null 2>&1 && echo "fd readable"
cat /proc/$L/environ >/dev/null 2>&1 && echo "environ readable"
head -c1 /proc/$L/mem >/dev/null 2>&1 && echo "mem readable"
grep -E '^(Uid|NoNewPrivs|Seccomp):' /proc/$L/status
echo uid=$(id -u)
"""


def test_the_launcher_is_confined_like_its_commands_and_not_readable_by_them() -> None:
    """Every exec is started by the session's launcher (L), which runs with the session's uid, no_new_privs and the
    seccomp filter, like the commands it starts; the session's code, of the same uid, cannot read L's descriptors,
    environment or memory (L is not dumpable)."""
    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(limits=FAST)) as s:
            r = await s.exec(LAUNCHER_PROBE)
            assert r.exit_code == 0, (r.stdout, r.stderr)
            assert "readable" not in r.stdout, r.stdout
            uid = r.stdout.split("uid=")[1].split()[0]
            assert f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}" in r.stdout, r.stdout
            assert "NoNewPrivs:\t1" in r.stdout and "Seccomp:\t2" in r.stdout, r.stdout

    run(go)


def test_a_command_that_kills_its_launcher_keeps_its_exit_code() -> None:
    """`kill -9 -1` reaches L just as the command ends (8 sessions at once, so L is often not yet scheduled): the
    command's output and its own exit code come back whole, never 137 for a command that ran to its end. (L reads a
    status without reaping, and C waits for a killed L's exit before it reads the command's status itself: a dying L
    closes its socket before the kernel hands its children to C.)"""
    async def one(b: LocalBackend) -> list[tuple[int, str]]:
        async with await b.create(SessionSpec(limits=FAST)) as s:
            return [((r := await s.exec("sleep 0.1; kill -9 -1; echo after; exit 5")).exit_code, r.stdout)
                    for _ in range(6)]

    async def go(b: LocalBackend) -> list[tuple[int, str]]:
        return [x for xs in await asyncio.gather(*(one(b) for _ in range(8))) for x in xs]

    got = run(go)
    ran = [code for code, out in got if out == "after\n"]
    # (a command whose kill reaches L before L reported its pid is reported killed, 137, with no output: documented)
    assert len(ran) >= len(got) // 4 and set(ran) == {5}, got


def test_the_launcher_killed_or_stopped_by_the_session_fails_only_its_own_exec() -> None:
    """The session's code may signal its launcher (the verifier's own `kill -9 -1` does): killed, the exec in flight
    goes on to its end (its command, re-parented to the session's pid 1, is waited for there: its output and exit
    code are whole); stopped, that exec ends at its deadline; either way no SessionInfraError, and the next exec gets
    a new launcher and works."""
    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(limits=FAST)) as s:
            # (a moment first: L reports the command's pid just after starting it; a command that kills L before
            # that is reported killed, 137, below)
            r = await s.exec("sleep 0.5; kill -KILL $PPID; sleep 0.3; echo survived; exit 3")
            assert (r.exit_code, r.stdout, r.timed_out) == (3, "survived\n", False), r
            r = await s.exec("sleep 0.5; kill -9 -1; echo after-kill-all")
            assert (r.exit_code, r.stdout) == (0, "after-kill-all\n"), r
            # killed at once: either L reported the pid first (the command goes on) or the exec is reported killed;
            # never a host failure, never run twice
            r = await s.exec("kill -KILL $PPID; echo ran >> once.txt; exit 3")
            assert r.exit_code in (3, 137) and not r.timed_out, r
            runs = await s.exec("cat once.txt 2>/dev/null | grep -c ran || true")
            assert int(runs.stdout.strip() or 0) <= 1, runs
            r = await s.exec(["echo", "again"])
            assert (r.exit_code, r.stdout) == (0, "again\n")
            t = time.monotonic()
            r = await s.exec("kill -STOP $PPID; echo stopped", timeout_s=2)
            assert r.timed_out and r.stdout == "stopped\n", r
            assert time.monotonic() - t < 2 + 1 + 5  # the deadline, the launcher's report bound, slack
            r = await s.exec(["echo", "after"])
            assert (r.exit_code, r.stdout) == (0, "after\n")
            r = await s.exec("ps -o comm= -u $(id -u) | grep -c rlf-launcher")
            assert r.stdout.strip() == "1", r.stdout  # the stopped one is gone, one launcher serves

    run(go)


def test_bad_specs_are_refused_with_a_reason(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="workdir"):
        SessionSpec(workdir="relative")
    for kept in ("/proc", "/dev/shm/w", "/sys/x", "/.rlf", "/.rlf/seed"):  # the root's own places
        with pytest.raises(ValueError, match="keeps for itself"):
            SessionSpec(workdir=kept)
    assert SessionSpec(workdir="/devices/w").workdir == "/devices/w"
    with pytest.raises(ValueError, match="seed_dir"):
        SessionSpec(seed_dir=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="memory_mb"):
        SessionLimits(memory_mb=0)
    with pytest.raises(ValueError, match="unknown session backend"):
        open_backend("nope")

    async def go(b: LocalBackend) -> None:
        with pytest.raises(ValueError, match="no such directory"):
            await b.create(SessionSpec(image=str(tmp_path / "nope")))
        with pytest.raises(ValueError, match="docker backend"):
            await b.create(SessionSpec(image="docker:debian:12"))

    run(go)


def test_warm_pool_serves_creates_and_refills() -> None:
    # other backends of this process (e.g. the SWE env's shared one, with its warm pool) own agents and labels too:
    # only what this test's backend made is judged
    before = set(_agents_of_ours())
    labels_before = {lab.id for lab in owners.labels() if lab.owner_pid == os.getpid()}

    async def go(b: LocalBackend) -> None:
        s = await b.create(SessionSpec(limits=FAST))
        await s.aclose()
        for _ in range(200):
            if len(b.pool.idle(("host", False))) == 2:
                break
            await asyncio.sleep(0.05)
        assert len(b.pool.idle(("host", False))) == 2
        pooled = b.pool.idle(("host", False))[-1]
        s = await b.create(SessionSpec(limits=FAST))
        assert s._agent is pooled
        assert (await s.exec("echo ok")).stdout == "ok\n"
        await s.aclose()
        # a warm agent killed while idle: the create starts a fresh one instead of failing
        while len(b.pool.idle(("host", False))) < 2:
            await asyncio.sleep(0.05)
        dead = b.pool.idle(("host", False))[-1]
        os.kill(dead.label.procs[0][0], signal.SIGKILL)
        await asyncio.sleep(0.2)
        s = await b.create(SessionSpec(limits=FAST))
        assert s._agent is not dead and (await s.exec("echo ok")).stdout == "ok\n"
        await s.aclose()
        # the backend closes while its pool is refilling (a create just leased an agent): nothing outlives the
        # close, not even the agent that fill was starting, nor its label
        await (await b.create(SessionSpec(limits=FAST))).aclose()
        await b.aclose()
        assert sorted(set(_agents_of_ours()) - before) == []
        assert [lab.id for lab in owners.labels() if lab.owner_pid == os.getpid() and lab.id not in labels_before] == []

    run(go, pool_size=2)


def _agents_of_ours() -> list[int]:
    """Our child processes that are (or were: zombies keep their name) session agents."""
    out = []
    for n in os.listdir("/proc"):
        try:
            with open(f"/proc/{n}/stat") as f:
                stat = f.read()
            with open(f"/proc/{n}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        comm, rest = stat.split(" (", 1)[1].rsplit(")", 1)
        if int(rest.split()[1]) == os.getpid() and (b"_agent.py" in cmd or (not cmd and "python" in comm)):
            out.append(int(n))
    return out


OWNER = textwrap.dedent("""
    import asyncio, sys
    from rlf_envs.sandbox.sessions import SessionSpec, SessionLimits
    from rlf_envs.sandbox.sessions.local import LocalBackend
    async def main():
        b = LocalBackend(pool_size=2)
        lim = SessionLimits(exec_timeout_s=60)
        ss = await asyncio.gather(*(b.create(SessionSpec(limits=lim)) for _ in range(32)))
        await asyncio.gather(*(s.exec("sleep 1000 > /dev/null 2>&1 &") for s in ss))
        print("ready", flush=True)
        await asyncio.sleep(1000)
    asyncio.run(main())
""")


def test_sigkill_of_an_owner_with_32_open_sessions_leaves_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "RLF_SESSIONS_DIR": str(tmp_path / "labels"),
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    p = subprocess.Popen([sys.executable, "-c", OWNER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line == "ready\n", line
        os.environ["RLF_SESSIONS_DIR"] = str(tmp_path / "labels")
        labels = owners.labels()
        assert len(labels) >= 32
        pids = [pid for lab in labels for pid, _ in lab.procs]
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        # an agent whose PDEATHSIG did not fire (a stand-in: a live process named in a dead owner's label)
        stray = subprocess.Popen(["sleep", "1000"])
        lab = owners.Label.new("loc-stray")
        lab.owner_pid, lab.owner_start = labels[0].owner_pid, labels[0].owner_start
        lab.procs = [(stray.pid, owners.start_time(stray.pid))]
        lab.save()
        b = LocalBackend(pool_size=0)  # start-up reaps
        assert b.reaped_at_start >= 33
        assert stray.wait(30) == -signal.SIGKILL
        assert owners.labels() == []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(owners.alive(pid, None) and not _zombie(pid) for pid in pids):
            time.sleep(0.1)
        assert not [pid for pid in pids if owners.alive(pid, None) and not _zombie(pid)]
        leftover = [d for d in os.listdir(tmp_path / "labels") if not d.startswith(".")]
        assert leftover == []
        cgroups = [d for lab in labels for d in lab.cgroups]
        assert not [d for d in cgroups if os.path.isdir(d)]
        with open("/proc/self/mountinfo") as f:
            assert str(tmp_path) not in f.read()
    finally:
        os.environ.pop("RLF_SESSIONS_DIR", None)
        if p.poll() is None:
            p.kill()
            p.wait(30)
        if p.stdout is not None:
            p.stdout.close()


def test_a_label_directory_someone_else_made_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reaper SIGKILLs what the labels name: a label directory that another user made first (in a
    world-writable parent such as /dev/shm or /tmp), a link, or one others may write to is refused with what to do,
    never used; the default one is this user's own, mode 0700."""
    monkeypatch.delenv("RLF_SESSIONS_DIR", raising=False)
    assert owners.label_dir().startswith("/dev/shm/rlf-sessions-")  # a tmpfs: labels cost no journal flush
    st = os.lstat(owners.label_dir())
    assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700
    bad = [tmp_path / "open", tmp_path / "link", tmp_path / "theirs"]
    bad[0].mkdir(mode=0o777)
    bad[0].chmod(0o777)
    bad[1].symlink_to(tmp_path)
    bad[2].mkdir(mode=0o700)
    os.chown(bad[2], 12345, 12345)
    for d in bad:
        monkeypatch.setenv("RLF_SESSIONS_DIR", str(d))
        with pytest.raises(PermissionError, match="not this user's own.*RLF_SESSIONS_DIR"):
            owners.label_dir()
    monkeypatch.setenv("RLF_SESSIONS_DIR", str(tmp_path / "mine"))
    assert owners.label_dir() == str(tmp_path / "mine") and (tmp_path / "mine").stat().st_mode & 0o777 == 0o700


def test_session_processes_have_no_leftover_uid_processes_after_close() -> None:
    async def go(b: LocalBackend) -> int:
        s = await b.create(SessionSpec(limits=FAST))
        await s.exec("setsid sleep 1000 > /dev/null 2>&1 & sleep 1000 > /dev/null 2>&1 &")
        await s.aclose()
        return s.uid

    uid = run(go)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _procs_of_uid(uid):
        time.sleep(0.1)
    assert _procs_of_uid(uid) == []


def _procs_of_uid(uid: int) -> list[int]:
    out = []
    for n in os.listdir("/proc"):
        if n.isdigit():
            try:
                if os.stat(f"/proc/{n}").st_uid == uid and not _zombie(int(n)):
                    out.append(int(n))
            except OSError:
                pass
    return out


@pytest.mark.slow
def test_256_concurrent_sessions_queue_instead_of_timing_out() -> None:
    async def go(b: LocalBackend) -> None:
        async def episode() -> str:
            async with await b.create(SessionSpec(limits=SessionLimits(exec_timeout_s=120, disk_mb=8))) as s:
                return (await s.exec("echo ok")).stdout

        outs = await asyncio.gather(*(episode() for _ in range(256)))
        assert outs == ["ok\n"] * 256

    run(go, pool_size=4, max_starting=8)


def test_types_are_importable_without_the_backends() -> None:
    code = ("import sys; import rlf_envs.sandbox.sessions as s; "
            "assert 'docker' not in sys.modules and 'torch' not in sys.modules; print(s.SessionSpec().image)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    assert r.stdout == "host\n", r.stderr


def test_sessions_run_on_rlf_runtime_loop(seed: Path) -> None:
    """The loop envs use (`rlf_envs.runtime`, uvloop where installed, on a daemon thread)."""
    from rlf_envs import runtime

    async def go() -> tuple[str, bool, str]:
        b = LocalBackend(pool_size=1)
        try:
            async with await b.create(SessionSpec(seed_dir=str(seed), limits=FAST)) as s:
                r = await s.exec("echo hi; sleep 30", timeout_s=1)
                await s.exec("echo more >> README")
                return r.stdout, r.timed_out, await s.diff()
        finally:
            await b.aclose()

    out, timed_out, patch = runtime.run(go())
    assert out == "hi\n" and timed_out and "+more" in patch


# ------------------------------------------------------------------ the sandbox's filter, cgroup and clean-up
# (sessions share `sandbox._seccomp`, `sandbox._cgroup` and `sandbox.cleanup` with the stateless sandbox)

def test_session_sockets_only_of_the_families_a_session_needs() -> None:
    """AF_VSOCK is not isolated by the network namespace (a channel between sessions and to the hypervisor);
    AF_NETLINK, AF_PACKET, AF_ALG, AF_BLUETOOTH are kernel surface a shell session has no use for."""
    probe = textwrap.dedent("""
        import errno, socket
        out = []
        for name, fam, typ in (("vsock", 40, socket.SOCK_STREAM), ("netlink", 16, socket.SOCK_RAW),
                               ("packet", 17, socket.SOCK_RAW), ("alg", 38, socket.SOCK_SEQPACKET),
                               ("bluetooth", 31, socket.SOCK_STREAM)):
            try:
                socket.socket(fam, typ).close()
                out.append(name + ":open")
            except OSError as e:
                out.append(name + ":" + errno.errorcode.get(e.errno, str(e.errno)))
        try:
            socket.socketpair(40, socket.SOCK_STREAM)
            out.append("vsockpair:open")
        except OSError as e:
            out.append("vsockpair:" + errno.errorcode.get(e.errno, str(e.errno)))
        a, b = socket.socketpair()  # what a session needs still works: unix, IP (loopback only here)
        a.sendall(b"x"); assert b.recv(1) == b"x"
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM); s.close()
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.close()
        print(" ".join(out))
    """)

    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(limits=FAST)) as s:
            r = await s.exec(["python3", "-c", probe])
            assert r.exit_code == 0, r
            assert r.stdout.split() == ["vsock:EAFNOSUPPORT", "netlink:EAFNOSUPPORT", "packet:EAFNOSUPPORT",
                                        "alg:EAFNOSUPPORT", "bluetooth:EAFNOSUPPORT", "vsockpair:EAFNOSUPPORT"], r

    run(go)


def test_session_refuses_new_namespaces_bpf_perf_and_userfaultfd() -> None:
    """unshare (any flags), setns, clone with a CLONE_NEW* flag, bpf, perf_event_open, userfaultfd: EPERM from the
    filter; clone3 ENOSYS (libc falls back to clone); threads and subprocesses still work."""
    probe = textwrap.dedent("""
        import ctypes, os, platform, subprocess, threading
        libc = ctypes.CDLL(None, use_errno=True)
        nr = {"x86_64": dict(unshare=272, setns=308, bpf=321, perf=298, uffd=323, clone=56, clone3=435),
              "aarch64": dict(unshare=97, setns=268, bpf=280, perf=241, uffd=282, clone=220, clone3=435)}
        n = nr[platform.machine()]
        fd = os.open("/proc/self/ns/uts", os.O_RDONLY)
        out = []
        for call, args in ((n["unshare"], (0,)), (n["unshare"], (0x00020000,)), (n["setns"], (fd, 0)),
                           (n["bpf"], (0, 0, 0)), (n["perf"], (0, 0, -1, -1, 0)), (n["uffd"], (0,)),
                           (n["clone"], (0x20000000 | 17, 0, 0, 0, 0)), (n["clone3"], (0, 0))):
            r = libc.syscall(call, *args)
            out.append(f"{r}:{ctypes.get_errno()}")
        t = threading.Thread(target=lambda: out.append("thread"))
        t.start(); t.join()
        out.append(subprocess.run(["sh", "-c", "echo sub"], capture_output=True, text=True).stdout.strip())
        print(" ".join(out))
    """)

    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(limits=FAST)) as s:
            r = await s.exec(["python3", "-c", probe])
            assert r.stdout.split() == ["-1:1"] * 7 + ["-1:38", "thread", "sub"], r
            r = await s.exec("unshare -n true; echo rc=$?; unshare -m true; echo rc=$?")
            assert "rc=0" not in r.stdout, r

    run(go)


DEEP_AND_LOCKED = textwrap.dedent("""
    import os
    home = os.getcwd()
    for top in (home, "/tmp"):
        os.chdir(top)
        os.mkdir("deep")
        os.chdir("deep")
        for i in range(3000):  # deeper than PATH_MAX and than Python's recursion limit
            os.mkdir("d")
            os.chdir("d")
        with open("f", "w") as f:
            f.write("x")
        os.chdir(top)
        os.makedirs("locked/inner")
        for name in ("locked", "locked/inner"):
            with open(name + "/file", "w") as f:
                f.write("y" * 1000)
        os.chmod("locked/inner", 0)
        os.chmod("locked", 0)
    print("made")
""")


def test_deep_trees_and_mode_000_dirs_do_not_break_close_or_leave_anything(tmp_path: Path) -> None:
    os.environ["RLF_SESSIONS_DIR"] = str(tmp_path / "labels")
    try:
        async def go(b: LocalBackend) -> tuple[str, int]:
            s = await b.create(SessionSpec(limits=SessionLimits(exec_timeout_s=60, session_timeout_s=120,
                                                                 disk_mb=64, memory_mb=512, pids=64)))
            r = await s.exec(["python3", "-c", DEEP_AND_LOCKED], timeout_s=60)
            assert r.stdout == "made\n", r
            with pytest.raises(SessionError):  # a read through the mode-000 dir: refused, the session lives on
                await s.read_file("locked/inner/file")
            assert (await s.exec("echo alive")).stdout == "alive\n"
            assert isinstance(await s.diff(), str)  # a user's tree, not an infrastructure failure
            await s.aclose()  # never raises
            await s.aclose()
            return s.id, s.uid

        sid, uid = run(go)
        left = [p for p in (tmp_path / "labels").rglob("*")]
        assert left == [tmp_path / "labels" / ".mnt"] or left == [], left  # no label, nothing mounted or written
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _procs_of_uid(uid):
            time.sleep(0.1)
        assert _procs_of_uid(uid) == []
    finally:
        os.environ.pop("RLF_SESSIONS_DIR", None)


def _cgroup_peak(dirs: list[str]) -> int | None:
    for d in dirs:
        for name in ("memory.peak", "memory.max_usage_in_bytes"):
            with contextlib.suppress(OSError, ValueError), open(os.path.join(d, name)) as f:
                return int(f.read())
    return None


def test_memory_above_the_session_limit_is_killed_for_the_whole_process_tree() -> None:
    """A tree of processes (a shell, forked Python children), none over its own RLIMIT_AS, together far above the
    session's memory: the kernel kills inside the session's cgroup, and the tree's peak stays under the limit."""
    lim = SessionLimits(memory_mb=160, disk_mb=16, pids=64, exec_timeout_s=60)
    tree = textwrap.dedent("""
        import os, time
        kids = []
        for i in range(6):
            pid = os.fork()
            if pid == 0:
                b = b"x" * (100 << 20)  # touched pages: 100 MB resident each, 600 MB in all
                time.sleep(4)
                os._exit(0)
            kids.append(pid)
        print(sum(os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) != 0 for k in kids))
    """)

    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(limits=lim)) as s:
            if s._agent.cgroup is None:
                pytest.skip("no session cgroup on this host (rlimits only)")
            r = await s.exec(["python3", "-c", tree], timeout_s=60)
            assert r.exit_code == 0 and int(r.stdout) >= 1, r  # some of the tree was killed
            peak = _cgroup_peak(s._agent.cgroup)
            limit = (lim.memory_mb + lim.disk_mb + 64) << 20
            if peak is not None:
                assert peak <= limit, (peak, limit)
            assert (await s.exec("echo alive")).stdout == "alive\n"  # the session itself survives

    run(go)


def test_what_a_shell_session_needs_still_works_under_the_filter() -> None:
    """pip from a local directory, git, threads, multiprocessing, asyncio (a socketpair) and getaddrinfo (netlink
    refused: glibc falls back) under the sandbox's filter, in the host image."""
    script = textwrap.dedent("""\
        set -e
        mkdir -p pkg/mypkg && echo 'X = 1' > pkg/mypkg/__init__.py
        printf '[project]\\nname = "mypkg"\\nversion = "0.1"\\n' > pkg/pyproject.toml
        printf '[build-system]\\nrequires = ["setuptools"]\\n' >> pkg/pyproject.toml
        printf 'build-backend = "setuptools.build_meta"\\n' >> pkg/pyproject.toml
        if python3 -m pip --version > /dev/null 2>&1 && python3 -c 'import setuptools' 2> /dev/null; then
            python3 -m pip install -q --no-index --no-build-isolation --target site ./pkg
            PYTHONPATH=site python3 -c 'import mypkg; print("pip", mypkg.X)'
        else
            echo "pip n/a"  # (a host without pip or setuptools for /usr/bin/python3)
        fi
        git init -q r && cd r && git -c user.email=a@b -c user.name=n commit -q --allow-empty -m x && cd ..
        echo "git $(git -C r rev-list --count HEAD)"
        python3 -c '
        import asyncio, concurrent.futures as cf, multiprocessing as mp, socket
        async def f():
            return 1
        print("asyncio", asyncio.run(f()))
        with cf.ThreadPoolExecutor(4) as ex:
            print("threads", sum(ex.map(abs, [1, 2])))
        with mp.Pool(2) as p:
            print("mp", sum(p.map(abs, [1, -2])))
        print("resolve", socket.getaddrinfo("127.0.0.1", 80)[0][4][0])
        '
    """)
    lim = SessionLimits(exec_timeout_s=120, session_timeout_s=240, memory_mb=1024, disk_mb=128, pids=128)

    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(limits=lim)) as s:
            r = await s.exec(script, timeout_s=120)
            assert r.exit_code == 0, r
            assert r.stdout.split("\n")[0] in ("pip 1", "pip n/a"), r
            assert r.stdout.split("\n")[1:6] == ["git 1", "asyncio 1", "threads 3", "mp 3", "resolve 127.0.0.1"], r

    run(go)
