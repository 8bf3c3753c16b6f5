"""A warm pool of sandbox supervisors: a python call costs a fork and the code, not an interpreter start.

`SandboxPool` starts one trusted zygote (`_supervisor.py --zygote`: a bare interpreter that imported what a
run needs and then only forks) and keeps `size` idle supervisors forked from it, each already inside the
namespaces a default run gets (pid, mount, ipc, uts, net: creating them is off the run's path) and blocked
reading its job; a job with `namespaces=False` or `network=True` gets a supervisor forked for it instead.
A run takes one (one round trip on a local socket), and the zygote forks a replacement after replying, off
the hot path. The supervisor then does what a cold one does (namespaces, uid, rlimits, deadline, whole-tree
kill), except that its worker is a fork of itself running the code in-process, not a new interpreter.

Direct workers (as root, for default `run` jobs: `lease_direct`): the zygote also keeps `size` idle workers,
each forked as pid 1 of a new pid namespace (the zygote unshares `CLONE_NEWPID` for that one fork and `setns`es
back) and already inside mount/ipc/uts/net namespaces of its own. The trainer sends it the job and then holds
what a supervisor would: the output pipes, the deadline and a pidfd to kill it; the zygote writes its wait
status on a pipe once it has reaped it. One fork per run instead of two, and no supervisor interpreter.

Why a fork cannot leak one run into the next: the zygote never reads a job and never runs code, so every
supervisor is a copy of the same clean template; each serves exactly one run and exits. Its worker is forked
after the supervisor read only the run's public part (limits, work dir, script, stdin) and before it reads
the private part (nonce, tests), which is still in the kernel's socket buffer at the fork. The worker closes
every descriptor but its own pipes before the code runs, gets a fresh `__main__`, std streams, environment,
signal dispositions and random state, and its memory, modules and builtins die with it.

Teardown: `close()` (also at interpreter exit, via `weakref.finalize`) closes the control socket; the zygote
then kills every supervisor it forked and removes `base_dir`, where the work dirs of the runs live. The same
happens when the trainer dies without cleaning up (SIGTERM, SIGKILL): the control socket closes with it.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

from rlf_envs.sandbox import cleanup, quota
from rlf_envs.sandbox._supervisor import CONFINED, DIRECT, PLAIN

log = logging.getLogger(__name__)

SUPERVISOR = str(Path(__file__).with_name("_supervisor.py"))
#: idle supervisors kept forked by default; `RLF_SANDBOX_POOL=0` turns the default pool off (cold starts)
DEFAULT_SIZE = 4
#: stdlib modules imported once in the template, so that a run importing them pays nothing (a run still
#: gets its own copy: what it changes in them dies with it). Only stdlib: the template must stay trusted.
DEFAULT_PRELOAD = ("bisect", "collections", "csv", "datetime", "decimal", "fractions", "functools", "heapq",
                   "itertools", "json", "math", "operator", "re", "statistics", "string")
_REPLY_TIMEOUT_S = 10.0


class PoolUnavailable(RuntimeError):
    """The zygote could not be started or did not answer; the caller falls back to a cold supervisor."""


@dataclass(frozen=True, slots=True)
class Lease:
    """One idle supervisor, now ours: its pid, a pidfd (readable when it exits; safe to signal), and our ends
    of its job/result and stderr sockets. The caller owns (and must close) the three descriptors."""

    pid: int
    pidfd: int
    job_fd: int
    err_fd: int


@dataclass(frozen=True, slots=True)
class DirectLease:
    """One idle direct worker (a default `run` job as root: no supervisor process), now ours: its pid, a pidfd
    (signal it to kill its whole pid namespace), our end of its job socket (its ready byte, then the job out and
    its guards back), the read ends of its stdout and stderr pipes, and the status pipe on which the zygote writes
    its wait status (4 bytes, big-endian) when it has exited. The caller owns (and must close) the five."""

    pid: int
    pidfd: int
    job_fd: int
    out_fd: int
    err_fd: int
    status_fd: int


def _remove_dir(base_dir: str, owner: int) -> None:
    if os.getpid() == owner:  # not from a forked copy of the trainer exiting: the dirs are its parent's
        quota.unshare(base_dir)  # (the work dirs' tmpfs go with it)
        cleanup.discard(base_dir)  # renamed away now, deleted in the background (never raises)


def _shutdown(proc: subprocess.Popen[bytes], ctrl: socket.socket, base_dir: str, owner: int) -> None:
    if os.getpid() != owner:
        ctrl.close()  # our copy only: the zygote still has its owner
        return
    try:
        ctrl.close()  # the zygote sees EOF: it kills its supervisors and removes base_dir
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # (e.g. still deleting what runs left: the reaper takes over below)
        proc.kill()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            log.warning("sandbox pool: the zygote (pid %d) did not exit after SIGKILL", proc.pid)
    finally:
        _remove_dir(base_dir, owner)


class SandboxPool:
    """A zygote and up to `size` idle supervisors for `python` (the interpreter the forked workers run).

    Thread-safe; usable from any event loop (a lease is one blocking round trip on a local socket: the zygote
    only hands over descriptors it already holds, so it answers in microseconds). `close()` is idempotent.
    Work dirs made with `SandboxDir(parent=pool.base_dir)` go with it."""

    def __init__(self, size: int = DEFAULT_SIZE, python: str | None = None,
                 preload: tuple[str, ...] = DEFAULT_PRELOAD, direct: bool = True) -> None:
        """`size` idle supervisors (and as many idle direct workers); `preload`: stdlib modules imported in the
        template; `direct`: default `run` jobs get a direct worker (one process per run, no supervisor) where the
        zygote can fork them, i.e. as root (`DirectLease`)."""
        if size < 1:
            raise ValueError("SandboxPool size must be >= 1 (use pool=False for cold starts)")
        if not all(m.replace(".", "").replace("_", "").isalnum() for m in preload):
            raise ValueError(f"SandboxPool preload must be module names, got {preload!r}")
        self.size = size
        self.preload = tuple(preload)
        self.python = python or sys.executable
        self.direct = direct
        cleanup.sweep_once(tempfile.gettempdir())  # what a killed trainer's pool left (its trash; see cleanup)
        self.base_dir = tempfile.mkdtemp(prefix="rlf_pool_")
        os.chmod(self.base_dir, 0o711)  # run uids traverse to their own work dir, list nothing
        # as root: work dirs mounted here (their quota, `quota`) reach the zygote's namespace and its forks'
        quota.share(self.base_dir)
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()  # a forked copy of this process must not talk on our control socket
        self._proc: subprocess.Popen[bytes] | None = None
        self._ctrl: socket.socket | None = None
        self._finalizer: weakref.finalize | None = None  # type: ignore[type-arg]
        # removes base_dir even if the zygote never starts
        self._dir_finalizer = weakref.finalize(self, _remove_dir, self.base_dir, os.getpid())

    @property
    def closed(self) -> bool:
        """close() was called: runs asked of it take the cold path, and its base dir is gone."""
        return self._closed

    @property
    def zygote_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen(
                [self.python, "-I", SUPERVISOR, "--zygote", str(self.size), self.base_dir, ",".join(self.preload)],
                stdin=theirs.fileno(), stdout=subprocess.DEVNULL, cwd="/", start_new_session=True, close_fds=True,
                env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8"},
            )
        except OSError as e:
            ours.close()
            raise PoolUnavailable(f"could not start the sandbox zygote with {self.python}: {e}") from e
        finally:
            theirs.close()
        ours.settimeout(_REPLY_TIMEOUT_S)
        self._proc, self._ctrl = proc, ours
        self._finalizer = weakref.finalize(self, _shutdown, proc, ours, self.base_dir, self._pid)

    def _stop_zygote(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._proc is not None and self._ctrl is not None:
            # a broken zygote: kill it, keep base_dir (live episodes' dirs are in it)
            self._ctrl.close()
            self._proc.kill()
            self._proc.wait(timeout=5)
        self._proc = self._ctrl = self._finalizer = None

    def lease(self, confined: bool = True) -> Lease:
        """Take a supervisor (blocking, bounded): `confined`, an idle one that already entered the namespaces
        every default run gets (pid, mount, ipc, uts, net; a user namespace as non-root), for a job with
        `namespaces=True, network=False`; else one forked for the job, which enters what its limits ask for.
        Starts the zygote on first use and restarts a dead one. Raises PoolUnavailable when it cannot."""
        pid, fds = self._request(CONFINED if confined else PLAIN, 3)
        return Lease(pid=pid, job_fd=fds[0], err_fd=fds[1], pidfd=fds[2])

    def lease_direct(self) -> DirectLease | None:
        """Take an idle direct worker for a default `run` job (namespaces on, network off), or None where the
        zygote has none (not root, or it could not create pid namespaces): lease a supervisor then."""
        if not self.direct:
            return None
        pid, fds = self._request(DIRECT, 5)
        if not pid:
            self.direct = False
            return None
        return DirectLease(pid=pid, job_fd=fds[0], out_fd=fds[1], err_fd=fds[2], status_fd=fds[3], pidfd=fds[4])

    def _request(self, kind: bytes, nfds: int) -> tuple[int, list[int]]:
        """One lease request to the zygote: the pid it answered (0: none of that kind) and `nfds` descriptors."""
        with self._lock:
            if self._closed:
                raise PoolUnavailable("the sandbox pool is closed")
            if os.getpid() != self._pid:
                raise PoolUnavailable("this sandbox pool belongs to the process that made it (this is a fork of it)")
            for attempt in range(2):
                if self._proc is None or self._proc.poll() is not None:
                    self._stop_zygote()
                    self._start()
                assert self._ctrl is not None
                try:
                    self._ctrl.send(kind)
                    msg, anc, _, _ = self._ctrl.recvmsg(16, socket.CMSG_SPACE(nfds * 4))
                except OSError as e:
                    log.warning("sandbox pool: the zygote did not answer (%s); restarting it", e)
                    self._stop_zygote()
                    if attempt:
                        raise PoolUnavailable(f"the sandbox zygote did not answer: {e}") from e
                    continue
                fds = [fd for level, kind_, data in anc if level == socket.SOL_SOCKET and kind_ == socket.SCM_RIGHTS
                       for fd in struct.unpack(f"{len(data) // 4}i", data[: len(data) - len(data) % 4])]
                if msg == b"\0\0\0\0" and not fds:
                    return 0, []
                if len(msg) != 4 or len(fds) != nfds:
                    for fd in fds:
                        os.close(fd)
                    self._stop_zygote()
                    if attempt:
                        raise PoolUnavailable("the sandbox zygote sent a malformed reply")
                    continue
                (pid,) = struct.unpack("!i", msg)
                return pid, fds
            raise PoolUnavailable("unreachable")

    def close(self) -> None:
        """Kill the zygote and every supervisor it forked (idle or running), remove `base_dir`."""
        with self._lock:
            self._closed = True
            if self._finalizer is not None:
                self._finalizer()
            self._proc = self._ctrl = self._finalizer = None
            self._dir_finalizer()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_default: SandboxPool | None = None
_default_lock = threading.Lock()


def default_pool() -> SandboxPool | None:
    """The process-wide pool (started on first use; closed at exit), or None when `RLF_SANDBOX_POOL=0`.
    `RLF_SANDBOX_POOL=N` sets its number of idle supervisors (default 4); `RLF_SANDBOX_DIRECT=0` keeps every
    run supervised (no direct workers, see `SandboxPool`)."""
    global _default
    raw = os.environ.get("RLF_SANDBOX_POOL", str(DEFAULT_SIZE)).strip()
    try:
        size = int(raw)
    except ValueError:
        raise ValueError(f"RLF_SANDBOX_POOL must be an integer (0 turns the pool off), got {raw!r}") from None
    if size <= 0:
        return None
    with _default_lock:
        if _default is None or _default._closed or _default._pid != os.getpid():  # new after close or fork
            _default = SandboxPool(size, direct=os.environ.get("RLF_SANDBOX_DIRECT", "1").strip() != "0")
        return _default
