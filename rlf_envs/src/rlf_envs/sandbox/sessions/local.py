"""The local backend: one confined process tree per session (namespaces + a root of its own, no daemon). See
`_agent.py` for the tree, docs/sessions.md for the limits and docs/security.md for the threat model.

What this side holds to (docs/security.md, "Local backend confinement"): a request's arguments are checked before
anything is sent (a bad path, mode or type is a SessionError, never an infrastructure failure); data travels as raw
bytes after a frame's JSON header, each reply's bytes bounded by what its call may return (a file, an exec's capped
output, a patch of at most `max_bytes`), so nothing the policy writes can inflate a frame past its limit; an agent
lost during a call in which the session's own cgroup hit its memory or pids limit is a SessionLimitExceeded (the
policy's failure), otherwise a SessionInfraError; a session past its wall clock raises SessionExpired. The agents
start with an empty environment (nothing of the trainer's reaches a session).

`LocalBackend(pool_size=2, max_starting=8, creates_per_s=50, recycle=None, max_idle=256)`: a warm pool per (image,
network) of agents that are already in their namespaces with the image's root built (a create then only makes the
workspace and copies the seed); at most `max_starting` sessions start at once and creates are rate-limited (a token
bucket), so hundreds of concurrent episodes queue instead of timing out. A closed session's agent is recycled
(`LocalBackend._recycle`): pid 1 of the session kills every other process, takes a new IPC namespace and replaces
every place the session could write (`_agent.reset`), the trainer checks the session's cgroup holds nothing but the
agent, and the agent waits idle for the next session of its key -- so a training run's later steps cost no namespace,
cgroup or process start. Every session is labelled with its owner before any wait (`owners.py`); the reaper runs at
start-up and every `reap_every_s`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import random
import signal
import socket
import struct
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any, TypeVar

from rlf_envs.sandbox import _cgroup
from rlf_envs.sandbox._base import check_path, open_tree_clone
from rlf_envs.sandbox.sessions import images, owners
from rlf_envs.sandbox.sessions.lifecycle import PooledBackend, WarmPool
from rlf_envs.sandbox.sessions.types import (
    ExecResult,
    Session,
    SessionClosed,
    SessionDiffTooLarge,
    SessionError,
    SessionExpired,
    SessionFileNotFound,
    SessionInfraError,
    SessionLimitExceeded,
    SessionLimits,
    SessionSpec,
)

log = logging.getLogger(__name__)

AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_agent.py")
#: the session uids: one per session, from this range (so RLIMIT_NPROC counts one session's processes)
UID_BASE, UID_SPAN = 2_000_000_000, 100_000_000
#: extra seconds an agent may take to answer beyond a call's own deadline before it counts as lost
GRACE_S = 30.0
START_TIMEOUT_S = 60.0
#: the largest JSON header of a frame (a reply's data follows it as raw bytes, bounded per call: `_Agent.recv`)
MAX_FRAME = 16 << 20
#: the largest file `read_file` returns (the agent's own bound) and the largest stdin of an exec
MAX_FILE = 64 << 20

#: how old the cgroup's limit counters an agent call compares with may be (reading them costs ~0.3 ms)
COUNTERS_EVERY_S = 1.0
#: recycling: how many sessions one agent serves at most, how long a reset may take, and how long a recycled agent
#: may stay idle (beyond the pool's own size) before the reaper round ends it
RECYCLE_USES = 200
RESET_TIMEOUT_S = 30.0
RECYCLED_IDLE_S = 300.0

T = TypeVar("T")


async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a thread, or here where the default executor takes no more work (interpreter exit: the
    runtime's closers run after the executors shut down)."""
    try:
        return await asyncio.to_thread(fn, *args)
    except RuntimeError:
        return fn(*args)


def _check_path(path: Any, what: str = "path") -> str:
    """A path argument (`_base.check_path`); SessionError otherwise (the caller's error, raised before anything is
    sent)."""
    return check_path(path, what, SessionError)


def _data(data: Any, what: str) -> bytes:
    if isinstance(data, str):
        try:
            return data.encode()
        except UnicodeEncodeError:
            raise SessionError(f"{what} is not encodable as UTF-8 (a lone surrogate)") from None
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise SessionError(f"{what} must be str or bytes, got {type(data).__name__}")


def _limit_counters(dirs: list[str] | None) -> dict[str, int]:
    """The session cgroup's counts of its limits being hit: memory (v2 memory.events max/oom/oom_kill; v1
    memory.failcnt and memory.oom_control's oom_kill) and pids (pids.events max), keyed "<limit>.<count>"."""
    out: dict[str, int] = {}
    for d in dirs or ():
        for name, limit in (("memory.events", "memory"), ("memory.oom_control", "memory"), ("pids.events", "pids")):
            with contextlib.suppress(OSError, ValueError), open(os.path.join(d, name)) as f:
                for line in f:
                    k, _, v = line.partition(" ")
                    if k in ("max", "oom", "oom_kill"):
                        out[f"{limit}.{k}"] = out.get(f"{limit}.{k}", 0) + int(v)
        with contextlib.suppress(OSError, ValueError), open(os.path.join(d, "memory.failcnt")) as f:
            out["memory.failcnt"] = int(f.read())
    return out


_warned_cgroup = False


def session_memory_bytes(limits: SessionLimits) -> int:
    """The session cgroup's memory limit: memory_mb + disk_mb + 64 MB -- the workspace and /tmp are tmpfs, whose pages
    the kernel charges to the cgroup of the process that wrote them, and the agent itself lives there too."""
    return (limits.memory_mb + limits.disk_mb + 64) << 20


def _session_cgroup(sid: str) -> list[str] | None:
    """The session's cgroup (`sandbox._cgroup`: memory, and pids where the host has the controller; the pids limit is
    pids + 8, for the agent and its kill helpers), or None where the host has none for us (said once): memory and
    processes are then bounded by RLIMIT_AS per process and RLIMIT_NPROC of the session's own uid."""
    global _warned_cgroup
    if os.geteuid() != 0 or os.environ.get("RLF_SESSION_CGROUPS", "1") == "0":
        return None
    dirs = _cgroup.make_cgroup(_cgroup.SESSION_PREFIX + sid)
    if isinstance(dirs, list):
        return dirs
    if not _warned_cgroup:
        _warned_cgroup = True
        log.warning("sessions: %s; memory and pids are bounded by rlimits per process / per uid instead", dirs)
    return None


#: how long a closing session waits for its cgroup to empty before leaving it (and its label) to the reaper
CGROUP_GONE_S = 20.0


class _Agent:
    """One spawned agent process (P, and C = pid 1 of its session), talking frames on its stdin/stdout."""

    def __init__(self, proc: _AgentProc, label: owners.Label, key: tuple[str, bool]) -> None:
        self.proc = proc
        self.label = label
        self.key = key
        self.dead = False
        self.cgroup: list[str] | None = None  # its cgroup's directories (`_session_cgroup`)
        self.how = ""  # how its root was made and entered (the agent's words)
        self._cleanup: asyncio.Task[None] | None = None
        self._counters: dict[str, int] = {}  # the cgroup's limit counters (`_limit_counters`) and when they were read
        self._counters_at = -1e9
        self.uses = 0  # sessions started on this agent (the n-th one's id and label: `<first_id>-<n>`)
        self.first_id = label.id
        self.limits: tuple[int, int] | None = None  # the memory and pids limits its cgroup has
        self.busy = False  # a request sent whose reply is not read yet (a call cancelled midway leaves it set)
        self.recyclable = False  # its root can be rebuilt for another session (the agent's start reply says)
        self.idle_since = time.monotonic()

    async def send(self, obj: dict[str, Any], blob: bytes | None = None, fd: int | None = None) -> None:
        """A request frame; `fd` (a descriptor) follows it as one byte with SCM_RIGHTS, once every byte before it
        is on the socket (the agent reads it with recvmsg: `_agent._seed_fd`)."""
        assert self.proc.stdin is not None
        if blob:
            obj = dict(obj, blob=len(blob))
        body = json.dumps(obj).encode()
        self.proc.stdin.write(struct.pack(">I", len(body)) + body)
        if blob:
            self.proc.stdin.write(blob)
        await self.proc.stdin.drain()
        if fd is not None:
            await self.proc.send_fd(fd)

    async def recv(self, max_blob: int = 0) -> tuple[dict[str, Any], bytes]:
        """A reply and the raw bytes after it, which may be at most `max_blob` (what the call can return: more is
        the agent's fault, never the policy's)."""
        assert self.proc.stdout is not None
        head = await self.proc.stdout.readexactly(4)
        (n,) = struct.unpack(">I", head)
        if n > MAX_FRAME:
            raise SessionInfraError(f"session agent sent a {n}-byte frame header")
        reply: dict[str, Any] = json.loads(await self.proc.stdout.readexactly(n))
        size = reply.get("blob", 0)
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= max_blob:
            raise SessionInfraError(f"session agent sent {size!r} bytes of data for a call that returns at most "
                                    f"{max_blob}")
        data = await self.proc.stdout.readexactly(size) if size else b""
        return reply, data

    async def call(self, obj: dict[str, Any], timeout_s: float, blob: bytes | None = None,
                   max_blob: int = 0, fd: int | None = None) -> tuple[dict[str, Any], bytes]:
        """One request and its reply, with a deadline. A lost agent is killed and raises SessionLimitExceeded when the
        session's cgroup hit its memory or pids limit during the call (the policy's processes pressed it there),
        else SessionInfraError."""
        if self.cgroup and time.monotonic() - self._counters_at > COUNTERS_EVERY_S:
            self._counters, self._counters_at = _limit_counters(self.cgroup), time.monotonic()
        before = self._counters
        self.busy = True
        try:
            async with asyncio.timeout(timeout_s):  # (no task per call, unlike wait_for)
                await self.send(obj, blob, fd)
            async with asyncio.timeout(timeout_s):
                got = await self.recv(max_blob)
            self.busy = False
            return got
        except TimeoutError:
            hit = self._limit_hit(before)
            self.kill()
            if hit:
                raise SessionLimitExceeded(f"session agent did not answer {obj.get('op')!r} within {timeout_s:.0f} s "
                                           f"while the session was at its {hit} limit; the session was killed",
                                           hit) from None
            raise SessionInfraError(f"session agent did not answer {obj.get('op')!r} within {timeout_s:.0f} s "
                                    "(host overloaded?); the session was killed") from None
        except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError) as e:
            hit = self._limit_hit(before)
            self.kill()
            if hit:
                raise SessionLimitExceeded(f"session agent lost during {obj.get('op')!r} while the session was at its "
                                           f"{hit} limit", hit) from None
            raise SessionInfraError(f"session agent died during {obj.get('op')!r}: {e!r}") from None

    def _limit_hit(self, before: dict[str, int]) -> str | None:
        """Which of the session's own limits (memory, pids) its cgroup hit since `before` (read at most
        COUNTERS_EVERY_S before the call began), if any."""
        if not self.cgroup:
            return None
        after = _limit_counters(self.cgroup)
        for limit in ("memory", "pids"):
            if any(v > before.get(k, 0) for k, v in after.items() if k.startswith(limit + ".")):
                return limit
        return None

    def kill(self) -> None:
        """SIGKILL both agent processes (C, pid 1 of the session: its death kills the session), then, once they are
        gone, remove the session's cgroups and its label (`wait_dead` waits for that)."""
        if self.dead:
            return
        self.dead = True
        c = self.label.procs[0] if len(self.label.procs) >= 2 else None
        if c is not None and owners.alive(*c):
            with contextlib.suppress(ProcessLookupError):
                os.kill(c[0], signal.SIGKILL)  # P reaps the session's processes, then exits (`_finish`)
        else:
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
        try:
            self._cleanup = asyncio.get_running_loop().create_task(self._finish())
        except RuntimeError:  # no loop (interpreter exit): best effort now, the reaper does the rest
            if _cgroup.remove_cgroups(self.label.cgroups, 0.5, kill=True):
                self.label.remove()

    async def _finish(self) -> None:
        try:
            await asyncio.wait_for(self.proc.wait(), 15)
        except TimeoutError:  # P did not end by itself: kill it
            owners.kill_label(self.label)
            with contextlib.suppress(asyncio.TimeoutError):
                self.proc.kill()
                await asyncio.wait_for(self.proc.wait(), 5)
        self.proc.close()  # its socket and pidfd, now, on this loop (not at GC, maybe later)
        # the session's last processes may take seconds to leave their cgroup on a loaded host (the kernel frees their
        # memory and tmpfs pages first): wait for them here, bounded, rather than leave a label of a live owner behind
        if await _off_loop(_cgroup.remove_cgroups, self.label.cgroups, CGROUP_GONE_S, True):
            self.label.remove()  # else: left for the reaper (the label names the busy cgroup)

    async def wait_dead(self) -> None:
        if self._cleanup is not None:
            with contextlib.suppress(Exception):
                await self._cleanup


class _AgentProc:
    """An agent P as the backend sees it: its socket (frames both ways, as asyncio streams) and a pidfd (P is Z's
    child, not ours: the pidfd says when it exits and signals exactly it, never a reused pid)."""

    def __init__(self, pid: int, pidfd: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 sock: socket.socket | None = None) -> None:
        self.pid = pid
        self.sock = sock  # the socket under the streams (for `send_fd`)
        self.stdin = writer
        self.stdout = reader
        self.returncode: int | None = None  # -1 once P has exited (its status is Z's: we only learn that it ended)
        self._pidfd = pidfd
        self._loop = asyncio.get_running_loop()
        self._exited = self._loop.create_future()
        self._loop.add_reader(pidfd, self._on_exit)

    def _on_exit(self) -> None:
        self._loop.remove_reader(self._pidfd)
        self.returncode = -1
        if not self._exited.done():
            self._exited.set_result(None)

    async def send_fd(self, fd: int) -> None:
        """One byte carrying `fd` (SCM_RIGHTS), sent on the socket itself once the stream's buffer is empty (so it
        follows every byte written before it)."""
        assert self.sock is not None
        while self.stdin.transport.get_write_buffer_size():
            await asyncio.sleep(0.001)
        while True:
            try:
                socket.send_fds(self.sock, [b"\0"], [fd])
                return
            except BlockingIOError:  # (the agent's receive buffer is full: it reads the frame first)
                await asyncio.sleep(0.001)

    def kill(self) -> None:
        if self.returncode is None and self._pidfd >= 0:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    async def wait(self) -> int:
        await asyncio.shield(self._exited)
        return -1

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stdin.close()
        if self._pidfd >= 0:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Zygote:
    """The backend's agent forker (Z in `_agent.py`): started on the first spawn, asked for one P at a time, closed
    with the backend (after its agents, which die with it). If it dies, the next spawn starts a new one."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.ctl: socket.socket | None = None
        self._lock = asyncio.Lock()

    async def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # an empty environment: nothing of the trainer's (tokens, keys) is in Z or in the agents it forks, whose
            # file requests run with the session user's rights in their own process
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", AGENT, "--zygote", stdin=theirs.fileno(), stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL, start_new_session=True, env={})
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self.ctl = ours

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and self.ctl is not None

    async def spawn(self, network: bool) -> _AgentProc:
        loop = asyncio.get_running_loop()
        async with self._lock:
            if not self.alive():
                self.close_now()
                await self._start()
            ctl = self.ctl
            assert ctl is not None
            try:
                await loop.sock_sendall(ctl, json.dumps({"network": network}).encode())
                got = loop.create_future()
                loop.add_reader(ctl.fileno(), _settle, got)
                try:
                    await asyncio.wait_for(got, START_TIMEOUT_S)
                finally:
                    loop.remove_reader(ctl.fileno())
                msg, fds, _flags, _addr = socket.recv_fds(ctl, 4096, 2)
            except (OSError, TimeoutError) as e:
                self.close_now()
                raise SessionInfraError(f"session agent forker failed ({e!r}); is this root?") from None
        if not msg or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            self.close_now()
            raise SessionInfraError(f"session agent forker gave no agent ({msg[:200]!r})")
        reply = json.loads(msg)
        sock = socket.socket(fileno=fds[0])
        try:
            reader, writer = await asyncio.open_unix_connection(sock=sock)
        except BaseException:
            sock.close()
            os.close(fds[1])
            raise
        return _AgentProc(int(reply["pid"]), fds[1], reader, writer, sock)

    def close_now(self) -> None:
        """Close our end: Z reads EOF and exits (every agent it forked dies with it)."""
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None

    async def aclose(self) -> None:
        self.close_now()
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)  # not proc.kill(): its poll would race asyncio's watcher
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 5)


async def _spawn(zygote: _Zygote, key: tuple[str, bool], root_mount: str, disk_mb: int,
                 made: set[str] | None = None) -> _Agent:
    """Start an agent for (image root, network) and have it build the image's root; labelled before any wait."""
    image, network = key
    label = owners.Label.new("loc-" + uuid.uuid4().hex[:16])
    label.save()
    if made is not None:  # the backend's record of every label it made (`LocalBackend.aclose` sweeps what is left)
        made.add(label.id)
    proc = None
    try:
        proc = await zygote.spawn(network)
        label.procs.append((proc.pid, owners.start_time(proc.pid)))
        label.save()
        agent = _Agent(proc, label, key)
        try:
            first, _ = await asyncio.wait_for(agent.recv(), START_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError) as e:
            agent.kill()
            raise SessionInfraError(f"session agent did not start ({e!r}); is this root or a host allowing user "
                                    "namespaces?") from None
        c = int(first["pid"])
        label.procs.insert(0, (c, owners.start_time(c)))
        cg = _session_cgroup(label.id)
        if cg is not None:
            label.cgroups = cg
        label.save()  # (before the cgroup holds anything: a reaper always knows what to remove)
        if cg is not None:
            try:
                _cgroup.enter_cgroup(cg, c)
                agent.cgroup = cg
            except OSError as e:
                log.warning("sessions: could not move the agent into its cgroup (%s): rlimits only", e)
        reply, _ = await agent.call({"op": "prepare", "image": image, "root_mount": root_mount,
                                     "disk_mb": disk_mb}, START_TIMEOUT_S)
        if not reply.get("ok"):
            agent.kill()
            raise SessionInfraError(f"session root: {reply.get('error')}")
        agent.how = str(reply.get("how", ""))
        return agent
    except BaseException:
        if proc is not None:
            proc.kill()
            proc.close()
        owners.kill_label(label)
        if _cgroup.remove_cgroups(label.cgroups, 0.5, kill=True):
            label.remove()
        raise


class LocalSession(Session):
    """A session served by one confined agent process (see `_agent.py`): calls are frames to it, serialised by a lock,
    each with a deadline at our layer; the wall clock kills it. Errors say whose they are: the caller's
    (`SessionError`), the policy's own limits (`SessionLimitExceeded`, `SessionExpired`), or the host's
    (`SessionInfraError`, decided by the session cgroup's counters when the agent is lost)."""

    def __init__(self, backend: LocalBackend, agent: _Agent, spec: SessionSpec, uid: int) -> None:
        self.id = agent.label.id
        self.spec = spec
        self.uid = uid
        self._backend = backend
        self._agent = agent
        self._lock = asyncio.Lock()
        self._closed = False
        self._expired = False
        self._deadline = time.monotonic() + spec.limits.session_timeout_s
        # the killer fires a moment after the deadline, so that a call cut to the deadline still returns its result
        self._timer = asyncio.get_running_loop().call_later(spec.limits.session_timeout_s + 1.0, self._expire)

    def _expire(self) -> None:
        self._expired = True
        self._agent.kill()

    def _check(self) -> None:
        if self._expired:
            raise SessionExpired(f"session {self.id} ran past its wall clock "
                                 f"(session_timeout_s={self.spec.limits.session_timeout_s})")
        if self._closed:
            raise SessionClosed(f"session {self.id} is closed")

    async def _call(self, req: dict[str, Any], timeout_s: float, blob: bytes | None = None,
                    max_blob: int = 0) -> tuple[dict[str, Any], bytes]:
        async with self._lock:
            self._check()
            if self._agent.dead:
                raise SessionInfraError(f"session {self.id} was killed from outside")
            try:
                reply, data = await self._agent.call(req, timeout_s, blob, max_blob)
            except SessionError:
                if self._expired:
                    raise SessionExpired(f"session {self.id} ran past its wall clock "
                                         f"(session_timeout_s={self.spec.limits.session_timeout_s})") from None
                raise
        if not reply.get("ok"):
            err = f"session {self.id}: {reply.get('error')}"
            kind = reply.get("kind")
            if kind == "infra":
                raise SessionInfraError(err)
            if kind == "limit":
                limit = str(reply.get("limit") or "resources")
                if limit == "diff_bytes":
                    raise SessionDiffTooLarge(err)
                raise SessionLimitExceeded(err, limit)
            if reply.get("errno") == 2:
                raise SessionFileNotFound(err)
            raise SessionError(err)
        return reply, data

    async def exec(self, cmd: str | list[str], *, stdin: str | bytes | None = None, timeout_s: float | None = None,
                   cwd: str | None = None, env: dict[str, str] | None = None) -> ExecResult:
        if isinstance(cmd, str):
            req: dict[str, Any] = {"op": "exec", "shell": cmd}
        elif isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd):
            req = {"op": "exec", "argv": cmd}
        else:
            raise ValueError("exec takes a shell command (str) or a non-empty argv (list of str)")
        timeout = float(timeout_s if timeout_s is not None else self.spec.limits.exec_timeout_s)
        if not timeout > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if cwd is not None:
            _check_path(cwd, "cwd")
        if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                  for k, v in env.items())):
            raise SessionError("env must map str to str")
        data = _data(stdin or b"", "stdin")
        if len(data) > MAX_FILE:
            raise SessionError(f"stdin of {len(data)} bytes (at most {MAX_FILE})")
        timeout = max(0.001, min(timeout, self._deadline - time.monotonic()))
        req.update(timeout=timeout, cwd=cwd, env=env or {})
        r, out = await self._call(req, timeout + GRACE_S, data, 2 * self.spec.limits.output_bytes)
        n = r.get("stdout", 0)
        if not isinstance(n, int) or not 0 <= n <= len(out):
            raise SessionInfraError(f"session {self.id}: a malformed exec reply")
        return ExecResult(exit_code=r["exit_code"], stdout=out[:n].decode("utf-8", "replace"),
                          stderr=out[n:].decode("utf-8", "replace"), timed_out=r["timed_out"],
                          truncated=r["truncated"], duration_s=r["duration_s"])

    async def read_file(self, path: str) -> bytes:
        _check_path(path)
        _, data = await self._call({"op": "read", "path": path}, GRACE_S + 30, max_blob=MAX_FILE)
        return data

    async def write_file(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        _check_path(path)
        if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o7777:
            raise SessionError(f"mode must be an int from 0 to 0o7777, got {mode!r}")
        raw = _data(data, "data")
        await self._call({"op": "write", "path": path, "mode": mode}, GRACE_S + 30 + len(raw) / (8 << 20), raw)

    async def diff(self, max_bytes: int | None = None) -> str:
        limit = self.spec.limits.diff_bytes if max_bytes is None else max_bytes
        if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
            raise SessionError(f"max_bytes must be a positive int, got {max_bytes!r}")
        _, data = await self._call({"op": "diff", "max_bytes": limit}, GRACE_S + self.spec.limits.exec_timeout_s,
                                   max_blob=limit)
        return data.decode("utf-8", "surrogateescape")

    async def aclose(self) -> None:
        """Every process of the session killed and its files gone: its agent reset and kept for another session
        (`LocalBackend._recycle`), or ended."""
        if self._closed:
            return
        self._closed = True
        self._timer.cancel()
        recycled = False
        try:
            recycled = await self._backend._recycle(self)
            if not recycled and not self._agent.dead:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._agent.send({"op": "close"}), 2)
        finally:
            self._backend._sessions.discard(self)
            if not recycled:
                self._agent.kill()
                with contextlib.suppress(Exception):
                    await self._agent.wait_dead()
            self._backend._uids.discard(self.uid)


class LocalBackend(PooledBackend):
    """Sessions as confined process trees on this machine, without a daemon (root needed). The shared lifecycle
    (`lifecycle.PooledBackend`: admission, create rate, reaper) with a warm pool of agents per (image, network), so
    a create only makes the workspace; owner labels and the reaper so a killed run leaves nothing."""

    name = "local"

    def __init__(self, pool_size: int | None = None, max_starting: int = 8, creates_per_s: float = 50.0,
                 reap_every_s: float = 30.0, recycle: bool | None = None, max_idle: int = 256) -> None:
        if os.geteuid() != 0:
            raise SessionInfraError("the local session backend needs root (mount namespaces, chroot, per-session "
                                    "uids); run as root or use the docker backend")
        super().__init__(max_starting=max_starting, creates_per_s=creates_per_s, reap_every_s=reap_every_s)
        self.pool_size = int(os.environ.get("RLF_SESSION_POOL", 2)) if pool_size is None else pool_size
        #: warm agents per (image root, network): started and chrooted, waiting for a session's workspace
        self.pool: WarmPool[tuple[str, bool], _Agent] = WarmPool(
            self.pool_size, usable=lambda a: a.proc.returncode is None and not a.dead, discard=_discard_agent,
            what="local session")
        self._made: set[str] = set()  # ids of the labels this backend made
        self._zygote = _Zygote()
        self._uids: set[int] = set()
        self._pid = os.getpid()
        _OPEN.add(self)
        self.root_mount = os.path.join(owners.label_dir(), ".mnt")
        os.makedirs(self.root_mount, mode=0o755, exist_ok=True)
        self.reaped_at_start = owners.reap("local")
        #: recycling (`_recycle`): a closed session's agent is reset and kept for the next session of its (image,
        #: network), up to as many idle as that key ever had open at once (at most `max_idle` in all). Needs the
        #: kernel's mount API (the seed reaches a recycled root as a detached mount): without it, off (said once)
        self.max_idle = max_idle
        if recycle is None:
            recycle = os.environ.get("RLF_SESSION_RECYCLE", "1") != "0"
        self.recycle = recycle and _mount_api(self.root_mount)
        self._peak: dict[tuple[str, bool], int] = {}  # the most sessions of each key ever open at once
        self.recycled = 0  # sessions started on a recycled agent

    def reap(self) -> int:
        return owners.reap("local")

    def check_image(self, image: str) -> None:
        images.resolve_local(image)  # ImageError (a ValueError): no such directory or archive, not a root filesystem

    async def reap_round(self) -> None:
        self.reap()
        live = {lab.id for lab in owners.labels()}
        self._made &= live  # keep only ids whose label is still there (the set stays as small as what is open)
        # recycled agents idle for long (the run's concurrency went down) go, down to the pool's own size per key
        now = time.monotonic()
        for key in list(self._peak):
            idle = self.pool.idle(key)  # (oldest first)
            old = {id(a) for a in idle[:max(0, len(idle) - self.pool_size)] if now - a.idle_since > RECYCLED_IDLE_S}
            if old:
                self.pool.prune(lambda a, old=old: id(a) in old)  # type: ignore[misc]

    def _uid(self) -> int:
        while True:
            uid = UID_BASE + random.randrange(UID_SPAN)
            if uid not in self._uids:
                self._uids.add(uid)
                return uid

    async def create(self, spec: SessionSpec) -> LocalSession:
        async with self.admit():
            root = images.resolve_local(spec.image)
            key = (root, spec.network)
            agent = self.pool.lease(key)
            self.pool.fill(key, lambda: self._spawn(key, spec.limits.disk_mb))
            if agent is not None:
                try:
                    return await self._start(agent, spec)
                except SessionInfraError as e:  # a warm agent that died while idle: start a fresh one
                    log.warning("sessions: a pooled agent failed to start a session (%s); starting a new one", e)
            await self.rate_limit()
            return await self._start(await self._spawn(key, spec.limits.disk_mb), spec)

    async def _recycle(self, s: LocalSession) -> bool:
        """Reset a closing session's agent and keep it idle for the next session of its key, where that is safe and
        wanted: the agent answered every request (none in flight), did not run past its wall clock, can rebuild its
        root, has served fewer than RECYCLE_USES sessions, and its key has fewer idle agents than it ever had open
        at once (`_room`). The agent (pid 1 of the session) kills every other process, which its cgroup must then
        confirm, and stages a root of fresh mounts; anything short of that, and the agent is ended instead."""
        a, key = s._agent, s._agent.key
        if (not self.recycle or self._closed or self.pool.closed or a.dead or a.busy or s._expired
                or s._lock.locked() or not a.recyclable or a.uses >= RECYCLE_USES or not self._room(key)):
            return False
        try:
            reply, _ = await a.call({"op": "reset", "n": a.uses}, RESET_TIMEOUT_S)
        except SessionError as e:  # (the call killed it)
            log.warning("sessions: an agent could not be reset for another session (%s); it was ended", e)
            return False
        if not reply.get("ok") or reply.get("reset") != a.uses:
            log.warning("sessions: an agent could not be reset for another session (%.300s); it is ended",
                        reply.get("error", reply))
            return False
        if a.cgroup and not _only_agent_in(a):
            log.warning("sessions: after a reset the session's cgroup still holds other processes; the agent is "
                        "ended")
            return False
        a._counters_at = -1e9  # (the next call compares with fresh counters)
        a.idle_since = time.monotonic()
        return self._room(key) and self.pool.put(key, a)  # (again: other sessions closed meanwhile)

    def _room(self, key: tuple[str, bool]) -> bool:
        """Whether another idle agent of `key` is wanted: fewer are idle than the most sessions of it ever open at
        once (or the pool's size). Past `max_idle` idle agents in all, the one idle longest (of any key: a run
        moving from image to image keeps the recent ones) is ended to make room."""
        if self.max_idle <= 0 or len(self.pool.idle(key)) >= max(self.pool_size, self._peak.get(key, 0)):
            return False
        idle = self.pool.all_idle()
        if len(idle) >= self.max_idle:
            oldest = min(idle, key=lambda a: a.idle_since)
            self.pool.prune(lambda a: a is oldest)
        return True

    def _spawn(self, key: tuple[str, bool], disk_mb: int) -> Awaitable[_Agent]:
        return _spawn(self._zygote, key, self.root_mount, disk_mb, self._made)

    async def _start(self, agent: _Agent, spec: SessionSpec) -> LocalSession:
        """Give a prepared agent its session: cgroup limits, then the workspace, seed, uid and chroot."""
        uid = self._uid()
        try:
            if agent.cgroup is not None:
                try:
                    limits = (session_memory_bytes(spec.limits), spec.limits.pids + 8)
                    if limits != agent.limits:  # (a recycled agent's cgroup keeps its last session's)
                        agent.limits = None
                        _cgroup.limit_cgroup(agent.cgroup, *limits)
                        agent.limits = limits
                except OSError as e:
                    raise SessionInfraError(f"could not set the session's cgroup limits: {e}") from None
            env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": spec.workdir,
                   "USER": "sandbox", "TERM": "dumb", **spec.env}
            req: dict[str, Any] = {"op": "start", "workdir": spec.workdir, "uid": uid, "env": env,
                                   "limits": asdict(spec.limits), "writable_root": spec.writable_root}
            seed_fd = None
            if spec.seed_dir and self.recycle:  # a detached copy of the seed's mount, which any root can attach
                try:
                    seed_fd = open_tree_clone(os.path.abspath(spec.seed_dir))
                except OSError as e:
                    raise SessionInfraError(f"session start: the seed {spec.seed_dir}: {e}") from None
                req["seed_fd"] = True
            elif spec.seed_dir:
                req["seed"] = os.path.abspath(spec.seed_dir)
            if agent.uses:  # a recycled agent: its label is renamed for this session (`<label dir>/<session id>.json`)
                self._made.discard(agent.label.id)
                self._made.add(agent.label.rename(f"{agent.first_id}-{agent.uses + 1}"))
            agent.uses += 1
            try:
                reply, _ = await agent.call(req, START_TIMEOUT_S, fd=seed_fd)
            finally:
                if seed_fd is not None:
                    os.close(seed_fd)
            if not reply.get("ok"):
                raise SessionInfraError(f"session start: {reply.get('error')}")
            agent.how = str(reply.get("how", agent.how))
            agent.recyclable = bool(reply.get("recyclable"))
            if agent.uses > 1:
                self.recycled += 1
        except BaseException:
            self.pool.drop(agent)  # killed now, its clean-up awaited by aclose
            self._uids.discard(uid)
            raise
        s = LocalSession(self, agent, spec, uid)
        self._sessions.add(s)
        n = sum(1 for o in self._sessions if isinstance(o, LocalSession) and o._agent.key == agent.key)
        self._peak[agent.key] = max(self._peak.get(agent.key, 0), n)
        return s

    async def aclose(self) -> None:
        if not await self.close_lifecycle(self.pool, START_TIMEOUT_S):
            return
        # every session and agent of this backend is closed now: a label of ours still there (an agent whose start
        # failed, a clean-up cut short on a loaded host) names only what is left to kill and remove, bounded
        made, self._made = self._made, set()
        await _off_loop(_sweep_labels, made)
        await self._zygote.aclose()
        _OPEN.discard(self)


def _only_agent_in(a: _Agent) -> bool:
    """Whether the agent's cgroup holds no process but its own two (P and C), as after a reset."""
    try:
        return _cgroup.procs(a.cgroup or []) <= {p for p, _ in a.label.procs}
    except (OSError, ValueError):
        return False


_warned_mount_api = False


def _mount_api(where: str) -> bool:
    """Whether the kernel's mount API (open_tree) works here, which recycling needs (said once when it does not)."""
    global _warned_mount_api
    try:
        os.close(open_tree_clone(where))
        return True
    except OSError as e:
        if not _warned_mount_api:
            _warned_mount_api = True
            log.warning("sessions: no open_tree here (%s): closed sessions' agents are not recycled", e)
        return False


async def _discard_agent(agent: _Agent) -> None:
    agent.kill()
    await agent.wait_dead()


#: how long the interpreter's exit may wait for an unclosed backend's cgroups to empty
EXIT_SWEEP_S = 5.0
#: the backends of this process not closed yet (held until they are, even if their owner drops them): what they made is
#: swept at interpreter exit (`_sweep_at_exit`)
_OPEN: set[LocalBackend] = set()


@atexit.register
def _sweep_at_exit() -> None:
    """At interpreter exit, a backend nobody closed still leaves nothing: its agents are killed and its labels and
    cgroups removed, bounded. Only in the process that made it (a forked child's exit never touches its parent's
    sessions), and not for a backend the runtime's closers are about to close (atexit runs this before them)."""
    runtime = sys.modules.get("rlf_envs.runtime")
    pending = list(getattr(runtime, "_closers", ())) if runtime is not None else []
    loop = getattr(runtime, "_loop", None)
    closers_run = loop is not None and not loop.is_closed() and loop.is_running()
    for b in list(_OPEN):
        if b._pid != os.getpid() or (closers_run and any(c is b for c in pending)):
            continue
        b._closed = True
        with contextlib.suppress(Exception):
            _sweep_labels(set(b._made), EXIT_SWEEP_S)


def _sweep_labels(ids: set[str], wait_s: float = CGROUP_GONE_S) -> None:
    """Kill what the labels `ids` name, then remove their cgroups and the labels, all within `wait_s` (a cgroup still
    busy then keeps its label, for the reaper)."""
    mine = [lab for lab in owners.labels() if lab.id in ids]
    for lab in mine:
        owners.kill_label(lab)
    end = time.monotonic() + wait_s
    for lab in mine:
        if _cgroup.remove_cgroups(lab.cgroups, max(0.0, end - time.monotonic()), kill=True):
            lab.remove()
