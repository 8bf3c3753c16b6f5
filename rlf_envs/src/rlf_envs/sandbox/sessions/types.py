"""The session protocol: what every backend (local, docker, a hosted provider's plugin) implements.

A `Session` is one isolated workspace for one episode, alive across tool calls: `exec`, `read_file`, `write_file`,
`diff` (against the start), `close`. A `SessionBackend` creates sessions from a `SessionSpec`. Errors are typed: a
`SessionError` is the caller's (a missing file, a session used after close, its wall clock spent); a
`SessionInfraError` is the host's or the engine's (could not start, died from the outside, engine lost) and turns an
episode into an infrastructure failure instead of a reward.
"""

from __future__ import annotations

import abc
import asyncio
import os
import posixpath
import time
from dataclasses import dataclass, field
from types import TracebackType

from rlf_envs.errors import RlfError


class SessionError(RlfError):
    """A session call failed for a reason of the caller's or the session's own (not the host's)."""


class SessionInfraError(SessionError):
    """The host or the container engine failed: the session could not start, died from the host's side, or its
    engine was lost. Not the policy's fault: envs mark the episode as infrastructure-failed (no reward) and the
    trainer drops it from the loss."""


class SessionFileNotFound(SessionError, FileNotFoundError):
    """`read_file` (or a `cwd`) named a path that does not exist in the session."""


class SessionClosed(SessionError):
    """The session was closed (or expired) before this call."""


class SessionExpired(SessionClosed):
    """The session ran past its wall clock (`SessionLimits.session_timeout_s`): the episode's own failure (the policy
    took too long), never an infrastructure failure."""


class SessionLimitExceeded(SessionError):
    """What the session's own processes did exhausted one of its limits (memory, disk, pids, output) so that the call
    could not complete, or the session died of it: the episode's failure, not the host's. `limit` names which."""

    def __init__(self, message: str, limit: str = "resources") -> None:
        super().__init__(message)
        self.limit = limit


class SessionDiffTooLarge(SessionLimitExceeded):
    """`diff(max_bytes=...)`: the workspace's patch is larger than the caller accepts (the policy's failure)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "diff_bytes")


@dataclass(frozen=True)
class SessionLimits:
    """Per-session limits. `memory_mb`: a memory cgroup per session where the host offers one (cgroup v2, or v1's
    memory controller, as root), else RLIMIT_AS per process. `pids`: processes of the session (a pids cgroup, or
    RLIMIT_NPROC of the session's own uid). `disk_mb`: every writable place of the session together (local: one tmpfs
    of that size holds the workspace, /tmp, /var/tmp, /dev/shm and the overlay's upper layer), and each file's
    RLIMIT_FSIZE. `exec_timeout_s`: the default deadline of one exec; `session_timeout_s`: the session's wall
    clock, after which it is killed. `output_bytes`: the cap of each of stdout and stderr of one exec."""

    memory_mb: int = 1024
    pids: int = 256
    disk_mb: int = 1024
    exec_timeout_s: float = 60.0
    session_timeout_s: float = 1800.0
    output_bytes: int = 65536
    #: the largest patch `diff()` returns (larger: SessionDiffTooLarge, the policy's failure)
    diff_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for name in ("memory_mb", "pids", "disk_mb", "output_bytes", "diff_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"SessionLimits.{name} must be a positive int, got {v!r}")
        for name in ("exec_timeout_s", "session_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"SessionLimits.{name} must be a positive number of seconds, got {v!r}")


@dataclass(frozen=True)
class SessionSpec:
    """What a session starts from. `image`: "host" (the host's /usr, /bin, /lib* read-only; local backend), a
    directory holding a root filesystem, "oci-archive:/path/img.tar" (unpacked once into a cache keyed by its
    digest), or "docker:<ref>" (docker backend: an image the engine holds). `seed_dir`: a host directory copied into
    `workdir` at start; `diff()` is against it (it must not change while sessions use it)."""

    image: str = "host"
    workdir: str = "/workspace"
    seed_dir: str | None = None
    env: dict[str, str] = field(default_factory=lambda: {"LANG": "C.UTF-8"})
    network: bool = False
    limits: SessionLimits = field(default_factory=SessionLimits)
    #: image sessions: the session user may create files and directories anywhere in the root (/logs, /tests,
    #: /usr/local/bin...), as a Dockerfile's RUN steps and Harbor's verifiers expect. Local backend: every
    #: directory of the overlay becomes sticky and world-writable in the session's own upper layer (new entries,
    #: not the image's files; nothing reaches the image or another session). Docker: the container's root already is.
    writable_root: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.image, str) or not self.image:
            raise ValueError("SessionSpec.image must be 'host', a root directory, 'oci-archive:PATH' or "
                             "'docker:REF'")
        if not self.workdir.startswith("/") or posixpath.normpath(self.workdir) in ("/", "//") \
                or ".." in self.workdir.split("/"):
            raise ValueError(f"SessionSpec.workdir must be an absolute path other than '/', got {self.workdir!r}")
        top = posixpath.normpath(self.workdir).lstrip("/").split("/")[0]
        if top in ("proc", "dev", "sys", ".rlf"):
            raise ValueError(f"SessionSpec.workdir {self.workdir!r} is under /{top}, which the session's root keeps "
                             "for itself; use a directory such as /workspace or /testbed")
        if self.writable_root and self.image == "host":
            raise ValueError("SessionSpec.writable_root needs an image (a root directory, 'oci-archive:PATH' or "
                             "'docker:REF'): the host's system directories stay read-only")
        if self.seed_dir is not None and not os.path.isdir(self.seed_dir):
            raise ValueError(f"SessionSpec.seed_dir {self.seed_dir!r} is not a directory")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ValueError("SessionSpec.env must map str to str")


@dataclass(frozen=True)
class ExecResult:
    """One exec's outcome. `exit_code` is 124 when `timed_out` (everything the call started was killed at its
    deadline); a command killed by a signal gives 128 + the signal. `stdout`/`stderr` are decoded as UTF-8 with
    replacement and each capped at the session's `output_bytes` (`truncated` then True)."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class Session(abc.ABC):
    """One live workspace. Calls are serialised per session; `close()`/`aclose()` are idempotent and never raise."""

    id: str
    spec: SessionSpec

    @abc.abstractmethod
    async def exec(self, cmd: str | list[str], *, stdin: str | bytes | None = None, timeout_s: float | None = None,
                   cwd: str | None = None, env: dict[str, str] | None = None) -> ExecResult:
        """Run `cmd` (a str runs under `bash -lc`, falling back to `sh -c` where the image has no bash; a list is an
        argv) in the workspace (or `cwd`), with `stdin`, killed with everything it started at `timeout_s` (default:
        the spec's `exec_timeout_s`)."""

    @abc.abstractmethod
    async def read_file(self, path: str) -> bytes:
        """A file's bytes (paths relative to the workdir unless absolute inside the session)."""

    @abc.abstractmethod
    async def write_file(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        """Create or replace a file (parent directories made), owned by the session's user."""

    @abc.abstractmethod
    async def diff(self, max_bytes: int | None = None) -> str:
        """A git-format patch (`git apply` takes it) of the workdir against its start (the seed), `.git` excluded.
        Larger than `max_bytes` (default `SessionLimits.diff_bytes`): SessionDiffTooLarge, before the patch is
        built in full or sent."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Kill everything in the session and free what it held. Idempotent, never raises."""

    async def close(self) -> None:
        await self.aclose()

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


class CreateRate:
    """The backends' create rate limit: a token bucket of `per_s` creates a second with a burst of `burst`
    (`per_s` <= 0: no limit). `wait` returns when the next create may start."""

    def __init__(self, per_s: float, burst: int) -> None:
        self.per_s = per_s
        self.burst = burst
        self._t = 0.0

    async def wait(self) -> None:
        if self.per_s <= 0:
            return
        now = time.monotonic()
        step = 1.0 / self.per_s
        self._t = max(self._t, now - self.burst * step) + step
        if self._t > now:
            await asyncio.sleep(self._t - now)


class SessionBackend(abc.ABC):
    """Creates sessions. What a hosted provider's plugin implements: `create` (start a session for the spec, label it
    with `owner`, raise SessionInfraError when the provider fails), the `Session` methods, `reap` (remove sessions
    whose owner is gone) and `aclose`."""

    name: str = "?"

    @abc.abstractmethod
    async def create(self, spec: SessionSpec) -> Session:
        """A new session for `spec` (queued while too many are starting; raises SessionInfraError on host failure)."""

    @abc.abstractmethod
    def reap(self) -> int:
        """Remove the sessions whose owner process is gone; returns how many were removed."""

    def check_image(self, image: str) -> None:
        """Raise ValueError (saying how to fix it) when this backend cannot start sessions of `image`, before any
        episode runs (a misconfigured host is refused, not scored); SessionInfraError when the engine cannot be
        asked. The default accepts every image."""
        return None

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close every session this backend opened and stop its pools and timers. Idempotent."""

    async def __aenter__(self) -> SessionBackend:
        return self

    async def __aexit__(self, *a: object) -> None:
        await self.aclose()
