"""Sandbox sessions, docker backend, against a real engine (DOCKER_HOST honoured). Skipped with the reason when the
docker SDK (`rlf-envs[docker]`), the engine or the test image (RLF_DOCKER_TEST_IMAGE, default rlf-debian-test:12,
made by .ci/run with `docker import` of the mmdebstrap test root) is missing."""

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

from rlf_envs.sandbox.sessions import SessionClosed, SessionFileNotFound, SessionLimits, SessionSpec

IMAGE = os.environ.get("RLF_DOCKER_TEST_IMAGE", "rlf-debian-test:12")
FAST = SessionLimits(exec_timeout_s=20, session_timeout_s=300, memory_mb=512, pids=128, disk_mb=64)


def _skip_reason() -> str | None:
    try:
        import docker
    except ImportError:
        return "the docker SDK is not installed (pip install 'rlf-envs[docker]')"
    try:
        c = docker.from_env(timeout=10)
        c.ping()
    except Exception as e:
        return f"no docker engine reachable (DOCKER_HOST={os.environ.get('DOCKER_HOST')!r}): {e}"
    try:
        c.images.get(IMAGE)
    except Exception:
        return f"the test image {IMAGE} is not in the engine (.ci/run imports it; or RLF_DOCKER_TEST_IMAGE)"
    finally:
        c.close()
    return None


REASON = _skip_reason()
if REASON:
    pytestmark = pytest.mark.skip(reason=REASON)


def run(fn: Callable[[Any], Awaitable[Any]], **kw: Any) -> Any:
    from rlf_envs.sandbox.sessions.docker import DockerBackend

    async def main() -> Any:
        b = DockerBackend(**kw)
        try:
            return await fn(b)
        finally:
            await b.aclose()

    return asyncio.run(main())


def spec(**kw: Any) -> SessionSpec:
    return SessionSpec(image=f"docker:{IMAGE}", limits=kw.pop("limits", FAST), **kw)


@pytest.fixture()
def seed(tmp_path: Path) -> Path:
    d = tmp_path / "seed"
    (d / "pkg").mkdir(parents=True)
    (d / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    (d / "gone.txt").write_text("bye\n")
    (d / "blob.bin").write_bytes(bytes(range(256)))
    return d


def test_docker_exec_files_diff_and_close(seed: Path, tmp_path: Path) -> None:
    async def go(b: Any) -> str:
        s = await b.create(spec(seed_dir=str(seed)))
        try:
            r = await s.exec("cat pkg/mod.py; pwd; exit 5")
            assert (r.exit_code, r.stdout) == (5, "def f():\n    return 1\n/workspace\n"), r
            assert (await s.exec(["cat"], stdin="in")).stdout == "in"
            r = await s.exec("head -c 200000 /dev/zero | tr '\\0' y")
            assert r.truncated and len(r.stdout) == FAST.output_bytes
            await s.write_file("new/x.txt", "x\n")
            assert await s.read_file("new/x.txt") == b"x\n"
            with pytest.raises(SessionFileNotFound):
                await s.read_file("missing")
            await s.exec("printf 'def f():\\n    return 2\\n' > pkg/mod.py; rm gone.txt; printf '\\001' > blob.bin")
            r = await s.exec("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=3)\"")
            assert r.exit_code != 0  # no network
            patch: str = await s.diff()
        finally:
            await s.aclose()
        await s.aclose()
        with pytest.raises(SessionClosed):
            await s.exec("true")
        return patch

    patch = run(go)
    work = tmp_path / "apply"
    shutil.copytree(seed, work)
    (tmp_path / "p.diff").write_text(patch)
    subprocess.run(["git", "apply", "--binary", str(tmp_path / "p.diff")], cwd=work, check=True, timeout=60)
    assert (work / "pkg" / "mod.py").read_text() == "def f():\n    return 2\n" and not (work / "gone.txt").exists()
    assert (work / "new" / "x.txt").read_text() == "x\n" and (work / "blob.bin").read_bytes() == b"\x01"


def test_docker_deadline_kills_what_the_call_started() -> None:
    async def go(b: Any) -> None:
        async with await b.create(spec()) as s:
            await s.exec("sleep 1000 > /dev/null 2>&1 &")
            t0 = time.monotonic()
            r = await s.exec("setsid sh -c 'sleep 999 > /dev/null 2>&1 &' ; setsid sleep 998 & sleep 997",
                             timeout_s=1.5)
            assert r.timed_out and r.exit_code == 124 and time.monotonic() - t0 < 30, r
            ps = await s.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
            assert "sleep 1000" in ps.stdout
            assert not any(f"sleep {n}" in ps.stdout for n in (999, 998, 997)), ps.stdout

    run(go)


OWNER = textwrap.dedent("""
    import asyncio, os
    from rlf_envs.sandbox.sessions import SessionSpec
    from rlf_envs.sandbox.sessions.docker import DockerBackend
    async def main():
        b = DockerBackend()
        ss = await asyncio.gather(*(b.create(SessionSpec(image="docker:" + os.environ["IMG"])) for _ in range(32)))
        print(" ".join(s._c.id for s in ss), flush=True)
        await asyncio.sleep(1000)
    asyncio.run(main())
""")


def test_docker_sigkill_of_an_owner_with_32_sessions_leaves_no_container() -> None:
    import docker

    env = {**os.environ, "IMG": IMAGE, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    p = subprocess.Popen([sys.executable, "-c", OWNER], env=env, stdout=subprocess.PIPE, text=True)
    client = docker.from_env(timeout=60)
    try:
        assert p.stdout is not None
        ids = p.stdout.readline().split()
        assert len(ids) == 32
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        assert len(client.containers.list(all=True, filters={"id": ids[0]})) == 1  # nothing removed them yet

        async def reap(b: Any) -> int:
            n: int = b.reaped_at_start
            return n

        assert run(reap) >= 32
        left = [c.id for c in client.containers.list(all=True, filters={"label": "rlf.session"}) if c.id in ids]
        assert left == []
        from rlf_envs.sandbox.sessions.docker import INIT_LABEL

        derived = client.images.list(filters={"label": [INIT_LABEL, f"rlf.owner.pid={p.pid}"]})
        assert derived == [], "the dead owner's pid-1 image went with its containers"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
        if p.stdout is not None:
            p.stdout.close()
        client.close()


def test_docker_warm_pool_serves_creates_and_close_leaves_no_container(seed: Path) -> None:
    import docker

    async def go(b: Any) -> None:
        await (await b.create(spec())).aclose()
        key = b._key(spec(seed_dir=str(seed)))
        for _ in range(600):
            if len(b.pool.idle(key)) == 2:
                break
            await asyncio.sleep(0.05)
        assert len(b.pool.idle(key)) == 2
        warm = b.pool.idle(key)[-1].c
        async with await b.create(spec(seed_dir=str(seed))) as s:
            assert s._c.id == warm.id
            assert (await s.exec("cat pkg/mod.py")).stdout == "def f():\n    return 1\n"  # the seed, copied in

    run(go, pool_size=2)
    client = docker.from_env(timeout=60)
    try:
        mine = client.containers.list(all=True, filters={"label": [f"rlf.owner.pid={os.getpid()}"]})
        assert mine == []
    finally:
        client.close()


@pytest.mark.parametrize("commit", [True, False], ids=["derived", "engine-cannot-commit"])
def test_containers_get_pid_1_from_one_derived_image_and_the_seed_in_one_archive(
        seed: Path, monkeypatch: pytest.MonkeyPatch, commit: bool) -> None:
    """Each archive call costs the engine a helper process: pid 1 (an execute-only sleep) is committed once into an
    image derived from the session image, and a container's one archive call is its seed's. The derived image goes
    with the backend. Where the engine cannot commit, pid 1 travels in that same archive instead."""
    import docker

    from rlf_envs.sandbox.sessions import docker as dk

    client = docker.from_env()
    base = client.images.get(IMAGE).id
    puts: list[str] = []  # the containers put_archive was called for
    sessions: set[str] = set()
    if not commit:
        monkeypatch.setattr(type(client.api), "commit", lambda *a, **k: (_ for _ in ()).throw(
            docker.errors.APIError("commit refused (test)")))

    async def go(b: Any) -> tuple[set[str], dict[str, Any]]:
        real = b.client.api.put_archive

        def put(cid: str, path: str, data: bytes) -> Any:
            puts.append(cid)
            return real(cid, path, data)

        monkeypatch.setattr(b.client.api, "put_archive", put)
        made = set()
        for _ in range(3):
            async with await b.create(spec(seed_dir=str(seed))) as s:
                sessions.add(s._c.id)
                made.add(b.client.api.inspect_container(s._c.id)["Image"])
                r = await s.exec(["stat", "-c", "%a %u", dk.INIT])
                assert (r.exit_code, r.stdout) == (0, "111 0\n"), "pid 1 is execute-only, root's"
                assert (await s.exec(["cat", "/proc/1/cmdline"])).stdout.startswith(dk.INIT + "\x00")
                assert await s.read_file("pkg/mod.py") == b"def f():\n    return 1\n"
                owner = await s.exec(["stat", "-c", "%u", "pkg/mod.py"])
                assert owner.stdout == "0\n"  # (the image's user)
        return made, await asyncio.to_thread(b.client.api.inspect_image, next(iter(made)))

    made, info = run(go, pool_size=0)
    assert len(made) == 1, "every session container comes from the same image"
    (image,) = made
    if commit:
        assert image != base and info["RepoTags"][0].startswith("rlf-init:")
        assert info["Config"]["Labels"][dk.INIT_LABEL] == base
        assert len([c for c in puts if c in sessions]) == 3, "one archive call per container: the seed's"
        with pytest.raises(docker.errors.ImageNotFound):
            client.images.get(image)  # removed with the backend
    else:
        assert image == base and len([c for c in puts if c in sessions]) == 3, "pid 1 and the seed in one archive"
    assert not client.images.list(filters={"label": dk.INIT_LABEL})
    client.close()


def test_read_file_on_a_local_engine_is_the_kernels_and_never_leaves_the_container(
        seed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a local engine `read_file` of a plain path is read by this host's kernel in pid 1's root (no archive call,
    no program of the container). Links, `..`, /proc and other mounts, FIFOs and directories are left to the
    engine, so nothing resolves outside the container: a host file the container's links and paths name is never
    returned."""
    from rlf_envs.sandbox.sessions import SessionError

    secret = tmp_path / "host-secret.txt"
    secret.write_text("HOST-ONLY\n")
    archive_calls: list[str] = []

    async def go(b: Any) -> None:
        from rlf_envs.sandbox.sessions import docker as dk

        real = dk._archive

        @contextlib.contextmanager
        def counted(api: Any, cid: str, path: str) -> Any:
            archive_calls.append(path)
            with real(api, cid, path) as got:
                yield got

        monkeypatch.setattr(dk, "_archive", counted)
        async with await b.create(spec(seed_dir=str(seed))) as s:
            assert s._host is not None, "the test engine is local"
            archive_calls.clear()  # (learning the image read its bash and sleep)
            assert await s.read_file("pkg/mod.py") == b"def f():\n    return 1\n"
            assert await s.read_file("/workspace/blob.bin") == bytes(range(256))
            await s.write_file("new.txt", "fresh\n")
            assert await s.read_file("new.txt") == b"fresh\n"
            with pytest.raises(SessionFileNotFound):
                await s.read_file("missing.txt")
            with pytest.raises(SessionFileNotFound):
                await s.read_file("/nowhere/at/all")
            assert archive_calls == [], "plain paths are read without the engine (a missing one too)"
            assert (await s.exec(f"ln -s {secret} abs && ln -s ../../../../..{secret} rel && mkfifo fifo && "
                                 "mkdir d && ln -s /proc/self/root/etc/hostname magic")).exit_code == 0
            for path in ("abs", "rel", "magic", f"../../../../../../..{secret}", f"/proc/1/root{secret}",
                         f"/proc/self/root{secret}", "fifo", "d"):
                try:
                    got = await asyncio.wait_for(s.read_file(path), 30)
                except (SessionFileNotFound, SessionError):
                    continue
                assert b"HOST-ONLY" not in got, path
            assert archive_calls, "links, /proc, FIFOs and directories went to the engine"

    run(go)



def _count_archives(monkeypatch: pytest.MonkeyPatch, b: Any, calls: list[str]) -> None:
    """Every archive call of the backend `b` (get and put) appended to `calls` as 'get <path>' / 'put <path>'."""
    from rlf_envs.sandbox.sessions import docker as dk

    real_get, api = dk._archive, b.client.api
    real_put = api.put_archive

    @contextlib.contextmanager
    def get(api: Any, cid: str, path: str) -> Any:
        calls.append(f"get {path}")
        with real_get(api, cid, path) as got:
            yield got

    def put(cid: str, path: str, data: bytes) -> Any:
        calls.append(f"put {path}")
        return real_put(cid, path, data)

    monkeypatch.setattr(dk, "_archive", get)
    monkeypatch.setattr(api, "put_archive", put)


def test_write_file_on_a_local_engine_is_the_kernels_and_never_writes_a_host_file(
        seed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a local engine `write_file` of a plain path is written by this host's kernel (no archive call): the mode
    asked, a new inode as the engine's archive makes (a hard link's other name keeps the old content), no temp name
    left. A link to a host file or directory, a path through /proc, a FIFO: left to the engine, and no host file is
    ever written or created."""
    from rlf_envs.sandbox.sessions import SessionError
    from rlf_envs.sandbox.sessions import docker as dk

    secret = tmp_path / "host-secret.txt"
    secret.write_text("HOST-ONLY\n")
    calls: list[str] = []
    assert dk._identity_maps(os.getpid())

    async def go(b: Any) -> None:
        async with await b.create(spec(seed_dir=str(seed))) as s:
            assert s._host is not None and s._host.same_ids, "the test engine is local, without a user namespace"
            _count_archives(monkeypatch, b, calls)
            assert (await s.exec("ln pkg/mod.py hard")).exit_code == 0
            await s.write_file("pkg/mod.py", "v2\n", mode=0o755)
            await s.write_file("/workspace/new.txt", b"\x00fresh")
            assert calls == [], "plain paths are written without the engine"
            r = await s.exec("stat -c '%a %u:%g %h' pkg/mod.py new.txt; cat hard; ls -a; ls -a pkg")
            lines = r.stdout.splitlines()
            assert lines[:2] == ["755 0:0 1", "644 0:0 1"], r.stdout
            assert lines[2] == "def f():", "a hard link's other name keeps its content (a new inode)"
            assert not [x for x in lines if x.startswith(".rlf-write")], r.stdout
            assert await s.read_file("new.txt") == b"\x00fresh"
            assert (await s.exec(f"ln -s {secret} abs && ln -s {tmp_path} hostdir && mkfifo fifo")).exit_code == 0
            for path in ("abs", "hostdir/pwn.txt", f"/proc/self/root{tmp_path}/pwn2.txt",
                         f"/proc/1/root{secret}", f"../../../../../..{secret}", "fifo"):
                with contextlib.suppress(SessionError):
                    await asyncio.wait_for(s.write_file(path, "PWNED\n"), 30)
            assert secret.read_text() == "HOST-ONLY\n"
            assert not (tmp_path / "pwn.txt").exists() and not (tmp_path / "pwn2.txt").exists()
            assert calls, "links, /proc and FIFOs went to the engine"
            calls.clear()
            await s.write_file("deep/er/x.txt", "made\n")  # missing parents: the engine makes them
            assert calls[-1] == "put /workspace" and await s.read_file("deep/er/x.txt") == b"made\n"

    run(go)


def test_the_diff_on_a_local_engine_is_copied_by_the_kernel_and_equals_the_engines(
        seed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a local engine `diff` copies the workdir by this host's kernel (no archive call) and gives the patch the
    archive path gives, byte for byte: changed, new, removed and executable files, nested and empty directories,
    links (their text, never followed: a link to a host file or directory shows no host content), a FIFO, `.git`
    left out. A tree deeper than DIFF_HOST_DEPTH goes to the engine."""
    from rlf_envs.sandbox.sessions import SessionDiffTooLarge
    from rlf_envs.sandbox.sessions import docker as dk

    secret = tmp_path / "host-secret.txt"
    secret.write_text("HOST-ONLY\n")
    (tmp_path / "host-dir").mkdir()
    (tmp_path / "host-dir" / "inside.txt").write_text("HOST-ONLY too\n")
    calls: list[str] = []

    async def go(b: Any) -> None:
        async with await b.create(spec(seed_dir=str(seed))) as s:
            assert s._host is not None
            _count_archives(monkeypatch, b, calls)
            setup = (f"printf 'def f():\\n    return 2\\n' > pkg/mod.py && rm gone.txt && mkdir -p a/b/c empty && "
                     f"echo deep > a/b/c/new.txt && chmod +x a/b/c/new.txt && ln -s {secret} link && "
                     f"ln -s {tmp_path}/host-dir dirlink && mkfifo pipe && mkdir -p .git && echo x > .git/HEAD && "
                     "mkdir -p sub/.git && echo y > sub/.git/config && ln pkg/mod.py hardlink")
            assert (await s.exec(setup)).exit_code == 0
            fast = await asyncio.wait_for(s.diff(), 60)
            assert calls == [], "the diff read the workdir without the engine"
            host, s._host = s._host, None
            engine = await s.diff()
            assert calls == ["get /workspace"]
            assert fast == engine
            assert "return 2" in fast and "gone.txt" in fast and "a/b/c/new.txt" in fast and "100755" in fast
            assert "HOST-ONLY" not in fast and ".git" not in fast and str(secret) in fast  # (the link's text)
            s._host = host
            calls.clear()
            deep = "/".join(["d"] * (dk.DIFF_HOST_DEPTH + 2))
            assert (await s.exec(f"mkdir -p {deep} && echo bottom > {deep}/f.txt")).exit_code == 0
            got = await s.diff()
            assert calls == ["get /workspace"] and f"{deep}/f.txt" in got, "a deeper tree went to the engine"
            calls.clear()
            assert (await s.exec("rm -rf d && for i in $(seq 60); do echo $i > n$i.txt; done")).exit_code == 0
            with pytest.raises(SessionDiffTooLarge):
                await s.diff(max_bytes=2000)  # the new files' headers alone pass it, counted on the host's copy
            assert calls == []

    run(go)


def test_two_backends_of_one_process_each_keep_their_derived_image_until_they_close(seed: Path) -> None:
    """Envs of one process each open a backend: one closing must not take the image another still creates from."""
    import docker

    from rlf_envs.sandbox.sessions import docker as dk

    client = docker.from_env()

    async def main() -> None:
        a, b = dk.DockerBackend(pool_size=0), dk.DockerBackend(pool_size=0)
        try:
            async with await a.create(spec(seed_dir=str(seed))), await b.create(spec(seed_dir=str(seed))):
                pass
            await a.aclose()
            async with await b.create(spec(seed_dir=str(seed))) as s:  # b's image is still there
                assert (await s.exec(["cat", "pkg/mod.py"])).stdout.startswith("def f")
            (derived,) = client.images.list(filters={"label": dk.INIT_LABEL})
            client.images.remove(derived.id, force=True)  # removed from outside: derived again at the next create
            async with await b.create(spec(seed_dir=str(seed))) as s:
                assert (await s.exec(["cat", "/proc/1/cmdline"])).stdout.startswith(dk.INIT)
        finally:
            await a.aclose()
            await b.aclose()

    asyncio.run(main())
    assert not client.images.list(filters={"label": dk.INIT_LABEL})
    client.close()
