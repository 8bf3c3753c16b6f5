"""rlf_envs.sandbox.run_python: output, limits, and hostile code that must neither escape nor harm us.

The guards that need the OS's help (namespaces, a uid of the run's own) are probed at run time: a test of
a guard the OS does not allow here is skipped with the reason the sandbox reported.
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rlf_envs.sandbox import SandboxDir, SandboxLimits, SandboxPool, SandboxResult, run_python, runner
from rlf_envs.sandbox._supervisor import _processes_of_uid

FAST = SandboxLimits(timeout_s=5.0, cpu_s=5)
SYSTEM_PYTHON = "/usr/bin/python3.11"


@pytest.fixture(scope="module", params=[True, False], ids=["direct", "supervised"])
def _pool(request: pytest.FixtureRequest) -> Iterator[SandboxPool]:
    with SandboxPool(size=2, direct=request.param) as p:
        yield p


@pytest.fixture(autouse=True)
def _both_pooled_paths(_pool: SandboxPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here runs on a direct worker (a default run as root) and on a supervised one."""
    monkeypatch.setattr(runner, "default_pool", lambda: _pool)


def _need(result: SandboxResult, guard: str) -> None:
    if guard not in result.guards:
        pytest.skip(f"guard {guard!r} not available here: {result.missing_guards.get(guard, 'not reported')}")


# Two set-ups: everything the OS allows, and (as root) no namespaces, where only the run's own uid and the
# subreaper walk contain the code; that one needs an interpreter other uids can read.
MODES = {"full": FAST, "uid_only": FAST.model_copy(update={"namespaces": False})}


def _mode(name: str) -> tuple[SandboxLimits, str | None]:
    if name == "uid_only":
        if os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK):
            pytest.skip(f"the uid-only set-up needs root and {SYSTEM_PYTHON}")
        return MODES[name], SYSTEM_PYTHON
    return MODES[name], None


@pytest.mark.asyncio
async def test_output_stdin_exit_code_and_environment() -> None:
    code = ("import os, sys\nprint(sys.stdin.read().upper())\nprint(sorted(os.environ))\n"
            "print(os.getcwd() == os.environ['HOME'])\nsys.exit(3)")
    r = await run_python(code, "hello", FAST)
    lines = r.stdout.splitlines()
    assert lines[0] == "HELLO" and r.exit_code == 3 and not r.timed_out and r.error is None
    assert lines[1] == str(sorted(["HOME", "LANG", "PATH", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED", "TMPDIR"]))
    assert lines[2] == "True"
    assert "rlimits" in r.guards and "session" in r.guards
    r = await run_python("raise ValueError('boom')", "", FAST)
    assert r.exit_code == 1 and "ValueError: boom" in r.stderr


@pytest.mark.asyncio
async def test_a_work_dir_persists_between_runs_and_is_removed() -> None:
    with SandboxDir() as wd:
        assert (await run_python("open('state.txt', 'w').write('42')", "", FAST, wd)).exit_code == 0
        r = await run_python("print(open('state.txt').read())", "", FAST, wd)
        assert r.stdout.strip() == "42"
        root = wd.root
    assert not root.exists()


@pytest.mark.asyncio
async def test_deadline_fires_and_output_is_capped() -> None:
    t0 = time.monotonic()
    r = await run_python("while True:\n    pass", "", SandboxLimits(timeout_s=1.0, cpu_s=30))
    assert r.timed_out and r.exit_code is None
    assert time.monotonic() - t0 < 15.0  # generous: the deadline fired, we did not wait for cpu_s
    r = await run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 10000)", "",
                         SandboxLimits(timeout_s=20.0, max_output_bytes=4096))
    assert r.output_truncated and not r.timed_out and len(r.stdout) == 4096


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_escaped_grandchild_is_killed_and_does_not_hang(mode: str, leftovers: Callable[[str], list[int]]) -> None:
    limits, python = _mode(mode)
    marker = f"{3600 + secrets.randbelow(10**6) / 10**7:.7f}"
    code = textwrap.dedent(f"""
        import os
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv("/bin/sleep", ["sleep", "{marker}"])
            os._exit(0)
        print("parent done")
    """)
    t0 = time.monotonic()
    r = await run_python(code, "", limits, python=python)
    assert r.exit_code == 0 and "parent done" in r.stdout, r
    assert time.monotonic() - t0 < 20.0
    assert leftovers(marker) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_cannot_signal_the_supervisor_or_read_environments(mode: str, tmp_path: Path, isolated: None) -> None:
    limits, python = _mode(mode)
    code = textwrap.dedent(f"""
        import os, signal
        hits = []
        for pid in os.listdir("/proc"):
            if pid.isdigit() and int(pid) != os.getpid():
                try:
                    if b"PATH=" in open(f"/proc/{{pid}}/environ", "rb").read():
                        hits.append(pid)
                except OSError:
                    pass
        for target in (os.getppid(), os.getpgid(os.getppid()) if os.getppid() else 0):
            if target > 1:
                for send in (os.kill, os.killpg):
                    try:
                        send(target, signal.SIGKILL)
                        print("SIGNALLED", target)
                    except OSError:
                        pass
        try:
            open({str(tmp_path / "escaped.txt")!r}, "w").write("x")
            print("WROTE")
        except OSError:
            pass
        print("ENVIRON", hits)
    """)
    r = await run_python(code, "", limits, python=python)
    assert r.error is None and r.exit_code == 0, r  # the supervisor survived to report
    assert "SIGNALLED" not in r.stdout and "WROTE" not in r.stdout, r.stdout
    assert "ENVIRON []" in r.stdout, r.stdout  # not even our own children's environments
    assert not (tmp_path / "escaped.txt").exists()


@pytest.mark.asyncio
async def test_private_tmp_hides_and_discards_writes() -> None:
    target = Path(f"/tmp/rlf_escape_{secrets.token_hex(6)}")
    try:
        r = await run_python(f"open({str(target)!r}, 'w').write('x')\nprint('ok')", "", FAST)
        _need(r, "private_tmp")
        assert r.exit_code == 0 and not target.exists()
    finally:
        target.unlink(missing_ok=True)


@pytest.mark.asyncio
async def test_no_network() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        code = textwrap.dedent(f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=2)
                print("CONNECTED")
            except OSError as e:
                print("BLOCKED", e)
        """)
        r = await run_python(code, "", FAST)
        _need(r, "net_ns")
        assert "BLOCKED" in r.stdout, r
        allowed = await run_python(code, "", FAST.model_copy(update={"network": True}))
        if "uid" in allowed.guards or "user_ns" in allowed.guards or os.geteuid() != 0:
            assert "net_ns" not in allowed.guards
            assert "CONNECTED" in allowed.stdout, allowed  # in the host's network: the server answers
    finally:
        server.close()


@pytest.mark.asyncio
async def test_fork_bomb_is_bounded() -> None:
    probe = await run_python("pass", "", FAST)
    _need(probe, "nproc")
    if "uid" not in probe.guards and "user_ns" not in probe.guards:
        pytest.skip(f"only an approximate process limit here: {probe.guards['nproc']}")
    code = textwrap.dedent("""
        import os, time
        print(os.getuid(), flush=True)
        n = 0
        end = time.monotonic() + 2
        while time.monotonic() < end:
            try:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                n += 1
            except OSError:
                time.sleep(0.01)
        print("forked", n, flush=True)
    """)
    t0 = time.monotonic()
    r = await run_python(code, "", SandboxLimits(timeout_s=6.0, cpu_s=5, max_processes=16))
    assert time.monotonic() - t0 < 30.0
    lines = r.stdout.split()
    assert "forked" in lines, r
    assert int(lines[lines.index("forked") + 1]) <= 16  # RLIMIT_NPROC held, even though we are root
    if "uid" in r.guards:
        uid = int(lines[0])
        deadline = time.monotonic() + 5
        while _processes_of_uid(uid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_of_uid(uid) == set()


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=1)
    with pytest.raises(ValueError, match="extra"):
        SandboxLimits(timeout=3)  # type: ignore[call-arg]


@pytest.mark.asyncio
async def test_control_character_output_comes_back_whole() -> None:
    # JSON escapes each control byte as 6 characters: the result line must still fit what we read back
    code = "import sys\nsys.stdout.buffer.write(b'\\x01' * 1_000_000)\nsys.stderr.buffer.write(b'\\x02' * 1_000_000)"
    r = await run_python(code, "", SandboxLimits(timeout_s=20.0, max_output_bytes=1_000_000))
    assert r.error is None and r.exit_code == 0 and not r.output_truncated
    assert r.stdout == "\x01" * 1_000_000 and r.stderr == "\x02" * 1_000_000


@pytest.mark.asyncio
async def test_a_sandbox_that_cannot_start_says_how_to_fix_it() -> None:
    r = await run_python("print(1)", "", FAST, python="/nonexistent/python")
    assert r.error is not None and "/nonexistent/python" in r.error and "set `python`" in r.error
    assert r.exit_code is None and not r.ok


@pytest.mark.asyncio
@pytest.mark.parametrize("private_parent", [False, True])
async def test_an_interpreter_inside_tmp_is_still_reachable(private_parent: bool) -> None:
    """A virtualenv under /tmp (a CI checkout in /tmp, tox's env in it) stays visible to the code although
    /tmp itself is a fresh tmpfs: the interpreter's own directories are bound back, read-only; also when a
    parent other uids cannot enter (tox makes `.tox` 0700) hides it."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(dir="/tmp", prefix="rlf_venv_") as top:
        os.chmod(top, 0o755)  # as a checkout would be: readable by the sandbox's uid
        d = os.path.join(top, ".tox", "env") if private_parent else top
        if private_parent:
            os.makedirs(os.path.dirname(d), mode=0o700)
            os.chmod(os.path.dirname(d), 0o700)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", d], check=True, timeout=120)
        python = os.path.join(d, "bin", "python")
        r = await run_python("import sys; print(sys.prefix)\nopen(sys.prefix + '/x', 'w')", python=python)
        assert r.stdout.splitlines()[0] == d, (r.error, r.stderr)
        assert "Read-only file system" in r.stderr or "Permission denied" in r.stderr  # bound back read-only
        assert not os.path.exists(os.path.join(d, "x"))


@pytest.mark.parametrize("supervisor", ["alive", "dead"])
def test_a_worker_whose_supervisor_died_during_its_set_up_exits(supervisor: str) -> None:
    """A supervisor that dies between forking the worker and the worker's PR_SET_PDEATHSIG sends no signal, and in
    a new pid namespace getppid() cannot tell: the worker's set-up checks a pidfd of its supervisor and exits."""
    from rlf_envs.sandbox._supervisor import _worker_preexec

    if not hasattr(os, "pidfd_open"):
        pytest.skip("needs pidfd_open (Linux >= 5.3)")
    gone = None
    if supervisor == "alive":
        fd = os.pidfd_open(os.getpid())
    else:
        gone = os.fork()
        if gone == 0:  # pragma: no cover - the child
            os._exit(0)
        fd = os.pidfd_open(gone)
        select.select([fd], [], [], 10)  # exited (not reaped yet, so the pidfd could be opened)
    job = {"limits": FAST.model_dump(), "_supervisor_pid": os.getpid()}  # getppid() alone would pass either way
    preexec = _worker_preexec(job, pid_ns=False, uid=None, nproc=None, parent_fd=fd)
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            preexec()
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    os.close(fd)
    if gone is not None:
        os.waitpid(gone, 0)
    assert os.waitstatus_to_exitcode(status) == (0 if supervisor == "alive" else 111)
