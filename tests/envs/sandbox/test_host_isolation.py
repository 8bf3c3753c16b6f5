"""The holes an outside attack suite found in the sandbox (issue 33), each as an attack that must fail: cross-run
leaks through host directories a run could write (/run/lock), the host's disk filled from a run, host Unix sockets
reached from a run, kernel keyrings shared between runs, verdicts forged by shadowing names the tests use, task
data read from disk, and a forked worker that kept the capabilities of its user namespace.

Every run-side test goes through the three ways a run is started: a direct worker, a pooled supervisor with its
forked worker, and the cold path (a supervisor and a worker interpreter of their own). The same file runs as an
unprivileged user (uid 65534 with a venv of the system Python, see docs/security-sandbox.md), where runs get a user
namespace instead of a uid of their own.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlf_envs.sandbox import SandboxLimits, SandboxPool, SandboxResult, hide_from_runs, run_python, run_tests

pytestmark = pytest.mark.timeout(180)

FAST = SandboxLimits(timeout_s=20.0, cpu_s=10, file_mb=4)


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


def _need_root_of_its_own(r: SandboxResult) -> None:
    if "minimal_root" not in r.guards and "pid_ns" not in r.guards:
        pytest.skip(f"no namespaces here: {r.missing_guards}")


# Host directories outside the run's scratch space that the run's uid could write to before (mode o+w, like
# /run/lock's 1777), found by the test on this machine; and some everyone has.
_SCRATCH = ("/tmp", "/var/tmp", "/dev/shm", "/proc", "/sys")


def _host_writable_dirs() -> list[str]:
    found = {"/run/lock", "/var/lock", "/var/crash", "/var/mail", "/dev/mqueue"}
    for top in ("/run", "/var", "/dev", "/etc", "/opt", "/srv", "/home", "/mnt", "/media", "/usr", "/work"):
        for dirpath, dirnames, _ in os.walk(top):
            if dirpath.count("/") >= 4 or any(dirpath == s or dirpath.startswith(s + "/") for s in _SCRATCH):
                dirnames[:] = []
                continue
            try:
                if os.stat(dirpath).st_mode & stat.S_IWOTH:
                    found.add(dirpath)
            except OSError:
                pass
    return sorted(d for d in found if os.path.isdir(d) and not os.path.islink(d))


WRITER = textwrap.dedent("""
    import os, sys
    dirs, name, mb = {dirs!r}, {name!r}, {mb}
    for d in dirs:
        written = 0
        try:
            with open(os.path.join(d, name), "wb") as f:
                for _ in range(mb):
                    f.write(b"x" * (1 << 20))
                    f.flush()
                    written += 1
        except OSError:
            pass
        if written:
            print("WROTE", d, written, flush=True)
""")


def test_no_host_directory_outside_the_work_dir_keeps_what_a_run_writes(pool: SandboxPool | bool) -> None:
    """Classes 1 and 2: nothing a run writes outside its work dir reaches the host (no cross-run channel, no host
    disk filled): what it can write at all lands in its own bounded tmpfs, gone after the run."""
    dirs = [*_host_writable_dirs(), "/", "/etc", "/usr", "/run", "/var", "/tmp", "/var/tmp", "/dev/shm"]
    name = f"rlf_leak_{secrets.token_hex(6)}"
    try:
        a = run(WRITER.format(dirs=dirs, name=name, mb=40), pool)
        _need_root_of_its_own(a)
        wrote = {line.split()[1]: int(line.split()[2]) for line in a.stdout.splitlines() if line.startswith("WROTE")}
        on_host = [d for d in dirs if os.path.lexists(os.path.join(d, name))]
        assert on_host == [], (on_host, a.stdout)
        # what it could write went to its own scratch tmpfs, bounded (file_mb=4 -> 16 MB each), not the host disk
        assert set(wrote) <= {"/tmp", "/var/tmp", "/dev/shm"}, wrote
        assert all(mb <= 16 for mb in wrote.values()), wrote
        # and the next run (another uid as root) finds nothing of it
        b = run(f"import os\nprint([d for d in {dirs!r} if os.path.lexists(os.path.join(d, {name!r}))])", pool)
        assert b.stdout.strip() == "[]", b
    finally:
        for d in dirs:
            try:
                os.unlink(os.path.join(d, name))
            except OSError:
                pass


def test_host_unix_sockets_are_unreachable(pool: SandboxPool | bool) -> None:
    """Class 3: a Unix socket the host listens on, in a directory any uid can enter, with a socket mode of 0777."""
    d = None
    for parent in ("/run", "/srv", "/opt", "/var", "/run/lock", "/var/lock", os.path.expanduser("~")):
        if os.path.isdir(parent) and not any(parent == s or parent.startswith(s + "/") for s in _SCRATCH):
            try:
                d = tempfile.mkdtemp(prefix="rlf_sock_", dir=parent)
                break
            except OSError:
                continue
    if d is None:
        pytest.skip("no directory outside /tmp, /var/tmp and /dev/shm where this user can create a socket")
    os.chmod(d, 0o755)
    path = os.path.join(d, "s")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(path)
        os.chmod(path, 0o777)
        server.listen(4)
        server.setblocking(False)
        code = textwrap.dedent(f"""
            import socket
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect({path!r})
                s.sendall(b"hello from the run")
                print("CONNECTED")
            except OSError as e:
                print("BLOCKED", e)
        """)
        r = run(code, pool)
        _need_root_of_its_own(r)
        assert "BLOCKED" in r.stdout and "CONNECTED" not in r.stdout, r
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever connected
    finally:
        server.close()
        os.unlink(path) if os.path.lexists(path) else None
        os.rmdir(d)


KEYS = textwrap.dedent("""
    import ctypes, sys
    libc = ctypes.CDLL(None, use_errno=True)
    mode, desc, secret = sys.argv[1:] if len(sys.argv) > 1 else ({mode!r}, {desc!r}, {secret!r})
    NR = {{"x86_64": (248, 250), "aarch64": (217, 219)}}[__import__("os").uname().machine]
    if mode == "add":
        serial = libc.syscall(NR[0], b"user", desc.encode(), secret.encode(), len(secret), ctypes.c_int(-4))
        print("ADD", serial, ctypes.get_errno(), flush=True)
        if serial > 0:
            libc.syscall(NR[1], 5, serial, 0x3F3F3F3F)  # KEYCTL_SETPERM: everything to everyone
    else:
        for line in open("/proc/keys"):
            if desc in line:
                serial = int(line.split()[0], 16)
                buf = ctypes.create_string_buffer(256)
                n = libc.syscall(NR[1], 11, serial, buf, 256)  # KEYCTL_READ
                print("FOUND", n, buf.raw[: max(n, 0)].decode(errors="replace"), flush=True)
        print("DONE", flush=True)
""")


def test_kernel_keyrings_are_out_of_reach(pool: SandboxPool | bool) -> None:
    """Class 4: a key added to the user keyring with permissions opened to all, read by the next run through
    /proc/keys and KEYCTL_READ; and the key (per-uid kernel state) outliving the run."""
    if os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip("syscall numbers for x86_64 and aarch64 only")
    desc, secret = f"rlf_{secrets.token_hex(6)}", secrets.token_hex(8)
    a = run(KEYS.format(mode="add", desc=desc, secret=secret), pool)
    assert "ADD -1 1" in a.stdout, a  # EPERM: no key call at all
    assert "no_keyrings" in a.guards, a.guards
    b = run(KEYS.format(mode="read", desc=desc, secret=secret), pool)
    assert "DONE" in b.stdout and secret not in b.stdout and "FOUND" not in b.stdout, b
    with open("/proc/keys") as f:
        assert desc not in f.read()  # nothing of the run is left in the kernel's keys


def test_a_run_holds_no_capabilities(pool: SandboxPool | bool) -> None:
    """A worker forked inside a user namespace (a non-root pool) kept every capability there (CapEff all ones),
    enough to unmount its private /tmp and see the host's; as root the run's uid has none either. Nor can the run
    get them back in a user namespace of its own (the kernel refuses one to a chrooted process)."""
    r = run("import ctypes\nprint(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "print('UMOUNT', libc.umount2(b'/tmp', 2), ctypes.get_errno())\n"
            "print('USERNS', libc.unshare(0x10000000), ctypes.get_errno())", pool)
    if "uid" not in r.guards and os.geteuid() == 0:
        pytest.skip("runs as root here")
    cap, umount, userns = r.stdout.splitlines()
    assert int(cap, 16) == 0, r
    assert umount.startswith("UMOUNT -1"), r
    if "minimal_root" in r.guards:  # no new user namespace (full capabilities there) from inside a chroot
        assert userns.startswith("USERNS -1"), r


def test_rlf_envs_task_data_is_unreadable(pool: SandboxPool | bool) -> None:
    """Class 6: Code-v0's answers in the checkout (or wherever rlf_envs is installed)."""
    from rlf_envs.data.code import split_path

    path = str(split_path("train"))
    assert os.path.getsize(path) > 0
    code = textwrap.dedent(f"""
        try:
            print("READ", len(open({path!r}).read()))
        except OSError as e:
            print("BLOCKED", type(e).__name__)
    """)
    r = run(code, pool)
    _need_root_of_its_own(r)
    assert "BLOCKED" in r.stdout or "READ 0" in r.stdout, r


def test_task_data_inside_the_interpreters_directories_is_hidden(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Class 6, where the data lies inside what a run must see: a dataset installed into the interpreter's own
    directory (here a venv), loaded with `load_tasks`, is covered in every run (file and directory)."""
    from rlf_envs.tasks import load_tasks

    top = tempfile.mkdtemp(prefix="rlf_venv_", dir="/tmp")
    try:
        os.chmod(top, 0o755)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", top], check=True, timeout=120)
        data = Path(top, "share", "rlf_data")
        data.mkdir(parents=True)
        (data / "tasks.jsonl").write_text('{"id": "t", "question": "q", "answer": "SECRET-ANSWER"}\n')
        other = Path(top, "share", "more_data")
        other.mkdir()
        (other / "answers.txt").write_text("SECRET-DIR")
        for p in (data, other):
            os.chmod(p, 0o755)
        os.chmod(data / "tasks.jsonl", 0o644)
        os.chmod(other / "answers.txt", 0o644)
        assert load_tasks(data / "tasks.jsonl")[0].ground_truth == "SECRET-ANSWER"  # registered by the loader
        hide_from_runs(other)
        code = textwrap.dedent(f"""
            import os, sys
            print("PREFIX", sys.prefix)
            for p in ({str(data / "tasks.jsonl")!r}, {str(other / "answers.txt")!r}):
                try:
                    print("READ", repr(open(p).read()))
                except OSError as e:
                    print("BLOCKED", type(e).__name__)
        """)
        for pool in (None, False):
            r = run(code, pool, python=os.path.join(top, "bin", "python"))  # type: ignore[arg-type]
            _need_root_of_its_own(r)
            assert f"PREFIX {top}" in r.stdout, r
            assert "SECRET" not in r.stdout, r
    finally:
        subprocess.run(["rm", "-rf", top], check=False, timeout=60)


SHADOWING = textwrap.dedent("""
    def f(x):
        return 0
    def abs(x):
        return 0
    def sorted(x, **kw):
        return [7]
    def len(x):
        return 5
    def round(x, n=None):
        return 3
    class set(list):
        pass
    class math:
        @staticmethod
        def isclose(a, b, **kw):
            return True
    re = None
""")


def test_a_solution_cannot_shadow_what_the_tests_use() -> None:
    """Class 5: builtins and stdlib modules in the tests are the real ones whatever the solution defines."""
    tests = ["assert abs(f(2) - 5) < 1e-9", "assert sorted([f(1), 2]) == [7]", "assert len([f(1)]) == 5",
             "assert round(f(1)) == 3", "assert math.isclose(f(2), 5)", "assert isinstance(set([f(1)]), list)",
             "from solution import *\nassert abs(f(2) - 5) < 1e-9"]
    r = asyncio.run(run_tests(SHADOWING, tests, FAST))
    assert r.error is None, r
    assert r.test_results == (False,) * len(tests), list(zip(r.test_results, r.test_errors, strict=True))


def test_a_solution_that_redefines_builtins_still_runs_as_written() -> None:
    solution = textwrap.dedent("""
        import math as m
        def abs(x):
            return x if x > 0 else -x
        def len(s):
            return sum(1 for _ in s) * 10
        def f(x):
            return abs(x) + 3
        def g(s):
            return len(s)
    """)
    tests = ["assert f(-2) == 5", "assert g('ab') == 20", "assert abs(-1) == 1 and len('ab') == 2",
             "import solution\nassert solution.abs(-4) == 4", "assert m.sqrt(4) == 2",
             "import math\nassert math.pi > 3"]
    r = asyncio.run(run_tests(solution, tests, FAST))
    assert r.test_results == (True,) * len(tests), list(zip(r.test_results, r.test_errors, strict=True))


def test_a_minimal_root_still_has_what_programs_use(pool: SandboxPool | bool) -> None:
    """The other side of the minimal root: device nodes, shared memory, a shell, the time zone, the user database,
    the work dir (writable) and scratch space; the rest of the root read-only."""
    code = textwrap.dedent("""
        import os, pwd, subprocess, time, multiprocessing
        open("/dev/null", "w").write("x")
        assert len(open("/dev/urandom", "rb").read(8)) == 8 and open("/dev/zero", "rb").read(2) == b"\\0\\0"
        lock = multiprocessing.Lock()  # a POSIX semaphore in /dev/shm
        with lock:
            pass
        sh = subprocess.run(["/bin/sh", "-c", "echo sh ok"], capture_output=True, text=True, timeout=10)
        print(sh.stdout.strip())
        print(pwd.getpwuid(0).pw_name, time.tzname[0] != "")
        open("here.txt", "w").write("work dir")
        open("/tmp/t.txt", "w").write("scratch")
        for p in ("/x", "/etc/x", "/usr/x", "/dev/x"):
            try:
                open(p, "w")
                print("WROTE", p)
            except OSError:
                pass
        print("done")
    """)
    r = run(code, pool)
    _need_root_of_its_own(r)
    assert r.exit_code == 0 and r.stdout.split("\n") == ["sh ok", "root True", "done", ""], r


def test_a_work_dir_outside_tmp_gets_a_root_of_its_own(pool: SandboxPool | bool) -> None:
    """A work dir whose mount point the shared, read-only root lacks (not under /tmp): the run builds its own root
    rather than make the one every run shares writable, and the next run's root is the pristine one."""
    from rlf_envs.sandbox import SandboxDir

    parent = None
    for cand in ("/srv", "/opt", "/run/lock", "/var/lock"):
        if os.path.isdir(cand) and os.access(cand, os.W_OK | os.X_OK):
            parent = tempfile.mkdtemp(prefix="rlf_wd_", dir=cand)
            os.chmod(parent, 0o755)
            break
    if parent is None:
        pytest.skip("no writable directory outside /tmp")
    try:
        with SandboxDir(parent=parent) as wd:
            r = run("import os\nopen('kept.txt', 'w').write('1')\nprint(sorted(os.listdir('/')))", pool, workdir=wd)
            _need_root_of_its_own(r)
            assert (wd.path / "kept.txt").read_text() == "1", r
            assert "minimal_root" in r.guards, r.missing_guards
            first = parent.split("/")[1]
            nxt = run("import os\nprint(sorted(os.listdir('/')))", pool)
            assert first in r.stdout and f"'{first}'" not in nxt.stdout.replace("'tmp'", ""), (r.stdout, nxt.stdout)
    finally:
        subprocess.run(["rm", "-rf", parent], check=False, timeout=60)
