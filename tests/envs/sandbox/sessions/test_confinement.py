"""The local session backend's confinement (the third outside attack round): what the session's policy cannot reach
through the file tools, what it cannot turn into an infrastructure failure, and what a clean exit leaves behind.

1. The file tools stay inside the session's root: no descriptor or cwd of the agent points outside it (the seed is
   bound read-only under a root-only directory inside the root, the root is switched with pivot_root, so the host's
   filesystem is not in the session's mount namespace at all), paths are resolved in the root (openat2
   RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS, or a walk refusing symlinks), /proc is not a file of the session, and
   the caches rlf writes for tasks are root-only.
2. What the policy's arguments or processes cause is the episode's failure (SessionError, SessionLimitExceeded,
   SessionDiffTooLarge, SessionExpired), never a SessionInfraError: bad paths, a diff past its limit, a wall clock
   spent, every writable place and the memory filled at once.
3. A clean exit (a closed backend, an interpreter exit through rlf's runtime closers) leaves no label and no cgroup;
   `images.py` runs as a script of a venv's python.

Needs root (the local backend); the image tests need the Debian test image (`images.debian_test_image()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from repo_paths import REPO

from rlf_envs.sandbox.sessions import (
    SessionDiffTooLarge,
    SessionError,
    SessionExpired,
    SessionInfraError,
    SessionLimitExceeded,
    SessionLimits,
    SessionSpec,
    images,
)
from rlf_envs.sandbox.sessions.local import LocalBackend
from tests.envs.sandbox.sessions.test_local_sessions import run as local_run

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(os.geteuid() != 0, reason="the local session backend needs root")]

REPO = REPO
FAST = SessionLimits(exec_timeout_s=30, session_timeout_s=240, memory_mb=256, pids=64, disk_mb=64)
IMAGE = images.debian_test_image()
needs_image = pytest.mark.skipif(IMAGE is None, reason="the Debian test image is not built "
                                                       "(python -m rlf_envs.sandbox.sessions.images build-debian)")


def run(fn: Callable[[LocalBackend], Awaitable[Any]], **kw: Any) -> Any:
    """`fn` on a fresh backend whose first default-image session runs on a recycled agent (`test_local_sessions.run`:
    every attack below must fail there as on a fresh agent)."""
    return local_run(fn, **kw)


@pytest.fixture()
def exposed(tmp_path: Path) -> Path:
    """A seed directory whose parent holds a host file any uid could read (0755 / 0644), as a cache's would."""
    tmp_path.chmod(0o755)
    (tmp_path / "secret.txt").write_text("host secret\n")
    (tmp_path / "secret.txt").chmod(0o644)
    seed = tmp_path / "seed"
    seed.mkdir(mode=0o755)
    (seed / "a.txt").write_text("a\n")
    return seed


def _c_pid(s: Any) -> int:
    return int(s._agent.label.procs[0][0])


# ------------------------------------------------------------------------------------------- 1. file tools


def test_file_tools_cannot_follow_the_agents_descriptors_out_of_the_root(exposed: Path) -> None:
    """`read_file("/proc/self/fd/<n>/../secret.txt")` (the agent's own descriptor of the seed) and a link the
    session's shell plants to it read no host file; `write_file` through them creates none."""
    host_dir = exposed.parent

    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(limits=FAST, seed_dir=str(exposed))) as s:
            for n in range(0, 12):
                for path in (f"/proc/self/fd/{n}/../secret.txt", f"/proc/1/fd/{n}/../secret.txt",
                             f"/proc/self/fd/{n}/secret.txt"):
                    with contextlib.suppress(SessionError):
                        got = await s.read_file(path)
                        assert b"host secret" not in got, (path, got)
                r = await s.exec(f"ln -s /proc/self/fd/{n}/.. esc{n}; ln -s /proc/1/fd/{n}/.. one{n}")
                assert r.exit_code == 0, r
                for path in (f"esc{n}/secret.txt", f"one{n}/secret.txt"):
                    with contextlib.suppress(SessionError):
                        got = await s.read_file(path)
                        assert b"host secret" not in got, (path, got)
                for path in (f"/proc/self/fd/{n}/../pwned{n}", f"esc{n}/pwned-link{n}", f"one{n}/pwned-one{n}"):
                    with contextlib.suppress(SessionError):
                        await s.write_file(path, "pwned\n")
            left = sorted(p.name for p in host_dir.iterdir() if p.name.startswith("pwned"))
            assert left == [], left
            assert (await s.read_file("a.txt")) == b"a\n"

    run(go)


def test_magic_links_and_proc_are_refused_but_links_inside_the_session_work(tmp_path: Path) -> None:
    """/proc/*/root, /proc/*/cwd, /proc/*/fd/* are refused, and /proc is no file of the session (the agent's own
    environment holds nothing of the trainer's either); links inside the session that point inside resolve in its
    root, `..` stops at the root, relative paths start at the workdir."""
    os.environ["RLF_TEST_TRAINER_SECRET"] = "trainer-secret-value"
    try:
        async def go(b: LocalBackend) -> None:
            async with await b.create(SessionSpec(limits=FAST)) as s:
                for path in ("/proc/self/root/etc/passwd", "/proc/1/root/etc/passwd", "/proc/self/cwd/x",
                             "/proc/self/environ", "/proc/1/environ", "/proc/self/status", "/proc/self/fd/0",
                             "/proc/self/exe", "/proc/1/mem"):
                    with pytest.raises(SessionError) as ei:
                        got = await s.read_file(path)
                        assert b"trainer-secret-value" not in got
                    assert not isinstance(ei.value, SessionInfraError), ei.value
                for path in ("/proc/self/oom_score_adj", "/proc/self/comm", "/proc/1/root/workspace/w",
                             "/proc/self/fd/1"):
                    with pytest.raises(SessionError) as ei:
                        await s.write_file(path, "-1000\n")
                    assert not isinstance(ei.value, SessionInfraError), ei.value
                # inside the session: links, `..`, relative paths
                await s.write_file("dir/inner/f.txt", "inner\n")
                r = await s.exec("ln -s dir/inner rel && ln -s /workspace/dir abs && ln -s /etc/passwd pw && "
                                 "ln -s ../../../../../../etc up")
                assert r.exit_code == 0, r
                assert await s.read_file("rel/f.txt") == b"inner\n"
                assert await s.read_file("abs/inner/f.txt") == b"inner\n"
                assert b"sandbox:" in await s.read_file("pw")
                assert b"sandbox:" in await s.read_file("up/passwd")
                assert b"sandbox:" in await s.read_file("../../../../etc/passwd")
                await s.write_file("abs/inner/g.txt", "via a link\n")
                assert (await s.exec("cat dir/inner/g.txt; stat -c %u dir/inner/g.txt")).stdout.split("\n")[:2] \
                    == ["via a link", str(s.uid)]
                await s.write_file("new/deep/er/h.txt", b"\x00\x01")
                assert (await s.exec("stat -c %u new new/deep new/deep/er/h.txt")).stdout.split() == [str(s.uid)] * 3

        run(go)
    finally:
        os.environ.pop("RLF_TEST_TRAINER_SECRET", None)


SETNS = textwrap.dedent("""
    import ctypes, json, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/proc/{sys.argv[1]}/ns/mnt", os.O_RDONLY)
    if libc.setns(fd, 0x00020000) != 0:
        raise OSError(ctypes.get_errno(), "setns")
    os.chdir("/")
    with open("/proc/1/mountinfo") as f:  # (the session's /proc: its pid 1, the agent, is in this namespace)
        mounts = [line.split()[4] for line in f]
    print(json.dumps({"exists": {p: os.path.exists(p) for p in sys.argv[2:]}, "mounts": mounts}))
""")


def _agent_holds_nothing_outside(s: Any, host_paths: list[str]) -> None:
    c = _c_pid(s)
    host_dev = os.stat("/dev/null")
    for n in os.listdir(f"/proc/{c}/fd"):
        link = f"/proc/{c}/fd/{n}"
        try:
            st = os.stat(link)
        except OSError:
            continue
        assert not stat.S_ISDIR(st.st_mode) and not stat.S_ISREG(st.st_mode), (n, os.readlink(link))
        assert (st.st_dev, st.st_ino) != (host_dev.st_dev, host_dev.st_ino), (n, os.readlink(link))
    root = os.stat(f"/proc/{c}/root")
    assert (root.st_dev, root.st_ino) != (os.stat("/").st_dev, os.stat("/").st_ino)
    cwd = os.stat(f"/proc/{c}/cwd")
    ws = os.stat(f"/proc/{c}/root{s.spec.workdir}")
    assert (cwd.st_dev, cwd.st_ino) == (ws.st_dev, ws.st_ino)
    out = subprocess.run([sys.executable, "-c", SETNS, str(c), *host_paths], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert not any(seen["exists"].values()), seen["exists"]  # the host's tree is not in the namespace at all
    assert "/" in seen["mounts"] and len(seen["mounts"]) < 40, seen["mounts"]


@pytest.mark.parametrize("recycled", [False, True], ids=["fresh", "recycled"])
@pytest.mark.parametrize("image", ["host", pytest.param("image", marks=needs_image)])
def test_the_agent_holds_nothing_outside_the_session_root(exposed: Path, image: str, recycled: bool) -> None:
    """After set-up the agent (pid 1 of the session) has no directory or file descriptor, no cwd and no root outside
    the session's root, and the session's mount namespace holds nothing of the host (pivot_root, old root
    detached); the same on an agent recycled from an earlier session (its seed's descriptor, its old root gone)."""
    spec = SessionSpec(image="host" if image == "host" else str(IMAGE), limits=FAST, seed_dir=str(exposed),
                       writable_root=image != "host")

    async def go(b: LocalBackend) -> None:
        if recycled:
            first = await b.create(spec)
            await first.exec("echo x > a.txt; sleep 1000 > /dev/null 2>&1 &")
            await first.aclose()
        async with await b.create(spec) as s:
            assert (s._agent.uses > 1) == recycled
            assert "pivot_root" in s._agent.how, s._agent.how
            _agent_holds_nothing_outside(s, [str(exposed), str(exposed.parent / "secret.txt"), str(REPO)])
            await s.write_file("a.txt", "changed\n")
            assert "+changed" in await s.diff()  # the diff still has its pristine seed
            r = await s.exec("ls -ld /.rlf; ls /.rlf/seed 2>&1; cat /.rlf/seed/a.txt 2>&1")
            assert "drwx------" in r.stdout and "Permission denied" in r.stdout and "a\n" not in r.stdout, r
            with pytest.raises(SessionError):
                await s.read_file("/.rlf/seed/a.txt")

    run(go, pool_size=0 if recycled else 1)  # (a warm agent in the pool would take the recycled one's place)


def test_the_fallback_walk_refuses_symlinks_and_stays_in_the_root(tmp_path: Path) -> None:
    """Kernels without openat2: paths are walked a component at a time with O_NOFOLLOW, refusing every symlink;
    `..` stops at the root. With openat2: links resolve inside the root, magic links are refused."""
    from rlf_envs.sandbox.sessions import _agent

    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a" / "f").write_text("f\n")
    (root / "link").symlink_to("a")
    (root / "abs").symlink_to("/a")
    (tmp_path / "outside").write_text("outside\n")
    rfd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        def read(path: str, **kw: Any) -> bytes:
            fd = _agent.open_in_root(rfd, path, os.O_RDONLY, **kw)
            try:
                return os.read(fd, 100)
            finally:
                os.close(fd)

        for use in (False, True):
            assert read("/a/f", openat2=use) == b"f\n"
            assert read("../../../a/f", openat2=use) == b"f\n"  # `..` stops at the root
            with pytest.raises(FileNotFoundError):
                read("/../outside", openat2=use)
        for path in ("/link/f", "/abs/f"):
            with pytest.raises(OSError) as ei:
                read(path, openat2=False)
            assert ei.value.errno in (errno.ELOOP, errno.ENOTDIR), ei.value
            assert read(path, openat2=True) == b"f\n"  # resolved in the root
        host = os.open("/", os.O_PATH | os.O_DIRECTORY)
        try:
            for use in (False, True):
                with pytest.raises(OSError) as ei:
                    os.close(_agent.open_in_root(host, f"/proc/self/fd/{rfd}/a/f", os.O_RDONLY, openat2=use))
                assert ei.value.errno in (errno.ELOOP, errno.ENOTDIR), ei.value
        finally:
            os.close(host)
    finally:
        os.close(rfd)


def test_the_caches_rlf_writes_for_tasks_are_root_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seed copies (`repo_for`, Harbor's `materialise_seed`) and image unpacks live under directories no session uid
    can traverse (0700, root), made so or tightened when they already exist."""
    from rlf_envs.envs.swe.tasks import SweTask, repo_for
    from rlf_envs.tasks.harbor import DockerPlan, materialise_seed

    cache = tmp_path / "cache"
    monkeypatch.setenv("RLF_CACHE_DIR", str(cache))
    (cache / "images").mkdir(parents=True, mode=0o755)
    (cache / "images").chmod(0o755)  # an existing cache of an older rlf
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "f.txt").write_text("a\n")
    task = SweTask(instance_id="t", problem_statement="p", FAIL_TO_PASS=("x",), repo_dir=str(repo),
                   bug_patch="--- a/f.txt\n+++ b/f.txt\n@@ -1 +1 @@\n-a\n+b\n")
    out = repo_for(task)
    assert out is not None and (out / "f.txt").read_text() == "b\n"
    host_file = tmp_path / "copied.txt"
    host_file.write_text("c\n")
    seed = materialise_seed(DockerPlan(base="x", workdir="/app", env={}, seed={str(host_file): "c.txt"}), "key")
    assert Path(seed, "c.txt").read_text() == "c\n"
    assert images.cache_dir() == cache / "images"
    for d in ("swe", "harbor", "images"):
        st = os.stat(cache / d)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid(), (d, oct(st.st_mode))
    assert Path(out).parent == cache / "swe" and Path(seed).parent == cache / "harbor"


# ------------------------------------------------------------------------------------------- 2. whose failure


def test_bad_paths_and_arguments_are_the_callers_error_not_the_hosts() -> None:
    """A NUL byte, a lone surrogate, a path too long, a wrong type or mode: SessionError from LocalSession before
    anything is sent, and a SessionError (never an infrastructure failure) from the agent for the same request sent
    raw; the session answers afterwards."""
    bad_paths: list[Any] = ["a\x00b", "\ud800", "x" * 5000, "", 123, None, b"bytes"]

    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(limits=FAST)) as s:
            for p in bad_paths:
                for call in (s.read_file(p), s.write_file(p, "x")):
                    with pytest.raises(SessionError) as ei:
                        await call
                    assert not isinstance(ei.value, SessionInfraError), (p, ei.value)
            for kw in ({"mode": 2 ** 70}, {"mode": "644"}, {"mode": -1}):
                with pytest.raises(SessionError) as ei:
                    await s.write_file("ok.txt", "x", **kw)
                assert not isinstance(ei.value, SessionInfraError), (kw, ei.value)
            with pytest.raises(SessionError) as ei:
                await s.write_file("ok.txt", "\ud800")
            assert not isinstance(ei.value, SessionInfraError), ei.value
            with pytest.raises(SessionError) as ei:
                await s.exec("true", cwd="a\x00b")
            assert not isinstance(ei.value, SessionInfraError), ei.value
            # the same requests, raw: the agent's own classification
            for req in ({"op": "read", "path": "a\x00b"}, {"op": "read", "path": "\ud800"},
                        {"op": "read", "path": 123}, {"op": "read"}, {"op": "write", "path": "\udcff\ud800"},
                        {"op": "write", "path": "f", "mode": 2 ** 70}, {"op": "write", "path": "f", "mode": "x"},
                        {"op": "diff", "max_bytes": "x"}, {"op": "diff", "max_bytes": -1},
                        {"op": "exec", "argv": "not a list", "timeout": 5},
                        {"op": "exec", "argv": ["true"], "timeout": "soon"}, {"op": "nope"}):
                with pytest.raises(SessionError) as ei:
                    await s._call(req, 60)
                assert not isinstance(ei.value, SessionInfraError), (req, ei.value)
            assert (await s.exec("echo alive")).stdout == "alive\n"

    run(go)


def test_diff_past_its_limit_is_session_diff_too_large(seed_text: Path) -> None:
    """`diff(max_bytes=...)` and `SessionLimits.diff_bytes`: a larger patch is the policy's failure, raised before
    the patch is built in full or sent."""
    async def go(b: LocalBackend) -> None:
        lim = SessionLimits(exec_timeout_s=30, session_timeout_s=240, memory_mb=256, pids=64, disk_mb=64,
                            diff_bytes=50_000)
        async with await b.create(SessionSpec(limits=lim, seed_dir=str(seed_text))) as s:
            await s.write_file("big.txt", "".join(f"line {i}\n" for i in range(20_000)))
            with pytest.raises(SessionDiffTooLarge):
                await s.diff()
            with pytest.raises(SessionDiffTooLarge):
                await s.diff(max_bytes=1000)
            patch = await s.diff(max_bytes=10 << 20)
            assert "+line 19999" in patch
            await s.exec("rm big.txt")
            assert "+++ b/big.txt" not in await s.diff()

    run(go)


def test_a_diff_past_its_cpu_time_is_the_policys_failure(seed_text: Path) -> None:
    """The diff's CPU time is bounded (the session's exec_timeout_s, inside the trainer's deadline for the call):
    files that make it slow are SessionDiffTooLarge and the session answers afterwards, not a lost agent. Here the
    bound is 1 ms against a 200,000-line file: no machine diffs that in time."""
    lim = SessionLimits(exec_timeout_s=0.001, session_timeout_s=240, memory_mb=256, pids=64, disk_mb=64)

    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(limits=lim, seed_dir=str(seed_text))) as s:
            await s.write_file("a.txt", "".join(f"{i % 97}\n" for i in range(200_000)))
            with pytest.raises(SessionDiffTooLarge, match="CPU"):
                await s.diff()
            assert (await s.exec("echo alive", timeout_s=30)).stdout == "alive\n"
            assert await s.read_file("a.txt") != b""

    run(go)


@pytest.fixture()
def seed_text(tmp_path: Path) -> Path:
    d = tmp_path / "seed"
    d.mkdir()
    (d / "a.txt").write_text("a\n")
    return d


def test_a_patch_of_control_characters_is_not_inflated_past_the_frame_limit(
        seed_text: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A patch travels as raw bytes after its frame's header: text of control characters (6 bytes each as JSON
    escapes) no longer multiplies the frame, so a patch under its limit always arrives."""
    from rlf_envs.sandbox.sessions import local

    monkeypatch.setattr(local, "MAX_FRAME", 1 << 20)

    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(limits=FAST, seed_dir=str(seed_text))) as s:
            await s.write_file("ctl.txt", ("\x01" * 99 + "\n") * 20_000)  # 2 MB of text, ~12 MB as JSON escapes
            patch = await s.diff(max_bytes=8 << 20)
            assert patch.count("+" + "\x01" * 99) == 20_000
            got = await s.read_file("ctl.txt")
            assert len(got) == 2_000_000

    run(go)


def test_a_session_past_its_wall_clock_raises_session_expired() -> None:
    async def go(b: LocalBackend) -> None:
        s = await b.create(SessionSpec(limits=SessionLimits(session_timeout_s=2, exec_timeout_s=30)))
        r = await s.exec("sleep 10")
        assert r.timed_out
        await asyncio.sleep(2.0)
        for call in (lambda: s.exec("true"), lambda: s.read_file("x"), lambda: s.diff()):
            with pytest.raises(SessionExpired):
                await call()
        await s.aclose()

    run(go)


FILL = textwrap.dedent("""\
    for d in /tmp /dev/shm /var/tmp /workspace /opt /; do
        dd if=/dev/zero of=$d/fill bs=1M count=200 2> /dev/null
    done
    for d in /tmp /dev/shm /var/tmp /workspace /opt /; do
        mkdir -p $d/inodes && python3 -c 'import os, sys
    n = 0
    try:
        for i in range(200000):
            os.close(os.open(f"{sys.argv[1]}/e{i}", os.O_WRONLY | os.O_CREAT, 0o600))
            n += 1
    except OSError:
        pass
    print("inodes", sys.argv[1], n)' $d/inodes
    done
    total=0
    for d in /tmp /dev/shm /var/tmp /workspace /opt /; do
        s=$(stat -c %s $d/fill 2> /dev/null || echo 0); total=$((total + s))
    done
    echo total $total
""")
HOG = ("for i in 1 2 3 4 5 6; do python3 -c 'b = bytearray(100 << 20); import time; time.sleep(3)' & done; "
       "fails=0; for j in 1 2 3 4 5 6; do wait -n || fails=$((fails+1)); done; echo fails $fails")


@needs_image
def test_filling_every_writable_place_then_memory_is_the_policys_failure() -> None:
    """An image session with a writable root: its shell fills /tmp, /dev/shm, /var/tmp, the workspace and the root
    (data and inodes), then its processes allocate far past the memory limit. All writable space is one tmpfs of
    disk_mb (together within the policy's budget), the agent is exempt from the OOM killer: the session answers
    afterwards, or fails with SessionLimitExceeded -- never SessionInfraError."""
    lim = SessionLimits(memory_mb=160, disk_mb=64, pids=64, exec_timeout_s=120, session_timeout_s=400)

    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(image=str(IMAGE), writable_root=True, limits=lim)) as s:
            try:
                r = await s.exec(FILL, timeout_s=120)
                total = int(r.stdout.split("total ")[-1].split()[0])
                assert total <= (lim.disk_mb + 1) << 20, r.stdout  # one tmpfs of disk_mb for all of them
                inodes = sum(int(line.split()[-1]) for line in r.stdout.splitlines() if line.startswith("inodes"))
                assert 0 < inodes <= 32768, r.stdout  # bounded too (each costs kernel memory no OOM kill frees)
                r = await s.exec(HOG, timeout_s=60)
                assert "fails" in r.stdout, r
                assert (await s.exec("echo alive")).stdout == "alive\n"
                assert (await s.read_file("/etc/hostname")) is not None
                await s.write_file("/workspace/after.txt", "x")  # may fail (full): a SessionError, not infra
            except SessionInfraError:
                raise
            except (SessionLimitExceeded, SessionError) as e:
                assert not isinstance(e, SessionInfraError)

    run(go)


def test_sysv_shared_memory_is_bounded() -> None:
    """A SysV shared memory segment outlives the processes that made it (no OOM kill frees it, and it is charged to
    the session's cgroup): the session's ipc namespace allows 8 MiB in all."""
    probe = ("import ctypes; libc = ctypes.CDLL(None); "
             "print(libc.shmget(0, 64 << 20, 0o1000 | 0o600), libc.shmget(0, 4 << 20, 0o1000 | 0o600))")

    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(limits=FAST)) as s:
            r = await s.exec(["python3", "-c", probe])
            big, small = r.stdout.split()
            assert int(big) == -1 and int(small) >= 0, r

    run(go)


def _events(dirs: list[str]) -> int:
    n = 0
    for d in dirs:
        for name in ("memory.events", "memory.oom_control"):
            with contextlib.suppress(OSError), open(os.path.join(d, name)) as f:
                for line in f:
                    k, _, v = line.partition(" ")
                    if k == "oom_kill":
                        n += int(v)
    return n


def test_an_agent_lost_while_the_session_is_at_its_limits_is_the_policys_failure() -> None:
    """The agent (exempt from the OOM killer) is nonetheless lost during a call in which the session's processes hit
    its memory limit: SessionLimitExceeded (the policy's failure). Lost in a call without that: SessionInfraError."""
    lim = SessionLimits(memory_mb=128, disk_mb=16, pids=64, exec_timeout_s=60)

    async def go(b: LocalBackend) -> None:
        async with await b.create(SessionSpec(limits=lim)) as s:
            if s._agent.cgroup is None:
                pytest.skip("no session cgroup on this host")
            # the agent is exempt from the OOM killer (-1000) where the host grants CAP_SYS_RESOURCE, else at 0; what
            # the session runs is its first choice (1000)
            assert int(Path(f"/proc/{_c_pid(s)}/oom_score_adj").read_text()) <= 0
            assert (await s.exec("cat /proc/self/oom_score_adj")).stdout.strip() == "1000"
            task = asyncio.ensure_future(s.exec(
                "for i in 1 2 3 4; do python3 -c 'b = bytearray(100 << 20); import time; time.sleep(30)' & done; "
                "sleep 30", timeout_s=50))
            deadline = time.monotonic() + 40
            while _events(s._agent.cgroup) == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert _events(s._agent.cgroup) > 0
            os.kill(_c_pid(s), signal.SIGKILL)
            with pytest.raises(SessionLimitExceeded) as ei:
                await task
            assert ei.value.limit == "memory", ei.value
        async with await b.create(SessionSpec(limits=lim)) as s:
            await s.exec("true")
            os.kill(_c_pid(s), signal.SIGKILL)
            with pytest.raises(SessionInfraError):
                await s.exec("true")

    run(go)


# ------------------------------------------------------------------------------------------- 3. clean exits

LEAK = textwrap.dedent("""
    import asyncio, os, sys
    from rlf_envs import runtime
    from rlf_envs.sandbox.sessions import SessionLimits, SessionSpec, owners
    from rlf_envs.sandbox.sessions.local import LocalBackend

    _new = owners.Label.new.__func__

    def new(cls, sid, backend="local"):
        print("label", sid, flush=True)  # every label this process makes
        return _new(cls, sid, backend)

    owners.Label.new = classmethod(new)

    async def go():
        b = LocalBackend(pool_size=2)
        s = await b.create(SessionSpec(limits=SessionLimits(disk_mb=16, memory_mb=128)))
        assert (await s.exec("echo hi")).stdout == "hi\\n"
        await s.aclose()
        for _ in range(200):  # the warm pool refilled
            if len(b.pool.idle(("host", False))) == 2:
                break
            await asyncio.sleep(0.05)
        if sys.argv[1] == "close":
            await b.aclose()
        return b

    if sys.argv[1] == "runtime":
        runtime.register_closer(runtime.run(go()))  # closed by the runtime's closers at interpreter exit
    else:
        backend = asyncio.run(go())  # "exit": never closed, the interpreter just exits
""")


@pytest.mark.parametrize("how", ["close", "runtime", "exit"])
def test_a_clean_exit_leaves_no_label_and_no_cgroup(tmp_path: Path, how: str) -> None:
    """A closed backend, a backend left to the runtime's closers at interpreter exit (whose executor no longer takes
    work then), and one nobody closed before the interpreter exits remove every label and cgroup they made, their
    warm pool's included."""
    from rlf_envs.sandbox import _cgroup

    env = dict(os.environ, RLF_SESSIONS_DIR=str(tmp_path / "labels"))
    out = subprocess.run([sys.executable, "-c", LEAK, how], capture_output=True, text=True, timeout=240, env=env,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    made = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("label ")]
    assert len(made) >= 3, out.stdout  # the session's agent and the two of the refilled pool
    left = sorted(p.name for p in (tmp_path / "labels").iterdir() if p.name.endswith(".json"))
    assert left == [], left
    parents = set()
    where = _cgroup._cgroup_parent()
    if not isinstance(where, str):
        parents.add(where[0])
    if _cgroup._pids_parent():
        parents.add(str(_cgroup._pids_parent()))
    cgroups = [os.path.join(p, _cgroup.SESSION_PREFIX + sid) for p in parents for sid in made]
    assert [c for c in cgroups if os.path.isdir(c)] == []


def test_images_runs_as_a_script_of_a_venvs_python() -> None:
    """`python rlf_envs/.../sessions/images.py path`: the script's folder holds `types.py`, which used to shadow the
    standard library's (a circular import at start-up)."""
    script = REPO / "rlf_envs" / "src" / "rlf_envs" / "sandbox" / "sessions" / "images.py"
    out = subprocess.run([sys.executable, str(script), "path"], capture_output=True, text=True, timeout=120)
    assert "circular import" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert out.returncode in (0, 1), out.stderr
    if IMAGE is not None:
        assert out.stdout.strip() == IMAGE
