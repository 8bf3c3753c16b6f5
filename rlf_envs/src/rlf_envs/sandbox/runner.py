"""Scoring-process side of the sandbox: prepare a work dir, start the supervisor, read its one result line."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import itertools
import json
import logging
import os
import secrets
import signal
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlf_envs.sandbox import cleanup, quota
from rlf_envs.sandbox._supervisor import DIRECT_READY, DIRECT_UNCONFINED
from rlf_envs.sandbox.limits import SandboxLimits, SandboxResult
from rlf_envs.sandbox.pool import DirectLease, Lease, PoolUnavailable, SandboxPool, default_pool

log = logging.getLogger(__name__)

SUPERVISOR = str(Path(__file__).with_name("_supervisor.py"))
#: per-run uids are drawn from [UID_BASE, UID_BASE + UID_SPAN): far above any real or container user range
UID_BASE, UID_SPAN = 1_600_000_000, 1 << 24
GRACE_S = 10.0  # the supervisor's own start-up and clean-up, on top of the run's deadline
_warned: set[str] = set()
DEFAULT_DISK_MB = SandboxLimits.model_fields["disk_mb"].default
# consecutive uids in this process (never shared by two live dirs of ours), from a random start (so that two
# trainers on one machine are unlikely to overlap)
_uid_sequence = itertools.count(secrets.randbelow(UID_SPAN))


#: paths no run may read (task data: answers, hidden tests, reference programs), wherever they lie: `hide_from_runs`
_HIDDEN: set[str] = {os.path.realpath(Path(__file__).resolve().parents[1] / "data")}  # rlf_envs' shipped datasets


def hide_from_runs(path: str | os.PathLike[str]) -> None:
    """Make `path` (a file or a directory of task data) unreadable from every sandboxed run of this process. A run's
    root holds only the system's directories, the interpreter's and its work dir, so data elsewhere is out of its
    reach anyway; a path inside those (e.g. a dataset installed into the interpreter's site-packages) is covered
    in the run by an empty read-only directory, or /dev/null for a file. `rlf_envs.tasks.load_tasks` calls this for
    every file it loads, and rlf_envs' own data directory is always hidden."""
    _HIDDEN.add(os.path.realpath(path))


def _is_root() -> bool:
    return os.geteuid() == 0


class SandboxDir:
    """A fresh work directory for sandboxed runs (the code's cwd, HOME and TMPDIR), with the unprivileged uid
    its runs use when we are root. Several runs may share one (e.g. an episode of the interpreter tool);
    `remove()` deletes it."""

    def __init__(self, drop_privileges: bool = True, parent: str | None = None,
                 disk_mb: int | None = DEFAULT_DISK_MB) -> None:
        """`parent`: where to create it; default the default pool's `base_dir` (removed with the pool, also
        when the trainer dies), or the system temp dir without a pool. `disk_mb`: the work dir's quota (a tmpfs of
        that size; as root, in a pool's base dir: `quota`); None for none. `quota` says what bounds it."""
        if parent is None:
            pool = default_pool()
            parent = pool.base_dir if pool is not None else None
        self.root = Path(tempfile.mkdtemp(prefix="rlf_sbx_", dir=parent))
        os.chmod(self.root, 0o711)  # others may traverse to `work` (the run's uid), not list it
        #: (True, how) where the work dir has a quota of its own, else (False, why not)
        self.quota: tuple[bool, str] = (False, "SandboxDir(disk_mb=None)")
        #: where `write` moves what a run left in its way: on the work dir's filesystem (a rename), outside the work dir
        self._trash = self.root
        if disk_mb is not None:
            # the quota's tmpfs at root/fs holds `work` and that trash; runs see `work` only, and `remove` renames
            # `root` (a plain directory) away at once, the tmpfs inside it (unmounted by the reaper)
            self.quota = self._mount_quota(disk_mb)
            if self.quota[0]:
                self._trash = self.root / "fs"
        self.path = self._trash / "work"
        self.path.mkdir(mode=0o700)
        self.uid: int | None = None
        if _is_root() and drop_privileges:
            self.uid = UID_BASE + next(_uid_sequence) % UID_SPAN
            os.chown(self.path, self.uid, self.uid)

    def _mount_quota(self, disk_mb: int) -> tuple[bool, str]:
        if not quota.is_shared_base(os.path.dirname(self.root)):
            return False, ("the work dir is not in a sandbox pool's base dir shared with its zygote (as root, the "
                           "default pool's): it is a plain directory of the host's disk")
        fs = self.root / "fs"
        fs.mkdir(mode=0o711)
        why = quota.mount_work_dir(str(fs), disk_mb)
        if why is not None:
            fs.rmdir()
            return False, why
        return True, (f"the work dir is a tmpfs of its own: {disk_mb} MB, {max(1024, disk_mb * quota.INODES_PER_MB)} "
                      "inodes (ENOSPC beyond); its pages are memory")

    def write(self, name: str, text: str) -> None:
        """Write a file the run can read but not replace before we read it back (owned by us, 0644). Whatever the
        code left at that name (a directory tree, a symlink, a fifo) is moved out of the run's reach first and
        removed in the background (`cleanup.discard`): never written through, never a wait on its size."""
        p = self.path / name
        if os.path.lexists(p):
            cleanup.discard(p, into=self._trash)  # beside the work dir, where no run looks
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT) or not self.quota[0]:
                raise
            raise OSError(e.errno, f"{name} ({len(text)} chars) does not fit in the work dir's quota ({self.quota[1]}):"
                                   " raise SandboxLimits.disk_mb, or a run of this episode filled it") from e

    def remove(self) -> None:
        """Gone from its place at once (a rename); its content is deleted by a background reaper
        (`rlf_envs.sandbox.cleanup`), so whatever a run left there costs the caller nothing and never raises."""
        cleanup.discard(self.root)

    def __enter__(self) -> SandboxDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


@functools.lru_cache(maxsize=16)
def _python_dirs(python: str) -> tuple[str, ...]:
    """The directories the interpreter needs: its installation (symlinks resolved) and, for a virtualenv,
    the env's own root (where its `bin/python` link and `pyvenv.cfg` live). Cached: resolving them took ~0.5 ms
    of every run."""
    dirs = {os.path.dirname(os.path.dirname(os.path.realpath(python))),
            os.path.dirname(os.path.dirname(os.path.abspath(python)))}
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        dirs |= {sys.prefix, sys.base_prefix}
    return tuple(sorted(d for d in dirs if os.path.isdir(d)))


def _supervisor_env(workdir: Path) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir), "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1"}


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> bytes:
    buf = bytearray()
    while chunk := await stream.read(1 << 16):
        buf += chunk[: max(0, cap - len(buf))]
    return bytes(buf)


async def _exited(proc: asyncio.subprocess.Process) -> int:
    """Wait for the process itself (not its pipes, which an escaped grandchild could hold open)."""
    delay = 0.001
    while proc.returncode is None:
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.005)
    return proc.returncode


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def frame(obj: dict[str, Any]) -> bytes:
    """One part of a job on the wire: 4-byte big-endian length + JSON (read by `_run.read_frame`)."""
    data = json.dumps(obj).encode()
    return struct.pack("!I", len(data)) + data


PoolArg = SandboxPool | bool | None  # None/True: the default pool (if on); False: a cold supervisor; or a pool


def _pool_for(pool: PoolArg, python: str) -> SandboxPool | None:
    chosen = default_pool() if pool is None or pool is True else (pool or None)
    # the same path, not the same binary: a virtualenv's python is a link to its base interpreter's
    return chosen if chosen is not None and os.path.abspath(chosen.python) == os.path.abspath(python) else None


async def _supervise(job: dict[str, Any], private: dict[str, Any], workdir: SandboxDir, limits: SandboxLimits,
                     pool: PoolArg = None) -> SandboxResult:
    """Run `job` in a supervisor (a pooled one when available, else a fresh interpreter), wait (bounded) and
    return its verdict; the supervisor is killed in `finally`. `private` (the tests) is sent after the public
    part, so that a forked worker never holds it (see `pool`)."""
    nonce = secrets.token_hex(16)
    job = {**job, "limits": limits.model_dump(), "drop_uid": workdir.uid, "workdir": str(workdir.path),
           "drop_uid_reason": "SandboxLimits.drop_privileges=False" if not limits.drop_privileges else "",
           "python_dirs": list(_python_dirs(job["python"])), "hide": sorted(_HIDDEN)}
    secret = frame({**private, "nonce": nonce})
    chosen = _pool_for(pool, job["python"])
    if chosen is not None and workdir.quota[0] and os.path.dirname(workdir.root) != chosen.base_dir:
        # the work dir's tmpfs is mounted where this pool's namespaces do not receive it (another pool's base dir):
        # a supervisor started from our own namespace sees it
        chosen = None
    t0 = time.monotonic()
    if chosen is not None and job["mode"] == "run" and limits.namespaces and not limits.network:
        try:
            direct = chosen.lease_direct()  # no supervisor process at all (as root)
        except PoolUnavailable:
            direct = None  # said below, when the supervisor's lease fails the same way
        if direct is not None:
            try:
                return await _run_direct(direct, {**job, "fork_worker": True}, limits, t0)
            except _NotReady as e:
                if e.unconfined:
                    log.warning("sandbox: a direct worker could not enter its namespaces; runs are supervised "
                                "from now on")
                    chosen.direct = False
    if chosen is not None:
        try:
            # no fork on this path for a default job: the zygote hands over an idle, pre-confined supervisor
            lease = chosen.lease(confined=limits.namespaces and not limits.network)
        except PoolUnavailable as e:
            if str(e) not in _warned:
                _warned.add(str(e))
                log.warning("sandbox: %s; runs start a supervisor of their own (the cold path)", e)
        else:
            out, err = await _run_leased(lease, frame({**job, "fork_worker": True}) + secret, nonce, limits)
            return _parse(out, err, nonce, time.monotonic() - t0)
    out, err = await _run_cold(frame(job) + secret, workdir, limits)
    return _parse(out, err, nonce, time.monotonic() - t0)


def _output_cap(limits: SandboxLimits) -> int:
    return 12 * limits.max_output_bytes + (1 << 20)  # stdout+stderr, JSON-escaped (<= 6x), plus the verdict


async def _run_cold(payload: bytes, workdir: SandboxDir, limits: SandboxLimits) -> tuple[bytes, bytes]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", SUPERVISOR, cwd=workdir.path, env=_supervisor_env(workdir.path),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    readers: list[asyncio.Future[bytes]] = []
    out = err = b""
    try:
        assert proc.stdin and proc.stdout and proc.stderr
        readers = [asyncio.ensure_future(_read_capped(proc.stdout, _output_cap(limits))),
                   asyncio.ensure_future(_read_capped(proc.stderr, 16_384))]
        proc.stdin.write(payload)
        try:
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            async with asyncio.timeout(limits.timeout_s + GRACE_S):
                await _exited(proc)
        except TimeoutError:
            pass
    finally:
        _kill_session(proc.pid)
        try:
            async with asyncio.timeout(2):
                await _exited(proc)
                if readers:
                    out, err = await asyncio.gather(*readers)
        except TimeoutError:
            pass
        finally:
            for r in readers:
                r.cancel()
    return out, err


async def _result_line(reader: asyncio.StreamReader, nonce: str, cap: int) -> bytes:
    """Read until the supervisor's result line (the one carrying `nonce`) or EOF; returns what was read."""
    out = bytearray()
    key = f'"nonce": "{nonce}"'.encode()
    while len(out) < cap:
        try:
            line = await reader.readline()
        except (asyncio.LimitOverrunError, ValueError, ConnectionError):  # (a supervisor killed from outside: EOF)
            break
        out += line
        if not line or (key in line and line.endswith(b"\n")):
            break
    return bytes(out)


async def _run_leased(lease: Lease, payload: bytes, nonce: str, limits: SandboxLimits) -> tuple[bytes, bytes]:
    """Send the job to a pooled supervisor over its socket; its result comes back on the same socket. We return
    as soon as the result line is in: the supervisor writes it after the worker's whole tree is dead (pid 1 of
    its namespace reaped, or every process found killed), so what is left is its own exit, which the zygote
    reaps (tearing down namespaces can take the kernel milliseconds; no caller waits for that)."""
    cap = _output_cap(limits)
    job_sock = socket.socket(fileno=lease.job_fd)
    err_sock = socket.socket(fileno=lease.err_fd)
    writers: list[asyncio.StreamWriter] = []
    err_task: asyncio.Future[bytes] | None = None
    out = err = b""
    try:
        reader, writer = await asyncio.open_connection(sock=job_sock, limit=cap)
        err_reader, err_writer = await asyncio.open_connection(sock=err_sock)
        writers = [writer, err_writer]
        err_task = asyncio.ensure_future(_read_capped(err_reader, 16_384))
        writer.write(payload)
        try:
            await writer.drain()
            writer.write_eof()
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            async with asyncio.timeout(limits.timeout_s + GRACE_S):
                out = await _result_line(reader, nonce, cap)
        except TimeoutError:
            pass
    finally:
        try:
            # done (its worker is dead already) or past the deadline: either way it goes now, and its worker
            # with it (PDEATHSIG; pid namespace)
            signal.pidfd_send_signal(lease.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if err_task is not None and f'"nonce": "{nonce}"'.encode() not in out:
            try:  # no verdict: what the supervisor said on stderr explains why
                async with asyncio.timeout(2):
                    err = await asyncio.shield(err_task)
            except TimeoutError:
                pass
        if err_task is not None:
            err_task.cancel()
        for w in writers:
            w.close()
        if not writers:
            job_sock.close()
            err_sock.close()
        os.close(lease.pidfd)
    return out, err


class _Sink(asyncio.Protocol):
    """What one pipe carries, up to `cap` bytes: the rest is dropped, `overflow` set and `on_overflow` called."""

    def __init__(self, cap: int, on_overflow: Callable[[], None] | None = None) -> None:
        self.buf = bytearray()
        self.cap, self.on_overflow = cap, on_overflow
        self.overflow = False
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        room = self.cap - len(self.buf)
        self.buf += data[: max(0, room)]
        if len(data) > room and not self.overflow:
            self.overflow = True
            if self.on_overflow is not None:
                self.on_overflow()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def _read_all(loop: asyncio.AbstractEventLoop, sock: socket.socket, cap: int) -> bytes:
    buf = bytearray()
    while len(buf) < cap and (chunk := await loop.sock_recv(sock, 65536)):
        buf += chunk
    return bytes(buf)


class _NotReady(Exception):
    """A direct worker that will not run the job: `unconfined` (it could not enter its namespaces), or gone."""

    def __init__(self, unconfined: bool) -> None:
        super().__init__("unconfined" if unconfined else "gone")
        self.unconfined = unconfined


async def _run_direct(lease: DirectLease, job: dict[str, Any], limits: SandboxLimits,
                      t0: float) -> SandboxResult:
    """Run a default `run` job in a direct worker (`_zygote._direct_child`): we hold its output pipes (capped:
    overflow kills it), its wall deadline (expiry kills it) and a pidfd (SIGKILL to pid 1 of its pid namespace
    kills every process of the run); the zygote writes its wait status on `status_fd` once it has reaped it, by
    which time the kernel has killed the rest of its namespace. Raises `_NotReady` before sending the job if the
    worker could not enter its namespaces or is gone (the caller leases a supervisor instead)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(fileno=lease.job_fd)
    sock.setblocking(False)
    transports: list[asyncio.BaseTransport] = []
    killed = False

    def kill() -> None:
        nonlocal killed
        if not killed:
            killed = True
            try:
                signal.pidfd_send_signal(lease.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    fds = [lease.out_fd, lease.err_fd, lease.status_fd]
    try:
        try:
            async with asyncio.timeout(GRACE_S):
                ready = await loop.sock_recv(sock, 1)  # sent while it was idle: no wait
        except TimeoutError:
            ready = b""
        if ready != DIRECT_READY:  # unconfined; or it died (killed from outside) before we got it
            raise _NotReady(unconfined=ready == DIRECT_UNCONFINED)
        sinks = []
        for fd, cap, on_overflow in ((lease.out_fd, limits.max_output_bytes, kill),
                                     (lease.err_fd, limits.max_output_bytes, kill), (lease.status_fd, 8, None)):
            fds.remove(fd)
            transport, sink = await loop.connect_read_pipe(
                lambda c=cap, f=on_overflow: _Sink(c, f),  # type: ignore[misc]
                open(fd, "rb", buffering=0))  # noqa: SIM115
            transports.append(transport)
            sinks.append(sink)
        out, err, status = sinks
        try:
            await loop.sock_sendall(sock, frame(job))
        except (BrokenPipeError, ConnectionResetError):  # it died since it said it was ready
            raise _NotReady(unconfined=False) from None
        timed_out = False
        verdict: dict[str, Any] = {}
        line = b""
        try:
            async with asyncio.timeout(limits.timeout_s):
                try:
                    line = await _read_all(loop, sock, 1 << 20)  # its guards, then it closes the socket and runs
                except ConnectionResetError:
                    line = b""
                if not line:  # it died before its set-up was done, so before any code ran: run it elsewhere
                    raise _NotReady(unconfined=False)
                try:
                    verdict = json.loads(line)
                except ValueError:
                    verdict = {}
                await asyncio.shield(status.done)  # (a cancelled future would stay cancelled)
        except TimeoutError:
            timed_out = not out.overflow and not err.overflow
        kill()
        try:
            async with asyncio.timeout(2.0):  # the zygote reaps it: its namespace is dead then
                await asyncio.shield(asyncio.gather(status.done, out.done, err.done))
        except TimeoutError:
            pass
        code: int | None = None
        if len(status.buf) == 4 and not timed_out and not out.overflow and not err.overflow:
            code = os.waitstatus_to_exitcode(struct.unpack("!i", bytes(status.buf))[0])
        if not isinstance(verdict, dict) or not ("guards" in verdict or "error" in verdict):
            verdict = {"error": "the sandbox worker gave no set-up verdict" + ("" if line else " in time")}
        result = SandboxResult(
            stdout=out.buf.decode("utf-8", errors="replace"), stderr=err.buf.decode("utf-8", errors="replace"),
            exit_code=None if verdict.get("error") else code, timed_out=timed_out,
            output_truncated=out.overflow or err.overflow, wall_s=time.monotonic() - t0,
            guards=verdict.get("guards", {}), missing_guards=verdict.get("missing_guards", {}),
            error=verdict.get("error"),
        )
        _warn_missing(result.missing_guards)
        return result
    finally:
        kill()
        for t in transports:
            t.close()
        for fd in fds:
            os.close(fd)
        sock.close()
        os.close(lease.pidfd)


def _parse(out: bytes, err: bytes, nonce: str, wall: float) -> SandboxResult:
    for line in reversed(out.splitlines()):
        try:
            res = json.loads(line)
        except ValueError:
            continue
        if not isinstance(res, dict) or res.get("nonce") != nonce:
            continue
        result = SandboxResult(
            stdout=res.get("stdout", ""), stderr=res.get("stderr", ""), exit_code=res.get("exit_code"),
            timed_out=bool(res.get("timed_out")), output_truncated=bool(res.get("output_truncated")), wall_s=wall,
            guards=res.get("guards", {}), missing_guards=res.get("missing_guards", {}), error=res.get("error"),
            test_results=tuple(bool(r) for r in res.get("results", ())), test_errors=tuple(res.get("errors", ())),
        )
        _warn_missing(result.missing_guards)
        return result
    tail = err[-2000:].decode(errors="replace")
    return SandboxResult(wall_s=wall, timed_out=True, error=f"the sandbox supervisor gave no result: {tail}")


def _warn_missing(missing: dict[str, str]) -> None:
    for name, why in missing.items():
        if name not in _warned:
            _warned.add(name)
            log.warning("sandbox: guard %r is not in force: %s", name, why)


async def run_python(
    code: str,
    stdin: str = "",
    limits: SandboxLimits | None = None,
    workdir: SandboxDir | None = None,
    *,
    python: str | None = None,
    pool: PoolArg = None,
) -> SandboxResult:
    """Run `code` as a Python script (`python -I main.py`) in the sandbox, with `stdin`, under `limits`.

    `workdir`: a `SandboxDir` to run in (it is kept; files persist between runs), else a fresh one that is
    removed afterwards. stdout and stderr are captured (capped); the whole process tree is killed at the
    end, whatever the code did. `pool`: None (the default pool, unless `RLF_SANDBOX_POOL=0`), a
    `SandboxPool`, or False (a supervisor and a worker interpreter of their own: the cold path)."""
    limits = limits or SandboxLimits()
    own = workdir is None
    wd = workdir or SandboxDir(limits.drop_privileges, _base_dir(pool, python), limits.disk_mb)
    try:
        script = ".rlf_main.py"
        try:
            wd.write(script, code)
        except OSError as e:  # e.g. an earlier run of the episode filled the work dir's quota
            return SandboxResult(error=f"could not write the code into the work dir ({e.strerror}): an earlier run "
                                       f"may have filled its quota (SandboxLimits.disk_mb={limits.disk_mb})")
        job = {"mode": "run", "script": script, "stdin": stdin, "python": python or sys.executable}
        return _quota_guard(await _supervise(job, {}, wd, limits, pool), wd)
    finally:
        if own:
            wd.remove()


def _base_dir(pool: PoolArg, python: str | None) -> str | None:
    """Where a run's own work dir goes: the base dir of the pool it runs in (whose namespaces receive the work dir's
    tmpfs), else the default one (`SandboxDir`)."""
    chosen = _pool_for(pool, python or sys.executable)
    return chosen.base_dir if chosen is not None and not chosen.closed else None


def _quota_guard(result: SandboxResult, wd: SandboxDir) -> SandboxResult:
    """The work dir's quota, reported with the run's guards (`disk_quota`)."""
    ok, how = wd.quota
    if result.error is not None:  # the sandbox failed: nothing ran, no guard to report
        return result
    if ok:
        return dataclasses.replace(result, guards={**result.guards, "disk_quota": how})
    _warn_missing({"disk_quota": how})
    return dataclasses.replace(result, missing_guards={**result.missing_guards, "disk_quota": how})


async def run_tests(
    solution: str,
    tests: list[str],
    limits: SandboxLimits | None = None,
    *,
    python: str | None = None,
    pool: PoolArg = None,
) -> SandboxResult:
    """Judge `solution` against `tests` (Python test code, e.g. asserts). The solution runs in the sandboxed
    worker; each test runs in the trusted supervisor, against proxies of the solution's names, so the
    verdict in `test_results` is decided where the solution cannot reach (see the package docstring)."""
    limits = limits or SandboxLimits()
    with SandboxDir(limits.drop_privileges, _base_dir(pool, python), limits.disk_mb) as wd:
        try:
            wd.write("solution.py", solution)
        except OSError as e:  # (a solution larger than the quota)
            return SandboxResult(error=f"could not write the solution into the work dir ({e.strerror}; "
                                       f"SandboxLimits.disk_mb={limits.disk_mb})", test_results=(False,) * len(tests))
        job = {"mode": "tests", "script": "solution.py", "python": python or sys.executable}
        result = _quota_guard(await _supervise(job, {"tests": tests}, wd, limits, pool), wd)
    if len(result.test_results) != len(tests):
        result = dataclasses.replace(result, test_results=(False,) * len(tests))
    return result

