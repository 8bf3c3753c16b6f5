"""The docker backend: one container per session through the Docker Engine API (the `docker` Python SDK,
the `docker` extra, `pip install -e './rlf_envs[docker]'`; `DOCKER_HOST` honoured, so Podman's compatible socket
works too).

A session is a container of `SessionSpec.image` ("docker:<ref>", an image the engine holds) created with its owner
labels in the same API call (`rlf.session`, `rlf.owner.run`, `rlf.owner.pid`, `rlf.owner.start`, `rlf.owner.host`),
with no network (`network_mode=none`) unless asked, a memory and pids limit, docker's default capabilities minus
NET_RAW, MKNOD, AUDIT_WRITE and SETFCAP, and `AutoRemove` (the engine deletes it once it stops).

Nothing the session's code can write decides how long it lives or what a deadline kills (its commands run as the
image's user, root in most images, so they can rewrite any file of the container, /bin/sh and `timeout` included):

- Lifetime. Pid 1 is `sleep <session_timeout_s + 10 s>` (warm-pool containers: + the pool's idle cap, and the pool
  never hands out a container older than that cap), so a container ends by itself at its wall clock even when its
  owner was SIGKILLed and no reaper ever runs. Pid 1 runs as uid 65534 from an execute-only copy of the image's own
  `sleep` (`/.rlf/sleep`, mode 0111, put in before the start): signals from inside a pid namespace never reach its
  init (it has no handlers), and an execute-only binary makes the process non-dumpable, so not even the session's
  root turned uid 65534 may ptrace it or write its memory (CAP_SYS_PTRACE is not granted). Commands pass the image's
  user explicitly (`Config.User`, root where it sets none), so they run as they would under `docker exec`.
  `no-new-privileges` is set where that user is not root (where it is root, a setuid binary has nothing more to give,
  and docker would drop a root exec's capabilities under it in a container whose pid 1 is not root). The backend's
  own timer removes the container at `session_timeout_s` (+1 s) while its owner lives.
- Deadlines. `exec` runs the command itself as the exec's process (a str as `bash -lc CMD`, `sh -c` where the image
  has no bash; a list as the argv): no wrapper shell, no `timeout`, no pid file. The deadline is kept on the host:
  at the call's deadline every process of the container that the kernel says started at or after the call's start
  (`/proc/<pid>/stat` start times against CLOCK_BOOTTIME) is SIGKILLed, pid 1 aside. Where the engine is local
  (the container's pid 1 is visible in this host's /proc with the container's id in its cgroup path) they are found
  from the host side, in the container's cgroup (`cgroup.procs`; else by its pid namespace) and killed through
  pidfds, so the image's binaries are never used; elsewhere (a remote engine, no right to signal them) an exec of
  the image's `/bin/sh` does it with the shell's builtins only (`read`, `kill`, globbing: no other binary, no
  file the session wrote; its start-time bound is estimated from the call's elapsed time). The kill repeats until
  the call's output closes; if it does not within GRACE_S (something of the session holds the output open), the
  session is ended (container removed) and the call raises SessionLimitExceeded(limit="exec_deadline") when the
  engine answers a ping (the policy's doing), SessionInfraError when it does not.

Files go through put/get archive (paths validated first: a str without NUL); on a local engine (`_Host`) a plain
path is read and written, and the diff's workdir copied, by this host's kernel in pid 1's root instead (`openat2`
RESOLVE_IN_ROOT with no link or mount crossed, every name below opened O_NOFOLLOW / O_PATH, a write made under a
fresh name and renamed over), anything else going to the archive call. `diff` fetches the workdir (regular files,
dirs and links only, `.git` left out, the content and the entry count bounded, a patch larger than `max_bytes`
refused from the names alone where it can be) into a host temp dir and compares it with the seed in a child process
under a CPU limit (`gitdiff.diff_trees`, the patch counted as it is built). The
reaper removes this host's labelled containers whose owner process is gone, and the Harbor images (`rlf.image`)
whose builder is gone; `aclose` removes the images this process built (unless built with RLF_KEEP_DOCKER_IMAGES=1).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import io
import json
import logging
import math
import os
import posixpath
import signal
import socket
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from rlf_envs.sandbox import cleanup
from rlf_envs.sandbox._base import (
    RESOLVE_IN_ROOT,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    RESOLVE_NO_XDEV,
    SYS_OPENAT2,
    _openat2,
)
from rlf_envs.sandbox.sessions import gitdiff, owners
from rlf_envs.sandbox.sessions.images import inside
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
    SessionSpec,
)

log = logging.getLogger(__name__)

LABEL = "rlf.session"
#: on the images `tasks.harbor.build_docker_image` builds (with the builder's owner labels); `rlf.keep=1`: kept
IMAGE_LABEL = "rlf.image"
KEEP_LABEL = "rlf.keep"
#: on the images the backend derives (an image with pid 1 put in, `DockerBackend._image`): the image it was made from,
#: and the backend that made it (several backends of one process each close their own)
INIT_LABEL = "rlf.init-for"
INIT_BACKEND_LABEL = "rlf.init-backend"
#: how long a call may take to end after its deadline kill before the session is ended
GRACE_S = 10.0
API_TIMEOUT_S = 120
MAX_FILE = 64 << 20
#: pid 1 of every session container: an execute-only copy of the image's sleep, run as INIT_USER
INIT = "/.rlf/sleep"
INIT_USER = "65534:65534"
#: pid 1 outlives the session's wall clock by this much (the backend's own timer removes it first)
LIFETIME_MARGIN_S = 10.0
CAP_DROP = ["NET_RAW", "MKNOD", "AUDIT_WRITE", "SETFCAP"]
#: diff: the most file content it reads, and the most workspace entries beyond the seed's
DIFF_READ_BYTES = 256 << 20
DIFF_MAX_NEW_ENTRIES = 100_000
USER_HZ = 100  # /proc/<pid>/stat start times are in these ticks on every Linux the engine runs on

#: the in-container fallback of the deadline kill, shell builtins only (read, kill, globbing; no other binary, no
#: file of the session's): every process whose start time (in the kernel's ticks) is at or after $t0, pid 1 and this
#: shell aside, is SIGKILLed, in rounds until a round finds none
KILL_SCRIPT = r"""
r=0
while [ $r -lt 20 ]; do
  r=$((r + 1)); n=0
  for d in /proc/[1-9]*; do
    p=${d#/proc/}
    case $p in 1|$$) continue ;; esac
    read -r l < "$d/stat" 2>/dev/null || continue
    l=${l##*) }; set -- $l
    [ "$1" = Z ] && continue
    eval "s=\${20}"
    [ "$s" -ge "$t0" ] 2>/dev/null && kill -9 "$p" 2>/dev/null && n=$((n + 1))
  done
  [ $n = 0 ] && break
done
exit 0
"""


def _image_ref(image: str) -> str:
    if image.startswith("docker:"):
        return image.split(":", 1)[1]
    raise ValueError(f"the docker backend runs images the engine holds: 'docker:<ref>' (got {image!r}; for a root "
                     "directory or an archive use the local backend, or `docker import`/`docker load` it first)")


def _text(value: Any, what: str) -> str:
    """A str the engine can take: the caller's (the policy's) error otherwise, never the engine's."""
    if not isinstance(value, str):
        raise SessionError(f"{what} must be a str, got {type(value).__name__}")
    if "\x00" in value:
        raise SessionError(f"{what} holds a NUL byte: {value[:80]!r}")
    return value


def _container_gone(e: BaseException) -> bool:
    """A 404 of the engine that is about the container (not a path in it)."""
    return "no such container" in str(e).lower()


def _is_root(user: str) -> bool:
    return user.split(":", 1)[0] in ("", "0", "root")


def _tar_of_dir(src: str | None, uid: int = 0, gid: int = 0, under: str = "", sleep: bytes = b"") -> bytes:
    """A tar of the directory `src`'s entries (owned by uid:gid), named relative to it, or below `under` (a relative
    '/'-separated path, whose own directories get no entries); with `sleep` (an image's sleep binary), pid 1 first:
    INIT, execute-only (pid 1 is then not dumpable: no ptrace, no /proc/1/mem). b"" when there is neither."""

    def own(t: tarfile.TarInfo) -> tarfile.TarInfo:
        t.uid, t.gid, t.uname, t.gname = uid, gid, "", ""
        return t

    if not src and not sleep:
        return b""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        if sleep:
            d = tarfile.TarInfo(posixpath.dirname(INIT).lstrip("/"))
            d.type, d.mode = tarfile.DIRTYPE, 0o755
            tf.addfile(d)
            f = tarfile.TarInfo(INIT.lstrip("/"))
            f.size, f.mode = len(sleep), 0o111
            tf.addfile(f, io.BytesIO(sleep))
        if src:
            for name in sorted(os.listdir(src)):
                tf.add(os.path.join(src, name), arcname=posixpath.join(under, name) if under else name, filter=own)
    return buf.getvalue()


def _tar_of_file(name: str, data: bytes, mode: int, uid: int, gid: int, parents: bool) -> bytes:
    """A tar of one file `name` ('/'-separated, relative); with `parents`, entries for its parent directories."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        parts = name.split("/")
        for i in range(1, len(parts)) if parents else ():
            d = tarfile.TarInfo("/".join(parts[:i]))
            d.type, d.mode, d.uid, d.gid = tarfile.DIRTYPE, 0o755, uid, gid
            tf.addfile(d)
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime, info.uid, info.gid = len(data), mode & 0o7777, int(time.time()), uid, gid
        tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _children_first(images: list[Any]) -> list[Any]:
    """Images in an order the engine removes them in: the ones derived with pid 1 (`INIT_LABEL`) before the rest."""
    return sorted(images, key=lambda img: INIT_LABEL not in (img.labels or {}))


@contextlib.contextmanager
def _archive(api: Any, cid: str, path: str) -> Iterator[tuple[Iterator[bytes], dict[str, Any]]]:
    """A container path's tar stream and its stat, the response closed on the way out however far it was read: the
    engine holds the container's lock while it sends an archive, so one left unread would block every later call of
    the session (the SDK's get_archive leaves that to the garbage collector)."""
    res = api._get(api._url("/containers/{0}/archive", cid), params={"path": path}, stream=True,
                   headers={"Accept-Encoding": "identity"})
    try:
        api._raise_for_status(res)
        raw = res.headers.get("x-docker-container-path-stat")
        yield res.iter_content(1 << 20, False), (json.loads(base64.b64decode(raw)) if raw else {})
    finally:
        res.close()


def _one_file(chunks: Any, limit: int) -> tarfile.TarInfo | tuple[tarfile.TarInfo, bytes]:
    """The first member of a get_archive stream: (its header, its bytes) for a regular file, the header otherwise."""
    with tarfile.open(fileobj=io.BufferedReader(_Cap(chunks, limit + (1 << 20))), mode="r|") as tf:
        for m in tf:
            if not m.isreg():
                return m
            f = tf.extractfile(m)
            return m, (f.read() if f else b"")
    raise FileNotFoundError


class _Cap(io.RawIOBase):
    """A readable over the engine's archive stream that refuses more than `limit` bytes."""

    def __init__(self, chunks: Any, limit: int, err: type[SessionError] = SessionError) -> None:
        self.it, self.buf, self.n, self.limit, self.err = iter(chunks), b"", 0, limit, err

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
                raise self.err(f"the archive from the session is larger than {self.limit} bytes")
        k = min(len(b), len(self.buf))
        b[:k], self.buf = self.buf[:k], self.buf[k:]
        return k


# --- the host's view of a container's processes (kernel data only) --------------------------------------------------

def _boot_ticks() -> int:
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def _proc_start(pid: int, dir_fd: int | None = None) -> tuple[int, str] | None:
    """(start time in clock ticks since boot, state) of a host process, from the kernel's /proc/<pid>/stat (or
    `stat` of a /proc/<pid> descriptor `dir_fd`: that one process, whoever reuses its pid)."""
    try:
        if dir_fd is None:
            with open(f"/proc/{pid}/stat", "rb") as f:
                data = f.read()
        else:
            with open(os.open("stat", os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd), "rb") as f:
                data = f.read()
    except OSError:
        return None
    rest = data[data.rfind(b")") + 2:].split()  # after the command name, which may hold anything
    try:
        return int(rest[19]), rest[0].decode()
    except (IndexError, ValueError):
        return None


def _cgroup_dir(cgroup_file: str) -> str | None:
    """The directory (in this host's cgroup mounts) of a process's cgroup, from its /proc/<pid>/cgroup text."""
    mounts = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                a, b = left.split(), right.split()
                if len(a) >= 5 and len(b) >= 3 and b[0] in ("cgroup", "cgroup2"):
                    mounts.append((b[0], a[3], a[4], set(b[2].split(","))))
    except OSError:
        return None
    for line in cgroup_file.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        want = set(parts[1].split(",")) - {""}
        for fstype, root, point, opts in mounts:
            if (fstype == "cgroup2") != (not want) or (want and not want & opts):
                continue
            path = parts[2]
            if root != "/":
                if not (path == root or path.startswith(root.rstrip("/") + "/")):
                    continue
                path = path[len(root.rstrip("/")):]
            d = point.rstrip("/") + path
            if os.path.isfile(os.path.join(d, "cgroup.procs")):
                return d
    return None


#: how a path of the container is resolved from the host (`_Host`): in pid 1's root, crossing no link and no mount
_IN_ROOT = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV
#: the deepest directory the host-side diff copy descends to (deeper workspaces go through the archive call)
DIFF_HOST_DEPTH = 64


class _GiveUp(OSError):
    """The host-side copy cannot answer for this entry (another mount, too deep): the archive call does."""


def _identity_maps(pid: int) -> bool:
    """Whether the process's user namespace maps every uid and gid to itself (the initial namespace's maps)."""
    try:
        for kind in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{kind}") as f:
                if f.read().split() != ["0", "0", "4294967295"]:
                    return False
    except OSError:
        return False
    return True


def _write_all(fd: int, data: bytes | memoryview) -> None:
    """All of `data` to `fd` (a write may take less than it is given)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _copy_regular(fd: int, size: int, target: str, mode: int) -> None:
    """The regular file behind the O_PATH descriptor `fd` (at most `size` bytes of it: what was counted) into the
    new file `target`, with `mode`."""
    src = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(src).st_mode):
            raise OSError("not a regular file")
        out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            left = size
            while left > 0:
                chunk = os.read(src, min(left, 1 << 20))
                if not chunk:
                    break
                _write_all(out, chunk)
                left -= len(chunk)
            os.fchmod(out, mode)
        finally:
            os.close(out)
    finally:
        os.close(src)


@dataclass
class _DiffBudget:
    """What the diff may read of a workspace, counted entry by entry as it is fetched (the archive or the host-side
    copy): SessionDiffTooLarge at more file content than DIFF_READ_BYTES, more entries than the seed's +
    DIFF_MAX_NEW_ENTRIES, or new files whose patch headers alone pass `limit`."""

    seed: set[str]
    limit: int
    content: int = 0
    entries: int = 0
    least: int = 0

    def add(self, rel: str, size: int, is_dir: bool) -> None:
        self.content += size
        self.entries += 1
        if rel and not is_dir and rel not in self.seed:
            self.least += 2 * len(rel.encode("utf-8", "surrogateescape")) + 120  # its patch's headers, at least
        if self.content > DIFF_READ_BYTES:
            raise SessionDiffTooLarge(f"the workspace holds more than {DIFF_READ_BYTES} bytes of files")
        if self.entries > len(self.seed) + DIFF_MAX_NEW_ENTRIES:
            raise SessionDiffTooLarge(f"the workspace holds more than {DIFF_MAX_NEW_ENTRIES} entries beyond its "
                                      "seed's")
        if self.least > self.limit:
            raise SessionDiffTooLarge(f"the workspace's patch is larger than max_bytes={self.limit} (the headers "
                                      "of its new files alone)")


@dataclass
class _Host:
    """A local engine's container as this host's kernel sees it: pid 1's host pid, its cgroup directory (every
    process of the container is listed there, and none can leave it), its pid namespace (the listing where no cgroup
    directory is found)."""

    pid1: int
    cgroup: str | None
    pidns: int
    start: int | None = None  # pid 1's start time (boot ticks): a reused pid is never taken for it
    same_ids: bool = False  # the container's uids and gids are this host's (no user namespace remapping them)

    @classmethod
    def find(cls, cid: str, pid1: int) -> _Host | None:
        try:
            with open(f"/proc/{pid1}/cgroup") as f:
                text = f.read()
            pidns = os.stat(f"/proc/{pid1}/ns/pid").st_ino
        except OSError:
            return None
        if cid not in text:  # another machine's or another pid namespace's pid: the engine is not local
            return None
        st = _proc_start(pid1)
        return cls(pid1, _cgroup_dir(text), pidns, st[0] if st else None, _identity_maps(pid1))

    def read(self, path: str, limit: int) -> bytes | None:
        """A regular file of the container read by this host's kernel, with no engine call and no program of the
        container's: `path` resolved in pid 1's root with RESOLVE_IN_ROOT (`..` stays in it), and neither a symlink,
        a magic link nor a mount crossed on the way. None where that cannot answer (a path through a link or another
        mount, a file that is not regular, no openat2, pid 1 not the process started): the engine's archive call
        answers those as before. FileNotFoundError when a path of plain directories names nothing."""
        root = self._root()
        if root is None:
            return None
        try:
            try:
                fd = _openat2(root, "/" + path.lstrip("/"), os.O_PATH | os.O_CLOEXEC, 0, _IN_ROOT)
            except FileNotFoundError:
                raise
            except OSError:
                return None
        finally:
            os.close(root)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
                return None  # (the engine's call says what it is, or that it is too large)
            with open(f"/proc/self/fd/{fd}", "rb", buffering=0) as f:  # (reopened for reading: a regular file)
                got = f.read(limit + 1)
            return got if len(got) <= limit else None
        except OSError:
            return None
        finally:
            os.close(fd)

    def write(self, path: str, data: bytes, mode: int, uid: int, gid: int) -> bool:
        """`data` put as the regular file `path` of the container by this host's kernel, owned uid:gid with `mode`,
        as the engine's archive call would (a new inode: a hard link's other names keep the old content). The
        parent is resolved as `read` resolves a path (in pid 1's root; no symlink, magic link or mount on the way);
        the file is written under a fresh name in that directory (O_EXCL, O_NOFOLLOW) and renamed over `path`, so
        neither a link nor a name the session's code made is ever written through, and a failed write leaves
        nothing. False where this cannot answer, having changed nothing: a missing parent, a link or mount on the
        way, `path` something other than a regular file, the container's ids mapped by a user namespace, an
        error of the write itself; the engine's archive call then does it (and says what went wrong)."""
        parent, name = posixpath.split("/" + path.lstrip("/"))
        if not self.same_ids or name in ("", ".", ".."):
            return False
        root = self._root()
        if root is None:
            return False
        try:
            pfd = _openat2(root, parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0, _IN_ROOT)
        except OSError:
            return False
        finally:
            os.close(root)
        tmp = f".rlf-write-{uuid.uuid4().hex}"
        made = False
        try:
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISREG(os.stat(name, dir_fd=pfd, follow_symlinks=False).st_mode):
                    return False
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=pfd)
            made = True
            try:
                _write_all(fd, data)
                os.fchown(fd, uid, gid)
                os.fchmod(fd, mode & 0o7777)  # (after the chown, which clears set-id bits)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
            return True
        except OSError:
            if made:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=pfd)
            return False
        finally:
            os.close(pfd)

    def copy_tree(self, wd: str, dst: str, budget: _DiffBudget) -> bool:
        """The container's directory `wd` copied by this host's kernel into the new host directory `dst`, under
        the rules of the archive path (`DockerSession._fetch`): regular files (mode bits u+rw, group/other r-x at
        most), directories and symlinks (their target text, never followed), `.git` left out, every entry counted
        by `budget` (SessionDiffTooLarge on the way). `wd` is resolved as `read` resolves a path; below it every
        name is opened relative to its directory with O_NOFOLLOW, anything else than a regular file is opened
        O_PATH only (a device node or FIFO is never opened for reading here) and a regular file is read through
        that descriptor. False where this cannot answer (`wd` not a plain directory, a mount inside it, deeper
        than DIFF_HOST_DEPTH, a file that changes type or vanishes on the way): the caller then uses the archive
        call, in a fresh directory with a fresh budget."""
        root = self._root()
        if root is None:
            return False
        try:
            top = _openat2(root, "/" + wd.strip("/"), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0, _IN_ROOT)
        except OSError:
            return False
        finally:
            os.close(root)
        stack: list[tuple[int, str, str]] = [(top, "", dst)]  # (an open directory, its relative path, its copy)
        try:
            dev = os.fstat(top).st_dev
            os.mkdir(dst, 0o700)
            budget.add("", 0, True)
            while stack:
                dfd, rel, out = stack.pop()
                try:
                    with os.scandir(dfd) as entries:  # (streamed: the budget stops a huge directory as it is read)
                        for e in entries:
                            if e.name != ".git":
                                self._copy_entry(dfd, e.name, f"{rel}/{e.name}" if rel else e.name,
                                                 os.path.join(out, e.name), dev, budget, stack)
                finally:
                    os.close(dfd)
            return True
        except OSError:
            return False
        finally:
            for dfd, _, _ in stack:
                with contextlib.suppress(OSError):
                    os.close(dfd)

    @staticmethod
    def _copy_entry(dfd: int, name: str, rel: str, target: str, dev: int, budget: _DiffBudget,
                    stack: list[tuple[int, str, str]]) -> None:
        """One entry of `copy_tree`: `name` in the open directory `dfd` copied to `target` (a directory is made
        there and pushed on `stack`, opened, to be copied in its turn). _GiveUp where the copy cannot answer."""
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                if st.st_dev != dev or rel.count("/") >= DIFF_HOST_DEPTH:
                    raise _GiveUp(rel)
                budget.add(rel, 0, True)
                os.mkdir(target, 0o700)
                os.chmod(target, (st.st_mode & 0o755) | 0o700)
                stack.append((os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), rel,
                              target))
            elif stat.S_ISREG(st.st_mode):
                budget.add(rel, st.st_size, False)
                _copy_regular(fd, st.st_size, target, (st.st_mode & 0o755) | 0o600)
            elif stat.S_ISLNK(st.st_mode):
                budget.add(rel, 0, False)
                os.symlink(os.readlink(name, dir_fd=dfd), target)
        finally:
            os.close(fd)

    def _root(self) -> int | None:
        """A descriptor of pid 1's root, or None: no openat2 to resolve in it, or pid 1 is not the process started
        (the /proc descriptor names one process: if pid 1 is gone, what it reads fails, whoever reuses the pid)."""
        if self.start is None or SYS_OPENAT2 is None:
            return None
        try:
            proc = os.open(f"/proc/{self.pid1}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = _proc_start(self.pid1, proc)
            if st is None or st[0] != self.start:
                return None
            return os.open("root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=proc)
        except OSError:
            return None
        finally:
            os.close(proc)

    def pids(self) -> list[int]:
        if self.cgroup is not None:
            out: list[int] = []
            for d, _, files in os.walk(self.cgroup):
                if "cgroup.procs" in files:
                    with contextlib.suppress(OSError, ValueError), open(os.path.join(d, "cgroup.procs")) as f:
                        out += [int(x) for x in f.read().split()]
            return out
        found = []
        for p in os.listdir("/proc"):
            if p.isdigit():
                with contextlib.suppress(OSError):
                    if os.stat(f"/proc/{p}/ns/pid").st_ino == self.pidns:
                        found.append(int(p))
        return found

    def kill_since(self, t0: int) -> bool:
        """SIGKILL every process of the container started at or after boot tick `t0`, pid 1 aside, in rounds until
        a round finds none new (a fork between a listing and its kills is caught by the next). Each kill goes
        through a pidfd opened and then checked against the start time listed, so a pid reused meanwhile is never
        hit. False when some could not be signalled (no right to: the caller then kills from inside)."""
        done: set[tuple[int, int]] = set()
        ok = True
        for _ in range(64):
            new = 0
            for pid in self.pids():
                st = _proc_start(pid)
                if pid == self.pid1 or st is None or st[0] < t0 or st[1] in ("Z", "X") or (pid, st[0]) in done:
                    continue
                try:
                    fd = os.pidfd_open(pid)
                except ProcessLookupError:
                    continue  # gone already
                except OSError:  # no pidfds (a kernel before 5.3): a plain kill after the same check
                    fd = -1
                try:
                    again = _proc_start(pid)
                    if again is None or again[0] != st[0]:
                        continue
                    if fd >= 0:
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                    else:
                        os.kill(pid, signal.SIGKILL)
                    done.add((pid, st[0]))
                    new += 1
                except ProcessLookupError:
                    pass
                except PermissionError:
                    ok = False
                finally:
                    if fd >= 0:
                        os.close(fd)
            if not new:
                break
        return ok


# --- the patch, bounded --------------------------------------------------------------------------------------------

#: the diff's child: gitdiff loaded by its path into a bare interpreter (`-I -S`, an empty environment) under a CPU
#: limit, so a pathological workspace (difflib is quadratic on some inputs: 20,000 alternating lines take ~25 s of
#: CPU) costs at most that child's limit, never the trainer's CPU or its GIL
DIFF_CHILD = r"""
import importlib.util, resource, sys
cpu, path, old, new, read, patch = sys.argv[1:7]
resource.setrlimit(resource.RLIMIT_CPU, (int(cpu), int(cpu) + 1))
spec = importlib.util.spec_from_file_location("rlf_gitdiff", path)
m = importlib.util.module_from_spec(spec)
sys.modules["rlf_gitdiff"] = m
spec.loader.exec_module(m)
try:
    out = m.diff_trees(old or None, new, max_bytes=int(read), max_patch_bytes=int(patch))
except m.DiffTooLarge as e:
    sys.stderr.write(str(e))
    sys.exit(3)
except MemoryError:
    sys.stderr.write("out of memory")
    sys.exit(4)
sys.stdout.buffer.write(out.encode("utf-8", "surrogateescape"))
"""


def _patch(old_root: str | None, new_root: str, max_bytes: int, cpu_s: float) -> str:
    """gitdiff.diff_trees(old_root, new_root) in a child with `cpu_s` of CPU: SessionDiffTooLarge when the patch
    passes `max_bytes` (counted as it is built: the rest is never made), the files DIFF_READ_BYTES, or the CPU."""
    cpu = max(1, math.ceil(cpu_s))
    try:
        p = subprocess.run([sys.executable, "-I", "-S", "-c", DIFF_CHILD, str(cpu), gitdiff.__file__, old_root or "",
                            new_root, str(DIFF_READ_BYTES), str(max_bytes)], capture_output=True, env={},
                           timeout=3 * cpu + 30, check=False)
    except subprocess.TimeoutExpired:
        raise SessionInfraError(f"the diff did not end within {3 * cpu + 30} s of wall clock (the host is "
                                "overloaded)") from None
    if p.returncode == 0:
        return p.stdout.decode("utf-8", "surrogateescape")
    why = p.stderr.decode("utf-8", "replace").strip()[-300:]
    if p.returncode == 3:
        raise SessionDiffTooLarge(f"{why} (max_bytes={max_bytes})")
    if p.returncode == 4 or p.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        raise SessionDiffTooLarge(f"the workspace's diff ran out of {'memory' if p.returncode == 4 else 'CPU'} "
                                  f"({cpu} s: too much changed data to diff)")
    raise SessionInfraError(f"the diff's child failed (exit {p.returncode}): {why}")


def _discard_when_done(fut: asyncio.Future[Any]) -> None:
    """A container create we no longer wait for (a deadline, a cancelled create): remove it once it exists."""

    def done(f: asyncio.Future[Any]) -> None:
        if f.cancelled() or f.exception() is not None:
            return
        c = f.result()[0].c
        threading.Thread(target=lambda: c.remove(force=True), daemon=True).start()

    fut.add_done_callback(done)


T = TypeVar("T")

#: engine calls block a thread each (the SDK is synchronous): sessions' calls get a pool of their own, sized for many
#: concurrent episodes (asyncio's default pool has min(32, cpus + 4) threads: 6 on 2 cores, so 64 concurrent
#: sessions queued behind each other's engine round trips); the SDK's connection pool is as large
DOCKER_THREADS = int(os.environ.get("RLF_DOCKER_THREADS", 64))
_POOL: ThreadPoolExecutor | None = None


def _thread(fn: Callable[..., T], /, *args: Any, **kw: Any) -> asyncio.Future[T]:
    """`fn(*args, **kw)` on the docker calls' thread pool (RuntimeError "... after interpreter shutdown" at exit, as
    `asyncio.to_thread` gives: callers then run it inline)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=DOCKER_THREADS, thread_name_prefix="rlf-docker")
    return asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args, **kw))


async def _remove_quietly(c: Any) -> None:
    with contextlib.suppress(Exception):
        await _remove(c)


async def _remove(c: Any) -> None:
    """Force-remove a container off the loop; at interpreter exit (atexit closers run after the executors shut
    down, so `to_thread` refuses) inline, so a backend closed at exit still leaves no container behind."""
    try:
        await asyncio.wait_for(_thread(c.remove, force=True), API_TIMEOUT_S)
    except RuntimeError as e:  # "cannot schedule new futures after [interpreter] shutdown"
        if "shutdown" not in str(e):
            raise
        c.remove(force=True)


@dataclass(frozen=True)
class _Image:
    """What the backend learnt of an image once: its id, the user its commands run as (and whether root), that
    user's numeric ids (for the files the backend writes), the shell a str command runs under, its sleep binary
    (pid 1's content), and the image session containers are created from (`run`: the image with that pid 1 in it,
    derived once; the image itself where the engine could not commit, pid 1 then put in every container's first
    archive)."""

    id: str
    user: str
    root: bool
    uid: int = 0
    gid: int = 0
    shell: tuple[str, ...] = ("/bin/bash", "-lc")
    sleep: bytes = b""
    run: str = ""

    @property
    def derived(self) -> bool:
        return bool(self.run) and self.run != self.id


@dataclass
class _Box:
    """A started session container: the engine's model, the image facts, the host's view (None: not local),
    when it was started (monotonic) and how long its pid 1 lives."""

    c: Any
    image: _Image
    host: _Host | None
    born: float
    lifetime_s: float


class DockerSession(Session):
    """A session in one container: execs through the engine's API, the deadline kill from the host (kernel start
    times, the container's cgroup), files through archives, the diff built on the host from a bounded tar."""

    def __init__(self, backend: DockerBackend, box: _Box, spec: SessionSpec, started: float) -> None:
        self.id = box.c.name
        self.spec = spec
        self._b = backend
        self._c = box.c
        self._image = box.image
        self._last_tick = -1  # the boot tick in which the last exec ended (`_run_exec`)
        #: the host's view of the container's processes (None: kill from inside)
        self._host = box.host
        self._lock = asyncio.Lock()
        self._closed = False
        self._expired = False
        self._seed_names: set[str] | None = None
        self._offset: float | None = None
        # the wall clock counts from the container's start (or the lease of a warm one): pid 1 outlives it
        self._deadline = started + spec.limits.session_timeout_s
        self._timer = asyncio.get_running_loop().call_later(max(0.0, self._deadline - time.monotonic()) + 1.0,
                                                            self._expire)

    def _expire(self) -> None:
        self._expired = True
        asyncio.get_running_loop().create_task(self.aclose())

    def _past(self) -> bool:
        return self._expired or time.monotonic() >= self._deadline

    def _expired_error(self) -> SessionExpired:
        return SessionExpired(f"session {self.id} ran past its wall clock "
                              f"(session_timeout_s={self.spec.limits.session_timeout_s})")

    def _check(self) -> None:
        if self._past():
            raise self._expired_error()
        if self._closed:
            raise SessionClosed(f"session {self.id} is closed")

    def _fail(self, e: BaseException) -> SessionError:
        """Whose error: the session's wall clock spent (SessionExpired) or the backend's classification."""
        if isinstance(e, SessionError) and not isinstance(e, SessionInfraError):
            return e
        if self._past():
            return self._expired_error()
        return e if isinstance(e, SessionError) else self._b._classify(e)

    async def _api(self, fn: Any, *args: Any, timeout_s: float = API_TIMEOUT_S, **kw: Any) -> Any:
        try:
            return await asyncio.wait_for(_thread(fn, *args, **kw), timeout_s)
        except TimeoutError:
            raise SessionInfraError(f"the docker engine did not answer within {timeout_s:.0f} s") from None
        except Exception as e:
            raise self._fail(e) from e

    def _run_exec(self, argv: list[str], stdin: bytes, cwd: str, env: dict[str, str], cap: int,
                  mark: list[tuple[int, float]] | None = None) -> dict[str, Any]:
        api = self._b.client.api
        ex = api.exec_create(self._c.id, argv, stdin=bool(stdin), workdir=cwd, environment=env,
                             user=self._image.user)
        if mark is not None:  # the call's start, as the kernel counts it: nothing of the call runs before this
            # ... and nothing of the previous call starts at it: the kernel counts starts in ticks (10 ms), so a call
            # right after another waits for the tick in which that one ended to pass (else what it left running,
            # `server &`, would look started by this call and die at this call's deadline)
            while _boot_ticks() <= self._last_tick:
                time.sleep(0.001)
            mark.append((_boot_ticks(), time.monotonic()))
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
        self._last_tick = _boot_ticks()
        return {"out": bytes(out), "err": bytes(err), "trunc": trunc, "code": code}

    async def _kill_since(self, ticks0: int, t0: float) -> None:
        """SIGKILL what the call started: from the host where it can, else from inside (shell builtins only)."""
        host = self._host
        if host is not None:
            try:
                if await _thread(host.kill_since, ticks0):
                    return
            except Exception:  # fall back to the in-container kill
                pass
        with contextlib.suppress(Exception):
            off = await self._clock_offset()
            t = math.floor((t0 + off) * USER_HZ) - 1
            await asyncio.wait_for(_thread(self._run_exec, ["/bin/sh", "-c", f"t0={t}\n{KILL_SCRIPT}"],
                                                     b"", "/", {}, 4096), 30)

    async def _clock_offset(self) -> float:
        """The engine host's boot clock minus this host's monotonic clock, a lower bound (once per session): a shell
        started inside reports its start tick S, which it reached before its answer came back at `ta`, so
        S - ta is at most the true offset. A call's start mapped with it is never late: the fallback kill may take
        processes started up to that exec's round trip before the call, never spare one of the call's."""
        if self._offset is None:
            r = await asyncio.wait_for(_thread(
                self._run_exec, ["/bin/sh", "-c", 'read -r l < /proc/self/stat && echo "$l"'], b"", "/", {}, 4096), 30)
            ta = time.monotonic()
            line = r["out"].decode("ascii", "replace")
            self._offset = int(line[line.rfind(")") + 2:].split()[19]) / USER_HZ - ta
        return self._offset

    async def _end_call(self, fut: asyncio.Future[dict[str, Any]], mark: list[tuple[int, float]]) -> dict[str, Any]:
        """The call ran past its deadline: kill what it started until its output closes (an exec that the engine
        started late is caught by a later round); past GRACE_S the session is ended."""
        until = time.monotonic() + GRACE_S
        wait = 0.05
        while True:
            await self._kill_since(*mark[-1])
            try:
                return await asyncio.wait_for(asyncio.shield(fut), max(0.0, min(wait, until - time.monotonic())))
            except TimeoutError:
                pass
            except Exception as e:
                raise self._fail(e) from e
            if time.monotonic() >= until:
                break
            wait = min(1.0, wait * 2)
        healthy = await self._b._healthy()
        await self.aclose()
        if healthy:
            raise SessionLimitExceeded(f"session {self.id}: a call did not end {GRACE_S:.0f} s after its deadline "
                                       "kill (a process of the session holds its output open); the session was "
                                       "ended", "exec_deadline")
        raise SessionInfraError(f"session {self.id}: the docker engine stopped answering during a call past its "
                                "deadline")

    def _argv(self, cmd: str | list[str]) -> list[str]:
        if isinstance(cmd, str):
            return [*self._image.shell, _text(cmd, "the command")]
        if isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd):
            return [_text(a, "an argument") for a in cmd]
        raise ValueError("exec takes a shell command (str) or a non-empty argv (list of str)")

    @staticmethod
    def _env(env: dict[str, str] | None) -> dict[str, str]:
        if env is None:
            return {}
        if not isinstance(env, dict):
            raise SessionError(f"env must map str to str, got {type(env).__name__}")
        for k, v in env.items():
            if not _text(k, "an env name") or "=" in k:
                raise SessionError(f"env name {k!r} must be non-empty and hold no '='")
            _text(v, f"env {k}")
        return dict(env)

    def _abs(self, path: str, what: str = "the path") -> str:
        p = _text(path, what)
        return posixpath.normpath(p if p.startswith("/") else posixpath.join(self.spec.workdir, p))

    async def exec(self, cmd: str | list[str], *, stdin: str | bytes | None = None, timeout_s: float | None = None,
                   cwd: str | None = None, env: dict[str, str] | None = None) -> ExecResult:
        argv = self._argv(cmd)
        timeout = float(timeout_s if timeout_s is not None else self.spec.limits.exec_timeout_s)
        if not timeout > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        where = self.spec.workdir if cwd is None else self._abs(cwd, "cwd")
        environment = {**self.spec.env, **self._env(env)}
        data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        async with self._lock:
            self._check()
            timeout = max(0.001, min(timeout, self._deadline - time.monotonic()))
            mark = [(_boot_ticks(), time.monotonic())]  # replaced by the sample taken just before the exec starts
            fut = asyncio.ensure_future(_thread(self._run_exec, argv, data, where, environment,
                                                          self.spec.limits.output_bytes, mark))
            t0 = mark[0][1]
            timed_out = False
            try:
                r = await asyncio.wait_for(asyncio.shield(fut), timeout)
            except TimeoutError:  # the deadline: kill everything the call started (the host's clock, not theirs)
                timed_out = True
                r = await self._end_call(fut, mark)
            except Exception as e:
                raise self._fail(e) from e
            dur = time.monotonic() - t0
        if r["code"] is None:
            raise self._fail(SessionInfraError(f"session {self.id}: the engine gave no exit code"))
        code, out, err = int(r["code"]), r["out"], r["err"]
        if code == 126 and not timed_out and not err and out.startswith(b"OCI runtime exec failed"):
            # the engine could not start the process: its message is no output of the command's
            msg = out.decode("utf-8", "replace").strip()
            if "chdir to cwd" in msg:
                raise SessionFileNotFound(f"session {self.id}: cwd {cwd!r}: no such directory")
            if "executable file not found" in msg or "no such file or directory" in msg:
                code = 127
            out, err = b"", msg.encode() + b"\n"
        return ExecResult(exit_code=124 if timed_out else code, stdout=out.decode("utf-8", "replace"),
                          stderr=err.decode("utf-8", "replace"), timed_out=timed_out, truncated=r["trunc"],
                          duration_s=dur)

    async def read_file(self, path: str) -> bytes:
        p = self._abs(path)

        def get() -> bytes:
            try:
                with _archive(self._b.client.api, self._c.id, p) as (stream, st):
                    if st.get("size", 0) > MAX_FILE:
                        raise SessionError(f"session {self.id}: {path}: larger than {MAX_FILE} bytes")
                    got = _one_file(stream, MAX_FILE)
            except FileNotFoundError:
                raise SessionFileNotFound(f"session {self.id}: {path}: no such file") from None
            except self._b._docker.errors.NotFound as e:
                if _container_gone(e):
                    raise
                raise SessionFileNotFound(f"session {self.id}: {path}: no such file") from None
            if isinstance(got, tarfile.TarInfo):
                raise SessionError(f"session {self.id}: {path}: not a regular file")
            return got[1]

        async with self._lock:
            self._check()
            host = self._host
            if host is not None:  # a local engine: read by this host's kernel where it can (no archive call)
                try:
                    fast = await _thread(host.read, p, MAX_FILE)
                except FileNotFoundError:
                    raise SessionFileNotFound(f"session {self.id}: {path}: no such file") from None
                if fast is not None:
                    return fast
            data: bytes = await self._api(get)
            return data

    async def write_file(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        p = self._abs(path)
        raw = data.encode() if isinstance(data, str) else bytes(data)
        if len(raw) > MAX_FILE:
            raise SessionError(f"session {self.id}: {path}: {len(raw)} bytes, more than {MAX_FILE}")
        if p == "/":
            raise SessionError(f"session {self.id}: {path!r} is not a file path")
        parent, name = posixpath.split(p)
        img = self._image

        def put() -> None:
            # into the nearest directory that exists: a tar entry for an existing directory would reset its mode
            # and owner (/tmp's sticky bit), so only the missing ones are in the archive
            api = self._b.client.api
            base, rest = parent, name
            while True:
                try:
                    ok = api.put_archive(self._c.id, base, _tar_of_file(rest, raw, mode, img.uid, img.gid, True))
                    break
                except Exception as e:
                    if getattr(e, "status_code", None) != 404 or base == "/" or _container_gone(e):
                        raise
                    base, up = posixpath.split(base)
                    rest = f"{up}/{rest}"
            if not ok:
                raise SessionError(f"session {self.id}: could not write {path}")

        async with self._lock:
            self._check()
            host = self._host
            # a local engine: written by this host's kernel where it can (no archive call)
            if host is not None and await _thread(host.write, p, raw, mode, img.uid, img.gid):
                return
            await self._api(put)

    def _seed(self) -> set[str]:
        if self._seed_names is None:
            self._seed_names = set(gitdiff._entries(self.spec.seed_dir or "", gitdiff.EXCLUDE))
        return self._seed_names

    async def diff(self, max_bytes: int | None = None) -> str:
        limit = self.spec.limits.diff_bytes if max_bytes is None else max_bytes
        if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        wd = self.spec.workdir.rstrip("/")

        def get() -> str:
            seed = self._seed()
            tmp = os.path.realpath(tempfile.mkdtemp(prefix="rlf-docker-diff-"))
            cleanup.sweep_once(os.path.dirname(tmp))  # what a killed trainer's `discard` below left there
            try:
                host, root = self._host, os.path.join(tmp, "host")
                # a local engine: the workdir copied by this host's kernel where it can (no archive call)
                if host is None or not host.copy_tree(wd, root, _DiffBudget(seed, limit)):
                    os.mkdir(os.path.join(tmp, "engine"), 0o700)
                    with _archive(self._b.client.api, self._c.id, wd) as (stream, _):
                        root = self._fetch(stream, os.path.join(tmp, "engine"), seed, limit)
                return _patch(self.spec.seed_dir, root, limit, self.spec.limits.exec_timeout_s)
            finally:
                cleanup.discard(tmp)  # what the container held: any depth or mode, removed off the call's path

        async with self._lock:
            self._check()
            patch: str = await self._api(get, timeout_s=API_TIMEOUT_S + 4 * self.spec.limits.exec_timeout_s + 30)
            return patch

    def _fetch(self, stream: Iterator[bytes], tmp: str, seed: set[str], limit: int) -> str:
        """Unpack the workdir's archive into `tmp` (regular files, dirs and links; never through a link; `.git`
        left out) and return the unpacked workdir. Refused on the way (SessionDiffTooLarge): more file content than
        the diff reads, more entries than the seed's + DIFF_MAX_NEW_ENTRIES, or new files whose patch headers alone
        pass `limit`. A workdir that became a link or a file is the session's error, never followed here."""
        wd = self.spec.workdir.rstrip("/")
        top = posixpath.basename(wd)
        # the raw stream's bound: the content the diff may read plus headers for the entries it may hold
        cap = DIFF_READ_BYTES + (len(seed) + DIFF_MAX_NEW_ENTRIES + 16) * 1536
        budget = _DiffBudget(seed, limit)
        with tarfile.open(fileobj=io.BufferedReader(_Cap(stream, cap, SessionDiffTooLarge)), mode="r|") as tf:
            for m in tf:
                name = posixpath.normpath(m.name)
                parts = name.split("/")
                if name == top:
                    if not m.isdir():
                        raise SessionError(f"session {self.id}: the workdir {wd} is no longer a directory")
                elif parts[0] != top or ".." in parts or ".git" in parts:
                    continue
                budget.add(name[len(top) + 1:], m.size if m.isreg() else 0, m.isdir())
                target = os.path.join(tmp, name)
                if not (m.isreg() or m.isdir() or m.issym() or m.islnk()) or \
                        not inside(tmp, os.path.dirname(target)):  # never through a link a member made
                    continue
                if os.path.islink(target):
                    os.unlink(target)
                if m.islnk():  # a hard link: linked to its target when that is in the tree already
                    src = os.path.join(tmp, posixpath.normpath(m.linkname))
                    if inside(tmp, src) and os.path.isfile(src) and not os.path.islink(src):
                        with contextlib.suppress(OSError):
                            os.link(src, target)
                    continue
                m.name = name
                m.mode = (m.mode & 0o755) | (0o700 if m.isdir() else 0o600)
                m.uid = m.gid = os.getuid()
                tf.extract(m, tmp, set_attrs=True, numeric_owner=True, filter="fully_trusted")
        root = os.path.join(tmp, top)
        if os.path.islink(root) or not os.path.isdir(root):
            raise SessionError(f"session {self.id}: the workdir {wd} is no longer a directory")
        return root

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._timer.cancel()
        self._b._sessions.discard(self)
        with contextlib.suppress(Exception):
            await _remove(self._c)


class DockerBackend(PooledBackend):
    """Sessions as containers of an engine the SDK reaches (`DOCKER_HOST`; Podman's socket too): the shared lifecycle
    (`lifecycle.PooledBackend`: admission, create rate, reaper, warm pool) with owner labels set in the create call
    and containers that end by themselves at their wall clock."""

    name = "docker"

    def __init__(self, base_url: str | None = None, max_starting: int = 8, creates_per_s: float = 20.0,
                 reap_every_s: float = 30.0, pool_size: int | None = None, pool_idle_s: float = 300.0) -> None:
        try:
            import docker
        except ImportError:
            from rlf_envs.extras import install_hint

            raise SessionInfraError(f"the docker backend needs the docker SDK: {install_hint('docker')}") from None
        try:
            self.client = docker.DockerClient(base_url=base_url, timeout=API_TIMEOUT_S,
                                              max_pool_size=DOCKER_THREADS) if base_url \
                else docker.from_env(timeout=API_TIMEOUT_S, max_pool_size=DOCKER_THREADS)
            self.client.ping()
        except Exception as e:
            where = base_url or os.environ.get("DOCKER_HOST") or "the default socket"
            raise SessionInfraError(f"no docker engine at {where}: {e} (start dockerd or set DOCKER_HOST)") from None
        self._docker = docker
        super().__init__(max_starting=max_starting, creates_per_s=creates_per_s, reap_every_s=reap_every_s)
        #: warm containers per (image, network, limits, workdir, env): created and started ahead, labelled like any
        #: session (so the reaper removes them too); a create then only copies the seed in. A warm container's
        #: pid 1 lives `pool_idle_s` longer than a session's, and one older than `pool_idle_s` is never handed out.
        self.pool_size = int(os.environ.get("RLF_DOCKER_SESSION_POOL", 2)) if pool_size is None else pool_size
        if not pool_idle_s > 0:
            raise ValueError(f"pool_idle_s must be positive, got {pool_idle_s!r}")
        self.pool_idle_s = float(pool_idle_s)
        self.pool: WarmPool[tuple[Any, ...], _Box] = WarmPool(
            self.pool_size, usable=lambda box: time.monotonic() - box.born <= self.pool_idle_s,
            discard=lambda box: _remove_quietly(box.c), what="docker session")
        self._images: dict[str, _Image] = {}
        self._image_lock = threading.Lock()  # one thread learns an image (and derives its pid-1 image) at a time
        self._bid = uuid.uuid4().hex[:12]  # this backend, on the images it derives
        self.host = socket.gethostname()
        self.reaped_at_start = self.reap()

    def _classify(self, e: BaseException) -> SessionError:
        errors = self._docker.errors
        if isinstance(e, SessionError):
            return e
        if isinstance(e, errors.NotFound):
            return SessionInfraError(f"the session's container is gone (removed from outside the session): {e}")
        if isinstance(e, errors.APIError) and e.status_code == 409:
            return SessionInfraError(f"the session's container stopped (killed from outside the session): {e}")
        if isinstance(e, errors.APIError) and e.status_code is not None and e.status_code < 500:
            return SessionError(f"docker refused: {e}")
        return SessionInfraError(f"docker engine failure: {e!r}")

    async def _healthy(self) -> bool:
        try:
            return bool(await asyncio.wait_for(_thread(self.client.ping), 30))
        except Exception:
            return False

    def _labels(self) -> dict[str, str]:
        pid = os.getpid()
        return {LABEL: "1", "rlf.owner.run": owners.RUN_ID, "rlf.owner.pid": str(pid),
                "rlf.owner.start": str(owners.start_time(pid)), "rlf.owner.host": self.host}

    @staticmethod
    def _owner_gone(lab: dict[str, str]) -> bool:
        try:
            pid, start = int(lab["rlf.owner.pid"]), lab.get("rlf.owner.start")
            started = int(start) if start and start != "None" else None
        except (KeyError, ValueError):
            return False
        return not owners.alive(pid, started)

    def check_image(self, image: str) -> None:
        ref = _image_ref(image)  # ValueError without the docker: prefix, saying what to do
        try:
            self.client.images.get(ref)
        except self._docker.errors.ImageNotFound:
            raise ValueError(f"the docker engine holds no image {ref!r}: `docker pull`, `docker load` or `docker "
                             "import` it first") from None
        except Exception as e:
            raise SessionInfraError(f"the docker engine could not be asked for {image!r}: {e}") from None

    def reap(self) -> int:
        """Remove this host's session containers whose owner process is gone, and the images built for Harbor
        tasks (`rlf.image`, not `rlf.keep`) whose builder is gone and that no container uses. Returns how many."""
        n = 0
        with contextlib.suppress(Exception):
            found = self.client.containers.list(all=True, filters={"label": [LABEL, f"rlf.owner.host={self.host}"]})
            for c in found:
                if self._owner_gone(c.labels):
                    with contextlib.suppress(Exception):
                        c.remove(force=True)
                        n += 1
        with contextlib.suppress(Exception):
            for img in _children_first(self.client.images.list(filters={"label": [IMAGE_LABEL,
                                                                                  f"rlf.owner.host={self.host}"]})):
                lab = img.labels or {}
                if lab.get(KEEP_LABEL) != "1" and self._owner_gone(lab):
                    n += self._remove_image(img)
        return n

    def _remove_image(self, img: Any) -> int:
        """Remove an image by its tags (a container using it keeps it: the engine refuses, and a later reap tries
        again). 1 when it went."""
        try:
            for tag in img.tags or [img.id]:
                self.client.images.remove(tag, noprune=False)
            return 1
        except Exception:
            return 0

    def remove_built_images(self) -> int:
        """Remove the images this process built (`rlf.image` with this process as owner, not `rlf.keep`): Harbor
        tasks' images and this backend's own ones with pid 1 put in (another backend of the process may still
        create from its own), these first."""
        lab = self._labels()
        want = [IMAGE_LABEL, f"rlf.owner.pid={lab['rlf.owner.pid']}", f"rlf.owner.host={self.host}"]
        n = 0
        with contextlib.suppress(Exception):
            for img in _children_first(self.client.images.list(filters={"label": want})):
                got = img.labels or {}
                if got.get(KEEP_LABEL) != "1" and got.get("rlf.owner.start") == lab["rlf.owner.start"] and \
                        got.get(INIT_BACKEND_LABEL, self._bid) == self._bid:
                    n += self._remove_image(img)
        return n

    async def reap_round(self) -> None:
        await _thread(self.reap)
        # warm containers past the pool's idle cap go (their pid 1 ends them soon anyway)
        self.pool.prune(lambda box: time.monotonic() - box.born > self.pool_idle_s)

    @staticmethod
    def _key(spec: SessionSpec) -> tuple[Any, ...]:
        lim = spec.limits
        return (spec.image, spec.network, lim.memory_mb, lim.pids, lim.session_timeout_s, spec.workdir,
                tuple(sorted(spec.env.items())))

    async def _warm(self, spec: SessionSpec) -> _Box:
        """A warm container for the pool: the spec without its seed, living `pool_idle_s` longer."""
        bare = SessionSpec(image=spec.image, workdir=spec.workdir, env=spec.env, network=spec.network,
                           limits=spec.limits)
        fut = asyncio.ensure_future(_thread(self._create, bare, self.pool_idle_s))
        try:
            box, _ = await asyncio.wait_for(asyncio.shield(fut), API_TIMEOUT_S)
        except BaseException:
            _discard_when_done(fut)
            raise
        return box

    def _seed_warm(self, box: _Box, spec: SessionSpec) -> tuple[_Box, float]:
        """Copy the spec's seed into a leased warm container (the session's clock starts now); removed if it fails."""
        started = time.monotonic()
        try:
            if spec.seed_dir and not box.c.put_archive(spec.workdir, _tar_of_dir(spec.seed_dir, box.image.uid,
                                                                                 box.image.gid)):
                raise SessionInfraError("could not copy the seed into the container")
        except BaseException:
            with contextlib.suppress(Exception):
                box.c.remove(force=True)
            raise
        return box, started

    def _image(self, ref: str) -> _Image:
        """The image's facts, learnt once per ref (one thread at a time): its id and user from the engine; the shell
        and pid 1 (an execute-only copy of its sleep) from its files, in a container made for that; and the image
        sessions are created from: that container with pid 1 put in, committed (`INIT_LABEL`, owned like the Harbor
        images: removed with the backend, or by a later reaper). Each archive call costs the engine a helper process
        (about an exec's CPU): so a session container's only one is its seed's. Where the engine cannot commit, the
        image itself, and pid 1 goes into each container's first archive."""
        img = self._images.get(ref)
        if img is not None:
            return img
        with self._image_lock:
            img = self._images.get(ref)
            if img is None:
                img = self._learn(ref)
                self._images[ref] = img
            return img

    def _learn(self, ref: str) -> _Image:
        api = self.client.api
        attrs = api.inspect_image(ref)
        user = (attrs.get("Config") or {}).get("User") or "0"
        base = _Image(attrs["Id"], user, _is_root(user))
        # (a container's labels add to its image's: a kept Harbor image's `rlf.keep` is not the derived one's)
        labels = {**self._labels(), IMAGE_LABEL: "1", INIT_LABEL: base.id, INIT_BACKEND_LABEL: self._bid,
                  KEEP_LABEL: "0"}
        cid = api.create_container(base.id, command=[INIT], entrypoint=[INIT], user=INIT_USER, labels=labels,
                                   name="rlf-init-" + uuid.uuid4().hex[:12], network_disabled=True,
                                   use_config_proxy=False)["Id"]
        try:
            shell = ("/bin/bash", "-lc") if self._file(cid, "/bin/bash", 64 << 20) is not None else ("/bin/sh", "-c")
            body = None
            for path in ("/bin/sleep", "/usr/bin/sleep"):
                body = self._file(cid, path, 16 << 20)
                if body is not None:
                    break
            if body is None:
                raise SessionError(f"image {ref!r} has no `sleep` (/bin/sleep): the docker backend's session "
                                   "containers run it as pid 1")
            uid, gid = (0, 0) if base.root else self._ids(cid, user)
            img = _Image(base.id, user, base.root, uid, gid, shell, body, base.id)
            try:
                if not api.put_archive(cid, "/", _tar_of_dir(None, sleep=body)):
                    raise SessionInfraError("the engine did not take the archive")
                run = api.commit(cid, repository="rlf-init", tag=f"{base.id.split(':')[-1][:12]}-"
                                 f"{uuid.uuid4().hex[:8]}")["Id"]
                img = dataclasses.replace(img, run=run)
            except Exception as e:  # every container then gets pid 1 in its first archive
                log.info("docker sessions: could not derive an image with pid 1 from %s (%s); putting it into each "
                         "container instead", ref, e)
            return img
        finally:
            with contextlib.suppress(Exception):
                api.remove_container(cid, force=True)

    def _file(self, cid: str, path: str, limit: int) -> bytes | None:
        """A regular file of a (created) container, links followed; None when there is none."""
        for _ in range(8):
            try:
                with _archive(self.client.api, cid, path) as (stream, st):
                    if st.get("size", 0) > limit:
                        return None
                    got = _one_file(stream, limit)
            except (self._docker.errors.NotFound, FileNotFoundError):
                return None
            if not isinstance(got, tarfile.TarInfo):
                return got[1] if got[0].mode & 0o111 else None
            if not got.issym():
                return None
            target = st.get("linkTarget") or got.linkname
            path = target if target.startswith("/") else posixpath.join(posixpath.dirname(path), target)
        return None

    def _ids(self, cid: str, user: str) -> tuple[int, int]:
        """The numeric uid and gid of an image's user ("name", "uid", "name:group", "uid:gid"), from its passwd and
        group files; 0 where it names what they do not hold."""
        name, _, group = user.partition(":")

        def table(path: str) -> dict[str, list[str]]:
            data = self._file_any(cid, path)
            rows = [ln.split(":") for ln in data.decode("utf-8", "replace").splitlines()]
            return {r[0]: r for r in rows if len(r) >= 4}

        uid = gid = 0
        with contextlib.suppress(Exception):
            if name.isdigit():
                uid = int(name)
                gid = next((int(r[3]) for r in table("/etc/passwd").values() if r[2] == name), uid)
            else:
                row = table("/etc/passwd").get(name)
                uid, gid = (int(row[2]), int(row[3])) if row else (0, 0)
            if group:
                gid = int(group) if group.isdigit() else int(table("/etc/group")[group][2])
        return uid, gid

    def _file_any(self, cid: str, path: str) -> bytes:
        with _archive(self.client.api, cid, path) as (stream, _):
            got = _one_file(stream, 16 << 20)
        return b"" if isinstance(got, tarfile.TarInfo) else got[1]

    def _create(self, spec: SessionSpec, idle_s: float = 0.0) -> tuple[_Box, float]:
        """Create and start a session container (pid 1: the image's sleep, execute-only, as INIT_USER, for the
        session's wall clock + LIFETIME_MARGIN_S + `idle_s`), the seed copied in. (The box, when it was started.)"""
        lim = spec.limits
        ref = _image_ref(spec.image)
        img = self._image(ref)
        lifetime = math.ceil(lim.session_timeout_s + LIFETIME_MARGIN_S + idle_s)
        api = self.client.api
        hc = api.create_host_config(
            network_mode="bridge" if spec.network else "none", mem_limit=f"{lim.memory_mb}m",
            memswap_limit=f"{lim.memory_mb}m", pids_limit=lim.pids, cap_drop=CAP_DROP,
            security_opt=[] if img.root else ["no-new-privileges"], init=False, auto_remove=True)
        name = "rlf-" + uuid.uuid4().hex[:16]
        def make(run: str) -> str:
            return str(api.create_container(run, command=[str(lifetime)], entrypoint=[INIT], user=INIT_USER,
                                            name=name, labels=self._labels(), working_dir=spec.workdir,
                                            environment=spec.env, host_config=hc, hostname="sandbox", detach=True,
                                            use_config_proxy=False)["Id"])

        try:
            cid = make(img.run)
        except self._docker.errors.ImageNotFound:
            if not img.derived:
                raise
            # the derived image was removed from outside (`docker rmi`, a prune): derived again, once
            with self._image_lock:
                if self._images.get(ref) is img:
                    del self._images[ref]
            img = self._image(ref)
            cid = make(img.run)
        try:
            # one archive at most, before the start: the seed, with pid 1 where the image has none (not derived)
            first = _tar_of_dir(spec.seed_dir, img.uid, img.gid, spec.workdir.strip("/"),
                                b"" if img.derived else img.sleep)
            if first and not api.put_archive(cid, "/", first):
                raise SessionInfraError("could not put the session's seed (and pid 1) into the container")
            born = time.monotonic()
            api.start(cid)
            attrs = api.inspect_container(cid)
            pid1 = int((attrs.get("State") or {}).get("Pid") or 0)
            box = _Box(self.client.containers.prepare_model(attrs), img, _Host.find(cid, pid1) if pid1 else None,
                       born, float(lifetime))
        except BaseException:
            with contextlib.suppress(Exception):
                api.remove_container(cid, force=True)
            raise
        return box, born

    async def create(self, spec: SessionSpec) -> DockerSession:
        _image_ref(spec.image)
        async with self.admit():
            got = None
            box = self.pool.lease(self._key(spec))
            if box is not None:
                with contextlib.suppress(Exception):  # a warm container that cannot take the seed: make one instead
                    got = await asyncio.wait_for(_thread(self._seed_warm, box, spec), API_TIMEOUT_S)
            self.pool.fill(self._key(spec), lambda: self._warm(spec))
            if got is None:
                await self.rate_limit()
                fut = asyncio.ensure_future(_thread(self._create, spec))
                try:
                    got = await asyncio.wait_for(asyncio.shield(fut), API_TIMEOUT_S)
                except TimeoutError:
                    _discard_when_done(fut)
                    raise SessionInfraError(f"the docker engine did not create a container within {API_TIMEOUT_S} "
                                            "s (it is removed if it appears later)") from None
                except SessionError:
                    raise
                except Exception as e:
                    if isinstance(e, self._docker.errors.ImageNotFound):
                        raise SessionError(f"image {spec.image!r} is not in the engine: `docker pull`/`docker load`/"
                                           "`docker import` it first") from None
                    raise self._classify(e) from e
            s = DockerSession(self, got[0], spec, got[1])
            self._sessions.add(s)
            return s

    async def aclose(self) -> None:
        if not await self.close_lifecycle(self.pool, API_TIMEOUT_S):
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(_thread(self.remove_built_images), API_TIMEOUT_S)
        with contextlib.suppress(Exception):
            self.client.close()
