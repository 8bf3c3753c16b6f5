"""The docker backend: one container per session through the Docker Engine API (the `docker` Python SDK,
the `docker` extra, `pip install -e './rlf_envs[docker]'`; `DOCKER_HOST` honoured, so Podman's compatible socket
works too).

A session is a container of `SessionSpec.image` ("docker:<ref>", an image the engine holds) created with its owner
labels in the same API call (`rlf.session`, `rlf.owner.run`, `rlf.owner.pid`, `rlf.owner.start`, `rlf.owner.host`),
kept alive by `sleep infinity`, with no network (`network_mode=none`) unless asked, a memory and pids limit, no
capabilities beyond docker's defaults minus NET_RAW, `no-new-privileges`. `exec` runs `timeout -s KILL T sh -c CMD`
inside (docker exec has no timeout), streams the output with a cap, and at the deadline kills every process the call
started (all pids of the container from the call's first one on: pids of a container's namespace only grow) with a
second exec; a client-side deadline covers an engine that does not answer. Files go through put/get archive;
`diff` fetches the workdir as a tar into a host temp dir (regular files, dirs and links only, bounded) and compares
it with the seed (`gitdiff`). The reaper removes labelled containers of this host whose owner process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import shlex
import socket
import tarfile
import tempfile
import threading
import time
import uuid
from typing import Any

from rlf_envs.sandbox import cleanup
from rlf_envs.sandbox.sessions import gitdiff, owners
from rlf_envs.sandbox.sessions.images import inside
from rlf_envs.sandbox.sessions.types import (
    CreateRate,
    ExecResult,
    Session,
    SessionBackend,
    SessionClosed,
    SessionError,
    SessionFileNotFound,
    SessionInfraError,
    SessionSpec,
)

LABEL = "rlf.session"
GRACE_S = 30.0
API_TIMEOUT_S = 120
MAX_FILE = 64 << 20
PID_FILE = "/tmp/.rlf-exec-pid"


def _image_ref(image: str) -> str:
    if image.startswith("docker:"):
        return image.split(":", 1)[1]
    raise ValueError(f"the docker backend runs images the engine holds: 'docker:<ref>' (got {image!r}; for a root "
                     "directory or an archive use the local backend, or `docker import`/`docker load` it first)")


def _tar_of_dir(src: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name in sorted(os.listdir(src)):
            tf.add(os.path.join(src, name), arcname=name)
    return buf.getvalue()


def _tar_of_file(path: str, data: bytes, mode: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            d = tarfile.TarInfo("/".join(parts[:i]))
            d.type, d.mode = tarfile.DIRTYPE, 0o755
            tf.addfile(d)
        info = tarfile.TarInfo("/".join(parts))
        info.size, info.mode, info.mtime = len(data), mode, int(time.time())
        tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class _Cap(io.RawIOBase):
    """A readable over the engine's archive stream that refuses more than `limit` bytes."""

    def __init__(self, chunks: Any, limit: int) -> None:
        self.it, self.buf, self.n, self.limit = iter(chunks), b"", 0, limit

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self.buf:
            try:
                self.buf = next(self.it)
            except StopIteration:
                return 0
            self.n += len(self.buf)
            if self.n > self.limit:
                raise SessionError(f"the archive from the session is larger than {self.limit} bytes")
        k = min(len(b), len(self.buf))
        b[:k], self.buf = self.buf[:k], self.buf[k:]
        return k


def _discard_when_done(fut: asyncio.Future[Any]) -> None:
    """A container create we no longer wait for (a deadline, a cancelled create): remove it once it exists."""

    def done(f: asyncio.Future[Any]) -> None:
        if f.cancelled() or f.exception() is not None:
            return
        c = f.result()
        threading.Thread(target=lambda: c.remove(force=True), daemon=True).start()

    fut.add_done_callback(done)


async def _remove(c: Any) -> None:
    """Force-remove a container off the loop; at interpreter exit (atexit closers run after the executors shut
    down, so `to_thread` refuses) inline, so a backend closed at exit still leaves no container behind."""
    try:
        await asyncio.wait_for(asyncio.to_thread(c.remove, force=True), API_TIMEOUT_S)
    except RuntimeError as e:  # "cannot schedule new futures after [interpreter] shutdown"
        if "shutdown" not in str(e):
            raise
        c.remove(force=True)


class DockerSession(Session):
    def __init__(self, backend: DockerBackend, container: Any, spec: SessionSpec) -> None:
        self.id = container.name
        self.spec = spec
        self._b = backend
        self._c = container
        self._lock = asyncio.Lock()
        self._closed = False
        self._deadline = time.monotonic() + spec.limits.session_timeout_s
        self._timer = asyncio.get_running_loop().call_later(spec.limits.session_timeout_s + 1.0, self._expire)
        self._expired = False

    def _expire(self) -> None:
        self._expired = True
        asyncio.get_running_loop().create_task(self.aclose())

    def _check(self) -> None:
        if self._expired:
            raise SessionClosed(f"session {self.id} ran past its wall clock "
                                f"(session_timeout_s={self.spec.limits.session_timeout_s})")
        if self._closed:
            raise SessionClosed(f"session {self.id} is closed")

    async def _api(self, fn: Any, *args: Any, timeout_s: float = API_TIMEOUT_S, **kw: Any) -> Any:
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args, **kw), timeout_s)
        except TimeoutError:
            raise SessionInfraError(f"the docker engine did not answer within {timeout_s:.0f} s") from None
        except SessionError:
            raise
        except Exception as e:
            raise self._b._classify(e) from e

    def _run_exec(self, argv: list[str], stdin: bytes, cwd: str, env: dict[str, str], cap: int) -> dict[str, Any]:
        api = self._b.client.api
        ex = api.exec_create(self._c.id, argv, stdin=bool(stdin), workdir=cwd, environment=env)
        out, err, trunc = bytearray(), bytearray(), False
        if stdin:
            sock = api.exec_start(ex["Id"], socket=True)
            raw = getattr(sock, "_sock", sock)
            raw.sendall(stdin)
            with contextlib.suppress(OSError):
                raw.shutdown(socket.SHUT_WR)
            from docker.utils.socket import frames_iter

            stream = ((1 if t == 1 else 2, d) for t, d in frames_iter(sock, tty=False))
        else:
            stream = (((1, o) if o else (2, e)) for o, e in api.exec_start(ex["Id"], stream=True, demux=True))
        for which, data in stream:
            if not data:
                continue
            buf = out if which == 1 else err
            room = cap - len(buf)
            if room > 0:
                buf += data[:room]
            if len(data) > max(room, 0):
                trunc = True
        code = api.exec_inspect(ex["Id"]).get("ExitCode")
        return {"out": bytes(out), "err": bytes(err), "trunc": trunc, "code": code}

    async def _kill_call(self) -> None:
        """Kill every process of the container from the call's first pid on (the wrapper wrote it), but pid 1."""
        script = (f"p0=$(cat {PID_FILE} 2>/dev/null) || exit 0; for i in 1 2 3; do for d in /proc/[0-9]*; do "
                  "p=${d#/proc/}; [ \"$p\" -ge \"$p0\" ] && [ \"$p\" != \"$$\" ] && kill -9 \"$p\" 2>/dev/null; "
                  "done; done; true")
        with contextlib.suppress(Exception):
            await self._api(self._c.exec_run, ["sh", "-c", script], timeout_s=30)

    async def exec(self, cmd: str | list[str], *, stdin: str | bytes | None = None, timeout_s: float | None = None,
                   cwd: str | None = None, env: dict[str, str] | None = None) -> ExecResult:
        if isinstance(cmd, str):
            inner = cmd
        elif isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd):
            inner = "exec " + shlex.join(cmd)
        else:
            raise ValueError("exec takes a shell command (str) or a non-empty argv (list of str)")
        timeout = float(timeout_s if timeout_s is not None else self.spec.limits.exec_timeout_s)
        if not timeout > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        timeout = max(0.001, min(timeout, self._deadline - time.monotonic()))
        data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        # the wrapper records the call's first pid, then runs the command under a KILL at the deadline
        argv = ["sh", "-c", f'echo $$ > {PID_FILE} 2>/dev/null; exec timeout -s KILL {timeout:.3f} sh -c "$0"',
                inner]
        async with self._lock:
            self._check()
            t0 = time.monotonic()
            fut = asyncio.ensure_future(asyncio.to_thread(self._run_exec, argv, data, cwd or self.spec.workdir,
                                                          {**self.spec.env, **(env or {})},
                                                          self.spec.limits.output_bytes))
            timed_out = False
            try:
                r = await asyncio.wait_for(asyncio.shield(fut), timeout + 2.0)
            except TimeoutError:  # something the call started holds its output open: kill it all
                timed_out = True
                await self._kill_call()
                try:
                    r = await asyncio.wait_for(fut, GRACE_S)
                except TimeoutError:
                    raise SessionInfraError(f"session {self.id}: the engine did not end an exec past its "
                                            "deadline") from None
            except Exception as e:
                raise e if isinstance(e, SessionError) else self._b._classify(e) from e
            dur = time.monotonic() - t0
            if r["code"] == 137 and dur >= timeout - 0.05:
                timed_out = True
            if timed_out:
                await self._kill_call()
        if r["code"] is None:
            raise SessionInfraError(f"session {self.id}: the engine gave no exit code")
        return ExecResult(exit_code=124 if timed_out else int(r["code"]),
                          stdout=r["out"].decode("utf-8", "replace"), stderr=r["err"].decode("utf-8", "replace"),
                          timed_out=timed_out, truncated=r["trunc"], duration_s=dur)

    def _abs(self, path: str) -> str:
        return path if path.startswith("/") else os.path.join(self.spec.workdir, path)

    async def read_file(self, path: str) -> bytes:
        p = self._abs(path)

        def get() -> bytes:
            try:
                stream, st = self._c.get_archive(p)
            except Exception as e:
                if getattr(e, "status_code", None) == 404:
                    raise SessionFileNotFound(f"session {self.id}: {path}: no such file") from None
                raise
            if st.get("size", 0) > MAX_FILE:
                raise SessionError(f"session {self.id}: {path}: larger than {MAX_FILE} bytes")
            with tarfile.open(fileobj=io.BufferedReader(_Cap(stream, MAX_FILE + (1 << 20))), mode="r|") as tf:
                for m in tf:
                    if not m.isreg():
                        raise SessionError(f"session {self.id}: {path}: not a regular file")
                    f = tf.extractfile(m)
                    return f.read() if f else b""
            raise SessionFileNotFound(f"session {self.id}: {path}: no such file")

        async with self._lock:
            self._check()
            data: bytes = await self._api(get)
            return data

    async def write_file(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        tar = _tar_of_file(self._abs(path), raw, mode)
        async with self._lock:
            self._check()
            ok = await self._api(self._c.put_archive, "/", tar)
            if not ok:
                raise SessionError(f"session {self.id}: could not write {path}")

    async def diff(self) -> str:
        wd = self.spec.workdir

        def get() -> str:
            tmp = os.path.realpath(tempfile.mkdtemp(prefix="rlf-docker-diff-"))
            cleanup.sweep_once(os.path.dirname(tmp))  # what a killed trainer's `discard` below left there
            try:
                stream, _ = self._c.get_archive(wd)
                with tarfile.open(fileobj=io.BufferedReader(_Cap(stream, 1 << 30)), mode="r|") as tf:
                    for m in tf:
                        name = os.path.normpath(m.name)
                        if name.startswith("..") or name.startswith("/") or not (m.isreg() or m.isdir()
                                                                                  or m.issym()):
                            continue
                        target = os.path.join(tmp, name)
                        if not inside(tmp, os.path.dirname(target)):  # never through a link a member made
                            continue
                        if os.path.islink(target):
                            os.unlink(target)
                        m.name = name
                        m.mode = (m.mode & 0o755) | (0o700 if m.isdir() else 0o600)
                        m.uid = m.gid = os.getuid()
                        tf.extract(m, tmp, set_attrs=True, numeric_owner=True, filter="fully_trusted")
                return gitdiff.diff_trees(self.spec.seed_dir, os.path.join(tmp, os.path.basename(wd.rstrip("/"))))
            finally:
                cleanup.discard(tmp)  # what the container held: any depth or mode, removed off the call's path

        async with self._lock:
            self._check()
            try:
                patch: str = await self._api(get, timeout_s=API_TIMEOUT_S + self.spec.limits.exec_timeout_s)
            except gitdiff.DiffTooLarge as e:
                raise SessionError(f"session {self.id}: {e}") from None
            return patch

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._timer.cancel()
        self._b._sessions.discard(self)
        with contextlib.suppress(Exception):
            await _remove(self._c)


class DockerBackend(SessionBackend):
    name = "docker"

    def __init__(self, base_url: str | None = None, max_starting: int = 8, creates_per_s: float = 20.0,
                 reap_every_s: float = 30.0, pool_size: int | None = None) -> None:
        try:
            import docker
        except ImportError:
            from rlf_envs.extras import install_hint

            raise SessionInfraError(f"the docker backend needs the docker SDK: {install_hint('docker')}") from None
        try:
            self.client = docker.DockerClient(base_url=base_url, timeout=API_TIMEOUT_S) if base_url \
                else docker.from_env(timeout=API_TIMEOUT_S)
            self.client.ping()
        except Exception as e:
            where = base_url or os.environ.get("DOCKER_HOST") or "the default socket"
            raise SessionInfraError(f"no docker engine at {where}: {e} (start dockerd or set DOCKER_HOST)") from None
        self._docker = docker
        #: warm containers per (image, network, limits, workdir, env): created and started ahead, labelled like any
        #: session (so the reaper removes them too); a create then only copies the seed in
        self.pool_size = int(os.environ.get("RLF_DOCKER_SESSION_POOL", 2)) if pool_size is None else pool_size
        self._pool: dict[tuple[Any, ...], list[Any]] = {}
        self._filling: set[tuple[Any, ...]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.max_starting = max_starting
        self.creates_per_s = creates_per_s
        self.reap_every_s = reap_every_s
        self._sem: asyncio.Semaphore | None = None
        self._rate = CreateRate(creates_per_s, max_starting)
        self._sessions: set[DockerSession] = set()
        self._reaper: asyncio.Task[None] | None = None
        self._closed = False
        self.host = socket.gethostname()
        self.reaped_at_start = self.reap()

    def _classify(self, e: BaseException) -> SessionError:
        errors = self._docker.errors
        if isinstance(e, errors.NotFound):
            return SessionInfraError(f"the session's container is gone: {e}")
        if isinstance(e, errors.APIError) and e.status_code is not None and e.status_code < 500:
            return SessionError(f"docker refused: {e}")
        return SessionInfraError(f"docker engine failure: {e!r}")

    def _labels(self) -> dict[str, str]:
        pid = os.getpid()
        return {LABEL: "1", "rlf.owner.run": owners.RUN_ID, "rlf.owner.pid": str(pid),
                "rlf.owner.start": str(owners.start_time(pid)), "rlf.owner.host": self.host}

    def reap(self) -> int:
        """Remove this host's session containers whose owner process is gone."""
        n = 0
        try:
            found = self.client.containers.list(all=True, filters={"label": [LABEL, f"rlf.owner.host={self.host}"]})
        except Exception:
            return 0
        for c in found:
            lab = c.labels
            try:
                pid, start = int(lab["rlf.owner.pid"]), lab.get("rlf.owner.start")
                started = int(start) if start and start != "None" else None
            except (KeyError, ValueError):
                continue
            if owners.alive(pid, started):
                continue
            with contextlib.suppress(Exception):
                c.remove(force=True)
                n += 1
        return n

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.reap_every_s)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.reap)

    @staticmethod
    def _key(spec: SessionSpec) -> tuple[Any, ...]:
        lim = spec.limits
        return (spec.image, spec.network, lim.memory_mb, lim.pids, spec.workdir, tuple(sorted(spec.env.items())))

    def _fill(self, spec: SessionSpec) -> None:
        key = self._key(spec)
        if self.pool_size <= 0 or key in self._filling or self._closed:
            return
        self._filling.add(key)
        bare = SessionSpec(image=spec.image, workdir=spec.workdir, env=spec.env, network=spec.network,
                           limits=spec.limits)

        async def fill() -> None:
            try:
                while len(self._pool.get(key, [])) < self.pool_size and not self._closed:
                    fut = asyncio.ensure_future(asyncio.to_thread(self._create, bare))
                    try:
                        c = await asyncio.wait_for(asyncio.shield(fut), API_TIMEOUT_S)
                    except BaseException:
                        _discard_when_done(fut)
                        raise
                    if self._closed:
                        await _remove(c)
                        return
                    self._pool.setdefault(key, []).append(c)
            except Exception:  # the pool is an optimisation: creates make containers on demand
                pass
            finally:
                self._filling.discard(key)

        t = asyncio.get_running_loop().create_task(fill())
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _lease(self, spec: SessionSpec) -> Any:
        """A warm container for the spec with the seed copied in, or None."""
        pooled = self._pool.get(self._key(spec))
        if not pooled:
            return None
        c = pooled.pop()
        try:
            if spec.seed_dir and not c.put_archive(spec.workdir, _tar_of_dir(spec.seed_dir)):
                raise SessionInfraError("could not copy the seed into the container")
        except BaseException:
            with contextlib.suppress(Exception):
                c.remove(force=True)
            raise
        return c

    def _create(self, spec: SessionSpec) -> Any:
        lim = spec.limits
        name = "rlf-" + uuid.uuid4().hex[:16]
        c = self.client.containers.create(
            _image_ref(spec.image), ["sleep", "infinity"], name=name, labels=self._labels(), detach=True,
            working_dir=spec.workdir, environment=spec.env, network_mode="bridge" if spec.network else "none",
            mem_limit=f"{lim.memory_mb}m", memswap_limit=f"{lim.memory_mb}m", pids_limit=lim.pids,
            cap_drop=["NET_RAW", "MKNOD", "AUDIT_WRITE", "SETFCAP"], security_opt=["no-new-privileges"],
            init=False, hostname="sandbox")
        try:
            c.start()
            if spec.seed_dir and not c.put_archive(spec.workdir, _tar_of_dir(spec.seed_dir)):
                raise SessionInfraError("could not copy the seed into the container")
        except BaseException:
            with contextlib.suppress(Exception):
                c.remove(force=True)
            raise
        return c

    async def create(self, spec: SessionSpec) -> DockerSession:
        if self._closed:
            raise SessionClosed("the docker session backend is closed")
        _image_ref(spec.image)
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_starting)
        if self._reaper is None and self.reap_every_s > 0:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_loop())
        async with self._sem:
            c = None
            with contextlib.suppress(Exception):  # a dead warm container: make one instead
                c = await asyncio.wait_for(asyncio.to_thread(self._lease, spec), API_TIMEOUT_S)
            self._fill(spec)
            if c is not None:
                s = DockerSession(self, c, spec)
                self._sessions.add(s)
                return s
            await self._rate.wait()
            fut = asyncio.ensure_future(asyncio.to_thread(self._create, spec))
            try:
                c = await asyncio.wait_for(asyncio.shield(fut), API_TIMEOUT_S)
            except TimeoutError:
                raise SessionInfraError(f"the docker engine did not create a container within {API_TIMEOUT_S} s "
                                        "(the reaper removes it if it appears later)") from None
            except SessionError:
                raise
            except Exception as e:
                if isinstance(e, self._docker.errors.ImageNotFound):
                    raise SessionError(f"image {spec.image!r} is not in the engine: `docker pull`/`docker load`/"
                                       "`docker import` it first") from None
                raise self._classify(e) from e
            s = DockerSession(self, c, spec)
            self._sessions.add(s)
            return s

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
        # pool fills end after their current create (they see _closed and remove what they made): cancelling one
        # would leave the container its thread is making
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*list(self._tasks), return_exceptions=True), API_TIMEOUT_S)
        await asyncio.gather(*(s.aclose() for s in list(self._sessions)), return_exceptions=True)
        warm = [c for cs in self._pool.values() for c in cs]
        self._pool.clear()
        await asyncio.gather(*(_remove(c) for c in warm), return_exceptions=True)
        with contextlib.suppress(Exception):
            self.client.close()
