"""The in-session agent of the local backend (stdlib only; run as `python -I -S _agent.py`, never imported by the
trainer). Trusted: it holds root inside the session's namespaces; what it runs does not. Run as a script, it makes
`rlf_envs`, `rlf_envs.sandbox` and `rlf_envs.sandbox.sessions` bare namespaces (as `sandbox/_supervisor.py` does: their
`__init__` never runs) and loads the sandbox's stdlib-only modules by their package names: the Linux ABI (`_base`),
the one seccomp filter of the sandbox (`_seccomp`: every exec gets exactly a stateless run's filter) and `gitdiff`.

Process tree of one session::

    trainer ──requests──▶ Z (`--zygote`: one per backend, everything imported and the seccomp program built; forks
                             a P per request, so an agent costs a fork, not an interpreter's start: ~50 ms of CPU)
    trainer ──socket frames──▶ P (host pid ns: unshares mount/pid/uts[/net], forks C, waits for it)
                                      └─ C = pid 1 of the session's pid namespace, in an IPC namespace of its own:
                                         builds the root (tmpfs + read-only binds of the host's system dirs, or an
                                         overlay over an image root) and the session's one scratch tmpfs (disk_mb:
                                         the overlay's upper layer, the workspace with a copy of the seed, /tmp,
                                         /var/tmp, /dev/shm), mounts the seed (a detached mount the trainer sends)
                                         read-only under /.rlf (0700), switches to the root (pivot_root, the old root
                                         detached), then serves requests one at a time; each exec goes through L, the
                                         session's launcher (below). At close, "reset" (`reset`) readies C for the
                                         next session of the same image: every other process killed, a new IPC
                                         namespace, every place the session could write replaced

What is confined, and how (docs/security.md, "Local backend confinement"): after set-up no process of the session (C
included) holds a descriptor, cwd or root outside the session's root, and the host's filesystem is not in the
session's mount namespace at all; file requests are resolved in the root with the session user's rights (openat2
RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS, else a walk refusing every symlink), and /proc is no file of the session;
what a request's content causes is the caller's error ("user"), what the session's own limits cause is "limit",
only our own failures are "infra". P and C are exempt from the OOM killer (oom_score_adj -1000, where the host grants
CAP_SYS_RESOURCE), every exec starts at 1000 (the OOM killer's first choice, in the session's cgroup and the host's).

Frames: a 4-byte big-endian length + a JSON header, then, where the header says "blob": n, n raw bytes (a file's
data, an exec's stdin or output, a patch: never base64 nor JSON-escaped), on the agent's stdin (requests) and stdout
(replies), over the one socket Z made for P. The first frame P writes is {"pid": <C's host pid>} so the owner label can
name it before anything waits on C. Every process of the session dies with C (pid 1), C asks for SIGKILL when P dies,
P when Z dies and Z when the trainer dies (PR_SET_PDEATHSIG); the owner reaper covers what that misses. All mounts
live in the session's mount namespace only, so they go with it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import posixpath
import resource
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess  # (the launcher's: imported before the session clears sys.path)
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

if not __package__:  # a script of a bare interpreter: the sandbox's stdlib-only modules by their package names
    _here = os.path.dirname(os.path.abspath(__file__))
    for _pkg, _pkg_dir in (("rlf_envs", os.path.dirname(os.path.dirname(_here))),
                           ("rlf_envs.sandbox", os.path.dirname(_here)), ("rlf_envs.sandbox.sessions", _here)):
        if _pkg not in sys.modules:  # bare namespaces: their `__init__` (which imports asyncio etc.) never runs
            _module = types.ModuleType(_pkg)
            _module.__path__ = [_pkg_dir]
            sys.modules[_pkg] = _module

from rlf_envs.sandbox._base import (  # the sandbox's Linux ABI
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUTS,
    MNT_DETACH,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
    PR_SET_CHILD_SUBREAPER,
    PR_SET_DUMPABLE,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
    RESOLVE_IN_ROOT,
    RESOLVE_NO_MAGICLINKS,
    SYSTEM_DIRS,
    _check,
    _libc,
    _openat2,
    _pivot_root,
    _set_name,
    _umount2,
    check_path,
    move_mount_fd,
)
from rlf_envs.sandbox._base import _mount as mount
from rlf_envs.sandbox._base import _prctl as prctl
from rlf_envs.sandbox._seccomp import _seccomp, _seccomp_prog  # the sandbox's one filter
from rlf_envs.sandbox.sessions import gitdiff

#: a session's /etc holds more of the host's than a run's (a shell, git, TLS, locales); and /dev/tty
ETC_ENTRIES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "passwd", "group", "nsswitch.conf", "hosts",
               "os-release", "alternatives", "ssl", "ca-certificates", "profile", "profile.d", "bash.bashrc",
               "inputrc", "mime.types", "protocols", "services", "debian_version", "timezone", "environment")
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
MAX_FILE = 64 << 20
#: where the pristine seed is bound (read-only) inside the session's root, for the diff: under a directory only root
#: may enter, so the session's user cannot reach it (the agent reads it with root's rights)
SEED_DIR = "/.rlf"
SEED = SEED_DIR + "/seed"
#: (an image's root) the image directory, bound read-only for the next root of a recycled agent, and where that next
#: root is staged: both under SEED_DIR, which only root may enter
IMAGE = SEED_DIR + "/image"
STAGE = SEED_DIR + "/stage"
#: (the host image's kept root) where a recycled agent's next scratch tmpfs is mounted
SCRATCH = SEED_DIR + "/scratch"
#: SysV IPC of the session's ipc namespace: a shared memory segment outlives its processes (no OOM kill frees it, and
#: it is charged to the session's cgroup), so it is bounded (8 MiB in all), as are message queues
IPC_LIMITS = (("shmmax", str(8 << 20)), ("shmall", str((8 << 20) // 4096)), ("shmmni", "64"), ("msgmni", "16"))


def scratch_inodes(disk_mb: int) -> int:
    """Inodes of the session's scratch tmpfs: 64 per MB, at least 8192 and at most 32768. Each costs about 1 KB of
    kernel memory that no OOM kill frees (charged to the session's cgroup), so they are bounded like the data."""
    return min(32768, max(8192, disk_mb * 64))


def bind(src: str, dst: str, writable: bool = False, flags: int = 0) -> None:
    mount(src, dst, None, MS_BIND | MS_REC)
    mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_NOSUID | flags | (0 if writable else MS_RDONLY))


class UserError(Exception):
    """The request's content is at fault (a bad path, type or mode): the caller's error (reply kind "user")."""


class LimitError(Exception):
    """The session's own limits stopped the request (its processes hold all its pids or memory, a diff too large or
    too slow): the policy's failure (reply kind "limit", naming which)."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class _DiffTooSlow(LimitError):
    pass


def _show(v: Any) -> str:
    """A request's value in an error message, bounded (a 100 MB path does not make a 600 MB reply)."""
    r = repr(v)
    return r if len(r) <= 200 else r[:200] + "..."


# ---------------------------------------------------------------- frames
def read_frame(fd: int) -> dict[str, Any] | None:
    head = _read_exact(fd, 4)
    if head is None:
        return None
    (n,) = struct.unpack(">I", head)
    body = _read_exact(fd, n)
    if body is None:
        return None
    frame: dict[str, Any] = json.loads(body)
    return frame


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        b = os.read(fd, min(n - len(buf), 1 << 20))
        if not b:
            return None
        buf += b
    return bytes(buf)


class Blob:
    """The raw bytes that follow a request's header ("blob": n): read by the op as a stream, the rest drained after
    it whatever it did, so the next header is always where it should be."""

    def __init__(self, fd: int, n: int) -> None:
        self.fd = fd
        self.left = n

    def read(self, n: int = 1 << 20) -> bytes:
        if self.left <= 0:
            return b""
        b = os.read(self.fd, min(n, self.left))
        if not b:
            raise EOFError("the trainer closed the agent's stdin")
        self.left -= len(b)
        return b

    def drain(self) -> None:
        while self.left > 0:
            self.read()


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_frame(fd: int, obj: dict[str, Any], blob: list[bytes] | None = None) -> None:
    """A reply: the JSON header, then the raw bytes of `blob` (their total length in the header's "blob")."""
    size = sum(len(b) for b in blob or ())
    if size:
        obj = dict(obj, blob=size)
    body = json.dumps(obj).encode()
    head = struct.pack(">I", len(body)) + body
    if size <= 1 << 16:  # one write (one wake-up of the reader) for a small reply
        _write_all(fd, b"".join([head, *(blob or ())]))
        return
    _write_all(fd, head)
    for b in blob or ():
        _write_all(fd, b)


# ---------------------------------------------------------------- the root
def _copy_etc(src_etc: str, dst_etc: str) -> None:
    os.makedirs(dst_etc, mode=0o755, exist_ok=True)
    for name in ETC_ENTRIES:
        host = os.path.join(src_etc, name)
        dst = os.path.join(dst_etc, name)
        if os.path.islink(host):
            os.symlink(os.readlink(host), dst)
        elif os.path.isdir(host):
            os.mkdir(dst, 0o755)
            bind(host, dst)
        elif os.path.isfile(host):
            shutil.copyfile(host, dst)
            os.chmod(dst, 0o644)


def _devices(r: str) -> None:
    os.makedirs(r + "/dev", mode=0o755, exist_ok=True)
    mount("tmpfs", r + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755")
    for name in DEV_NODES:
        host = "/dev/" + name
        if not os.path.exists(host):
            continue
        path = f"{r}/dev/{name}"
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.stat(host).st_rdev)
            os.chmod(path, 0o666)
        except PermissionError:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
            mount(host, path, None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx")):
        os.symlink(target, f"{r}/dev/{name}")
    os.mkdir(r + "/dev/shm", 0o755)  # (a mount point: the scratch tmpfs's shm is bound there)


def build_root(base: str, image: str, disk_mb: int) -> str:
    """In our mount namespace, on `base` (an empty directory): a small root-only tmpfs holding the session's scratch
    tmpfs at base/s (disk_mb: every writable place of the session lies in it) and its root at base/root. Returns
    how the root is made (for the guards)."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,nr_inodes=16,mode=0700")
    s, r = base + "/s", base + "/root"
    os.mkdir(s, 0o700)
    os.mkdir(r, 0o755)
    mount("tmpfs", s, "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_mb}m,nr_inodes={scratch_inodes(disk_mb)},mode=0700")
    if image == "host":
        mount("tmpfs", r, "tmpfs", MS_NOSUID, "size=4m,nr_inodes=8192,mode=0755")
        for d in SYSTEM_DIRS:
            host = "/" + d
            if os.path.islink(host):
                os.symlink(os.readlink(host), r + host)
            elif os.path.isdir(host):
                os.mkdir(r + host, 0o755)
                bind(host, r + host)
        _copy_etc("/etc", r + "/etc")
        for d in ("/root", "/home", "/var", "/var/tmp", "/run"):
            os.makedirs(r + d, mode=0o755, exist_ok=True)
        return "host system dirs read-only"
    # an overlay over the image root: writes go to its upper layer in the scratch tmpfs (bounded with the rest of
    # what the session writes), the image stays untouched
    os.mkdir(s + "/upper", 0o755)
    os.mkdir(s + "/work", 0o700)
    try:
        mount("overlay", r, "overlay", MS_NOSUID, f"lowerdir={image},upperdir={s}/upper,workdir={s}/work")
        return "overlay over the image (upper layer in the session's scratch tmpfs)"
    except OSError:
        bind(image, r)
        return "image bound read-only (overlayfs unavailable)"


def size_scratch(s: str, disk_mb: int) -> None:
    """The scratch tmpfs gets its session's size (a warm agent made it before its session was known)."""
    mount(None, s, None, MS_REMOUNT | MS_NOSUID | MS_NODEV, f"size={disk_mb}m,nr_inodes={scratch_inodes(disk_mb)}")


def open_root(r: str) -> None:
    """`SessionSpec.writable_root`: every directory of the session's overlay sticky and world-writable (a metadata
    copy-up into the session's own upper layer; the image is untouched). The session user can then add entries
    anywhere, but (sticky) not rename or remove the image's own, and the image's files keep their modes."""
    for dirpath, _dirs, _files in os.walk(r):
        st = os.lstat(dirpath)
        if stat.S_ISDIR(st.st_mode):
            os.chmod(dirpath, stat.S_IMODE(st.st_mode) | 0o1777)


def copy_seed(src: str, dst: str, uid: int) -> None:
    """The seed's tree into the (empty, fresh) workspace, every entry the session user's: directories, regular files
    (data, mode, mtime) and symlinks (as links, never followed); anything else (a FIFO, a device) is left out. Each
    file is opened O_NOFOLLOW and copied by the kernel (sendfile), owned and moded through its descriptor: a few
    syscalls a file, where shutil.copytree's copy2 plus a chown walk took twice as many."""
    dirs = []
    stack = [(src, dst)]
    while stack:
        sdir, ddir = stack.pop()
        with os.scandir(sdir) as it:
            for e in it:
                sp, dp = e.path, ddir + "/" + e.name
                st = e.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    os.mkdir(dp, 0o700)
                    dirs.append((dp, st))
                    stack.append((sp, dp))
                elif stat.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(sp), dp)
                    os.lchown(dp, uid, uid)
                    os.utime(dp, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
                elif stat.S_ISREG(st.st_mode):
                    _copy_file(sp, dp, st, uid)
    for dp, st in reversed(dirs):  # (modes last: a read-only directory of the seed is still filled)
        os.chown(dp, uid, uid)
        os.chmod(dp, stat.S_IMODE(st.st_mode))
        os.utime(dp, ns=(st.st_atime_ns, st.st_mtime_ns))


def _copy_file(src: str, dst: str, st: os.stat_result, uid: int) -> None:
    """One regular file of the seed (`copy_seed`): its data by sendfile, then its mode, owner and times."""
    fi = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fo = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except BaseException:
        os.close(fi)
        raise
    try:
        left, off = st.st_size, 0
        while left > 0:
            n = os.sendfile(fo, fi, off, min(left, 1 << 30))
            if n == 0:
                break
            off, left = off + n, left - n
        os.fchmod(fo, stat.S_IMODE(st.st_mode))
        os.fchown(fo, uid, uid)
        os.utime(fo, ns=(st.st_atime_ns, st.st_mtime_ns))
    finally:
        os.close(fo)
        os.close(fi)


def _root_only_dir(r: str) -> None:
    """SEED_DIR in the root `r`: a directory only root may enter (made here, after `open_root`)."""
    os.makedirs(r + SEED_DIR, mode=0o700, exist_ok=True)
    st = os.lstat(r + SEED_DIR)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.EEXIST, f"the image holds {SEED_DIR}, which the agent needs")
    os.chown(r + SEED_DIR, 0, 0)
    os.chmod(r + SEED_DIR, 0o700)


#: the root's own /etc/passwd and /etc/group before the session's user was added (read from the first root this agent
#: built), so that every later root gets exactly one line for its session's user
_PRISTINE: dict[str, bytes] = {}


def finish_root(r: str, s: str, workdir: str, uid: int, seed: str | int | None, image: str | None = None,
                fresh: bool = True) -> tuple[list[str], list[str]]:
    """The per-session part: /proc and /dev (`fresh`: a root no session has used yet), and the scratch tmpfs's
    directories bound as the workspace (a copy of the seed, the session user's), /tmp, /var/tmp and /dev/shm; the
    seed itself mounted read-only at SEED (for the diff): `seed` is a detached mount's descriptor
    (`_base.open_tree_clone`, passed by the trainer: attached here, then closed by the caller) or a host path (bound;
    reachable only before the first `switch_root`). `image` (an image's root): the image directory bound read-only at
    IMAGE, the lower layer of a recycled agent's next root. Returns the session's own mounts and the directories
    made for them, as paths of the root (what a reset of a kept root undoes: `reset`)."""
    if fresh:
        for d in ("/proc", "/tmp", "/dev"):
            os.makedirs(r + d, mode=0o755, exist_ok=True)
        _devices(r)
        mount("proc", r + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name, mode in (("tmp", 0o1777), ("vartmp", 0o1777), ("shm", 0o1777), ("ws", 0o755)):
        os.mkdir(f"{s}/{name}", mode)
        os.chmod(f"{s}/{name}", mode)
    os.chown(s + "/ws", uid, uid)
    mounts = ["/tmp", "/dev/shm"]
    bind(s + "/tmp", r + "/tmp", True, MS_NODEV)
    if os.path.isdir(r + "/var/tmp") and not os.path.islink(r + "/var/tmp"):
        bind(s + "/vartmp", r + "/var/tmp", True, MS_NODEV)
        mounts.append("/var/tmp")
    bind(s + "/shm", r + "/dev/shm", True, MS_NODEV)
    ws = r + workdir
    made = []
    d = posixpath.normpath(workdir)
    while d != "/" and not os.path.lexists(r + d):
        made.append(d)
        d = posixpath.dirname(d)
    os.makedirs(ws, mode=0o755, exist_ok=True)
    bind(s + "/ws", ws, True, MS_NODEV)
    mounts.append(posixpath.normpath(workdir))
    if image is not None:
        _root_only_dir(r)
        os.makedirs(r + IMAGE, mode=0o700, exist_ok=True)
        bind(image, r + IMAGE, False, MS_NODEV)
    if seed is not None:
        _root_only_dir(r)
        os.makedirs(r + SEED, mode=0o700, exist_ok=True)
        if isinstance(seed, int):
            move_mount_fd(seed, r + SEED)
            mount(None, r + SEED, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
        else:
            bind(seed, r + SEED, False, MS_NODEV | MS_NOEXEC)
        mounts.append(SEED)
        copy_seed(r + SEED, ws, uid)
        os.chmod(ws, 0o755)
    # the session's user has a name (git, whoami, getpwuid): added to the root's own copy of the user database (the
    # host image's is a copy in the root tmpfs, an image's is in the overlay's upper layer)
    for name, line in (("passwd", f"sandbox:x:{uid}:{uid}:sandbox:{workdir}:/bin/sh\n"),
                       ("group", f"sandbox:x:{uid}:\n")):
        path = f"{r}/etc/{name}"
        try:
            if os.path.isfile(path) and not os.path.islink(path):
                if name not in _PRISTINE:
                    with open(path, "rb") as f:
                        _PRISTINE[name] = f.read()
                old = _PRISTINE[name]
                with open(path, "wb") as f:
                    f.write(old + (b"\n" if old and not old.endswith(b"\n") else b"") + line.encode())
        except OSError:
            pass
    return mounts, made


def _ipc_limits() -> None:
    """Bound SysV IPC in the session's ipc namespace (IPC_LIMITS; best effort: a kernel may not offer them)."""
    for name, value in IPC_LIMITS:
        with contextlib.suppress(OSError):
            fd = os.open(f"/proc/sys/kernel/{name}", os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, value.encode())
            finally:
                os.close(fd)


def switch_root(r: str) -> str:
    """Make `r` our root: pivot_root and the old root detached, so nothing of the host's tree stays in the session's
    mount namespace; chroot where pivot_root fails (said in what this returns). Leaves the cwd at the new root."""
    os.chdir(r)
    try:
        _pivot_root(".", ".")  # the old root is now stacked on "/": detach it (pivot_root(2)'s own recipe)
        _umount2(".", MNT_DETACH)
        how = "pivot_root (the host's tree detached from the session's mount namespace)"
    except OSError as e:
        os.chroot(".")
        how = f"chroot (pivot_root failed: {e.strerror or e})"
    os.chdir("/")
    return how


def _set_oom_score_adj(value: int) -> None:
    fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, str(value).encode())
    finally:
        os.close(fd)


# ---------------------------------------------------------------- exec
def _kill_all_but_me() -> None:
    """SIGKILL every other process of the session (we are its pid 1: kill(-1) reaches all of them) and reap them."""
    for _ in range(100):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            while True:
                pid, _st = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
        except ChildProcessError:
            return
        time.sleep(0.001)


def _drop_to_session(st: dict[str, Any], extra_pids: int = 0) -> None:
    """What every process the session runs is confined by, applied to the calling process (inherited by whatever it
    starts): default signals, the OOM killer's first choice, rlimits, the session's uid and no groups, no_new_privs,
    and the sandbox's seccomp filter last."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    for s in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGPROF):
        signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    # what the session runs is the OOM killer's first choice (the agent is exempt, or at 0 where the host denies
    # us CAP_SYS_RESOURCE; with it this also becomes the floor the session's code cannot go below)
    _set_oom_score_adj(1000)
    lim = st["limits"]
    mem = lim["memory_mb"] << 20
    for res, v in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_NPROC, lim["pids"] + extra_pids),
                   (resource.RLIMIT_FSIZE, lim["disk_mb"] << 20), (resource.RLIMIT_CORE, 0),
                   (resource.RLIMIT_NOFILE, 4096)):
        resource.setrlimit(res, (v, v))
    uid = st["uid"]
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    _seccomp()  # the sandbox's filter (`rlf_envs.sandbox._seccomp`): the last step before the command


def _argv_env(req: dict[str, Any], st: dict[str, Any]) -> tuple[list[str], dict[str, str], str]:
    """A request's argv (a shell command under `bash -lc`, `sh -c` where the root has no bash), environment, cwd."""
    env = dict(st["env"])
    env.update(req.get("env") or {})
    if "shell" in req:
        sh = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
        argv = [sh, "-lc" if sh == "/bin/bash" else "-c", req["shell"]]
    else:
        argv = req["argv"]
    return argv, env, req.get("cwd") or st["workdir"]


def _child(req: dict[str, Any], st: dict[str, Any], stdin_fd: int, out_w: int, err_w: int) -> None:
    try:
        os.setsid()
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 65536)
        _drop_to_session(st)
        argv, env, cwd = _argv_env(req, st)
        os.chdir(cwd)
        try:
            os.execvpe(argv[0], argv, env)
        except OSError as e:
            os.write(2, f"{argv[0]}: {e.strerror}\n".encode())
            os._exit(127)
    except BaseException as e:
        try:
            os.write(2, f"session exec set-up failed: {e!r}\n".encode())
        finally:
            os._exit(126)


# ---------------------------------------------------------------- the launcher
class Launcher:
    """L: the session's launcher, forked by C once per session and confined once (`_drop_to_session`: the session's
    uid, rlimits, no_new_privs, the OOM killer's first choice, the seccomp filter), so that each exec is a
    vfork+exec of L (`subprocess.Popen`, ~0.4 ms of CPU) rather than a fork of C plus that set-up per call (~2.7 ms).
    Everything an exec starts is confined exactly as before: it inherits L's confinement.

    L runs with the session's uid but is not dumpable (a uid change from root clears that, and L clears it again):
    the session's processes can neither ptrace it nor open its /proc files or descriptors, so they cannot make it
    start anything or forge its replies; they can only signal it. Requests (SEQPACKET, one per exec): the argv
    (its executable resolved on PATH by L, with the session user's rights), cwd, env, with the exec's
    stdin/stdout/stderr as SCM_RIGHTS; L replies {"pid"} (or
    {"error", "code"}), then {"returncode"} when the command ends. An L that dies (killed by the session's code, a
    `kill -9 -1`, or by the OOM killer) is replaced at the next exec; the exec in flight goes on, its command (now
    C's child: C is pid 1) waited for on its pidfd. A stopped L holds that exec to its deadline, then is killed."""

    def __init__(self, st: dict[str, Any]) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - L
            try:
                self.sock.close()
                fd = theirs.fileno()
                for lo, hi in ((0, fd), (fd + 1, 65536)):  # nothing of C's but our socket (stdio: /dev/null)
                    os.closerange(max(lo, 3), hi)
                _drop_to_session(st, extra_pids=1)  # (L is one of the uid's processes: the policy keeps `pids`)
                prctl(PR_SET_DUMPABLE, 0)
                _set_name(b"rlf-launcher")
                launcher_main(theirs, st)
            finally:
                os._exit(1)
        theirs.close()
        self.pidfd = os.pidfd_open(self.pid)  # (L is ours and not reaped yet: this names L, never a reused pid)

    def alive(self) -> bool:
        return self.pid > 0

    def lost(self) -> None:
        """L is gone or unusable: kill it (we are root: a stopped L dies too) and never use it again. Returns once
        L has exited (bounded): its children are ours then. (A dying L closes its socket before the kernel re-parents
        its children: until then the command in flight is not yet our child, and its status not ours to read.)"""
        if self.pid > 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
                select.select([self.pidfd], [], [], LAUNCHER_EXIT_S)
            os.close(self.pidfd)
            self.pid = -1
        self.sock.close()


def launcher_main(sock: Any, st: dict[str, Any]) -> None:  # pragma: no cover - runs in L
    while True:
        try:
            msg, fds, _f, _a = socket.recv_fds(sock, 1 << 20, 3)
        except InterruptedError:
            continue
        if not msg:
            os._exit(0)
        req = json.loads(msg)
        try:
            if len(fds) != 3:
                raise OSError(errno.EBADF, "launcher: an exec needs its 3 descriptors")
            p = subprocess.Popen(req["argv"], executable=_resolve(req["argv"][0], req["env"]), stdin=fds[0],
                                 stdout=fds[1], stderr=fds[2], cwd=req["cwd"], env=req["env"],
                                 start_new_session=True, close_fds=True)
        except OSError as e:
            cwd_failed = getattr(e, "filename", None) == req["cwd"]
            kind = "limit" if e.errno in (errno.EAGAIN, errno.ENOMEM) else None
            text = (f"session exec set-up failed: {e!r}" if cwd_failed else f"{req['argv'][0]}: {e.strerror or e}")
            sock.send(json.dumps({"error": text, "errno": e.errno, "kind": kind,
                                  "code": 126 if cwd_failed or e.errno != errno.ENOENT else 127}).encode())
            continue
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(json.dumps({"pid": p.pid}).encode())
        # the command's status is read without reaping it (WNOWAIT) and reaped only once it is reported: an L killed in
        # between (the command's own `kill -9 -1` may reach it just as the command ends) leaves a zombie to C, which
        # reads the status itself; reaped first, that status would be lost with L
        w = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
        assert w is not None  # (None only with WNOHANG)
        code = w.si_status if w.si_code == os.CLD_EXITED else -w.si_status
        sock.send(json.dumps({"returncode": code}).encode())
        p.wait()


def _resolve(argv0: str, env: dict[str, str]) -> str:
    """The file an argv's first word names, found on the request's PATH as execvp would (a name with a slash is
    itself); the name itself where nothing matches (the exec then reports it missing)."""
    if "/" in argv0:
        return argv0
    for d in (env.get("PATH") or os.defpath).split(os.pathsep):
        full = os.path.join(d or ".", argv0)
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.stat(full).st_mode) and os.access(full, os.X_OK):
                return full
    return argv0


def _session_pids() -> set[int]:
    return {int(n) for n in os.listdir("/proc") if n.isdigit()} - {1}


def _reap_orphans() -> dict[int, int]:
    """Reap every exited child (orphans of the session are re-parented to us, pid 1); returns pid -> wait status."""
    got: dict[int, int] = {}
    try:
        while True:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            got[pid] = status
    except ChildProcessError:
        pass
    return got


def _kill_round(before: set[int]) -> bool:
    """SIGKILL once every process of the session that did not exist before the call; whether there was any."""
    new = _session_pids() - before
    for p in new:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return bool(new)


def _kill_new(before: set[int]) -> dict[int, int]:
    """SIGKILL every process of the session that did not exist before the call (what the call started, wherever it
    moved: a new session, a double fork), until none is left. Returns the wait statuses reaped on the way."""
    reaped: dict[int, int] = {}
    for _ in range(10000):
        if not _kill_round(before):
            break
        reaped.update(_reap_orphans())
        time.sleep(0.001)
    return reaped


def _exec_request(req: dict[str, Any]) -> float:
    """Check an exec request's fields (UserError naming the first bad one); returns its timeout."""
    if "shell" in req:
        if not isinstance(req["shell"], str):
            raise UserError(f"exec: shell must be a str, got {type(req['shell']).__name__}")
    else:
        argv = req.get("argv")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise UserError(f"exec: argv must be a non-empty list of str, got {_show(argv)}")
    timeout = req.get("timeout")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < 1e9:
        raise UserError(f"exec: timeout must be a positive number of seconds, got {_show(timeout)}")
    cwd = req.get("cwd")
    if cwd is not None:
        _check_path(cwd, "exec: cwd")
    env = req.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise UserError("exec: env must map str to str")
    return float(timeout)


#: how long the launcher may take to report a command killed at its deadline before it counts as lost
LAUNCHER_REPORT_S = 1.0
#: how long a killed launcher may take to exit (a process stuck in the kernel: we go on without it)
LAUNCHER_EXIT_S = 5.0


def _launcher(st: dict[str, Any]) -> Launcher | None:
    """The session's launcher, started (again) when there is none; None where it cannot run (then C forks)."""
    la = st.get("launcher")
    if la is not None and la.alive():
        return la
    if st.get("no_launcher"):
        return None
    try:
        st["launcher"] = la = Launcher(st)
    except OSError:
        st["no_launcher"] = True  # (the pids limit at its fork, say: C's own fork path serves every exec)
        return None
    return la


def _launch(la: Launcher, req: dict[str, Any], st: dict[str, Any], fds: tuple[int, int, int],
            before: set[int]) -> int | dict[str, Any] | None:
    """Ask L to start the exec: the command's pid, or a refusal ({"error", "code", "kind"}: L's, or L lost
    after it took the request: the command may have run, so it is never run again; whatever it started is killed);
    None: L was gone before it took the request, the caller forks instead."""
    argv, env, cwd = _argv_env(req, st)
    body = json.dumps({"argv": argv, "cwd": cwd, "env": env}).encode()
    try:
        socket.send_fds(la.sock, [body], list(fds))
    except OSError:
        la.lost()
        return None
    try:
        if not select.select([la.sock], [], [], 10)[0]:
            raise OSError(errno.ETIMEDOUT, "the launcher did not answer")
        msg = la.sock.recv(1 << 16)
        if not msg:
            raise OSError(errno.EPIPE, "the launcher is gone")
        reply: dict[str, Any] = json.loads(msg)
    except OSError as e:
        la.lost()
        _kill_new(before)
        return {"error": f"the session's launcher was lost while it started the command ({e.strerror or e}: killed "
                         "by the session's own processes?); what the command started is killed", "code": 137}
    if "pid" in reply:
        return int(reply["pid"])
    return reply


def do_exec(req: dict[str, Any], st: dict[str, Any], blob: Blob) -> tuple[dict[str, Any], list[bytes]]:
    cap = int(st["limits"]["output_bytes"])
    timeout = _exec_request(req)
    _reap_orphans()
    la = _launcher(st)  # (before the census: a launcher started now is not among what this exec started)
    before = _session_pids()
    memfd = os.memfd_create("stdin", os.MFD_CLOEXEC)
    try:
        while blob.left:
            _write_all(memfd, blob.read())
    except OSError as e:
        os.close(memfd)
        if e.errno in (errno.ENOMEM, errno.ENOSPC):
            raise LimitError("exec: the session's memory is full (its stdin does not fit)", "memory") from None
        raise
    os.lseek(memfd, 0, 0)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    t0 = time.monotonic()
    started = _launch(la, req, st, (memfd, out_w, err_w), before) if la is not None else None
    if isinstance(started, dict):  # L refused: what the exec's own set-up failed on
        for fd in (memfd, out_w, err_w, out_r, err_r):
            os.close(fd)
        if started.get("kind") == "limit":
            raise LimitError(f"exec: {started.get('error')}", "pids" if started.get("errno") == errno.EAGAIN
                             else "memory")
        err = (str(started.get("error", "exec failed")) + "\n").encode()[:cap]
        return ({"ok": True, "exit_code": int(started.get("code", 126)), "stdout": 0, "timed_out": False,
                 "truncated": False, "duration_s": time.monotonic() - t0}, [b"", err])
    cmd_fd = -1  # (the L path) a pidfd of the command: where to wait for it if L dies while it runs
    exit_is_pidfd = started is None  # what says the command ended: its pidfd (ours to close), or L's socket
    if started is not None:
        pid, exit_fd = started, la.sock.fileno()  # type: ignore[union-attr]
        with contextlib.suppress(OSError):  # (gone already: L's report of it is on its way)
            cmd_fd = os.pidfd_open(pid)
    else:
        try:
            pid = os.fork()
        except OSError as e:
            for fd in (memfd, out_r, out_w, err_r, err_w):
                os.close(fd)
            if e.errno == errno.EAGAIN:
                raise LimitError("exec: the session's processes hold all its pids", "pids") from None
            if e.errno == errno.ENOMEM:
                raise LimitError("exec: the session's memory is full", "memory") from None
            raise
        if pid == 0:  # pragma: no cover - the child
            _child(req, st, memfd, out_w, err_w)
        exit_fd = os.pidfd_open(pid)
    os.close(memfd)
    os.close(out_w)
    os.close(err_w)
    bufs = {out_r: bytearray(), err_r: bytearray()}
    truncated = False
    timed_out = False
    code: int | None = None
    deadline = t0 + timeout
    poller = select.poll()
    for fd in (out_r, err_r, exit_fd):
        poller.register(fd, select.POLLIN)
    open_fds = {out_r, err_r}

    def take(fd: int) -> None:
        nonlocal truncated
        b = os.read(fd, 65536)
        if not b:
            poller.unregister(fd)
            open_fds.discard(fd)
            return
        room = cap - len(bufs[fd])
        if room > 0:
            bufs[fd] += b[:room]
        if len(b) > max(room, 0):
            truncated = True

    def own_status() -> int:
        try:
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        except ChildProcessError:  # (never expected: L reaps a command only after reporting its status)
            return -signal.SIGKILL

    def ended() -> int | None:
        """The command's exit code once it ended: L's report, or (our own child) its wait status; None: L died while
        the command runs (its code may `kill -9 -1`), which is now our child: we wait for it on its pidfd."""
        nonlocal exit_fd, exit_is_pidfd, started
        if started is None:
            return own_status()
        msg = la.sock.recv(4096)  # type: ignore[union-attr]
        if msg:
            return int(json.loads(msg)["returncode"])
        la.lost()  # type: ignore[union-attr]
        if cmd_fd < 0:
            return -signal.SIGKILL
        started, exit_fd, exit_is_pidfd = None, cmd_fd, True
        poller.register(exit_fd, select.POLLIN)
        return None

    grace_end: float | None = None
    while open_fds or code is None:
        now = time.monotonic()
        end = deadline if grace_end is None else min(deadline, grace_end)
        if now >= end:
            timed_out = grace_end is None or now >= deadline
            break
        for fd, _ev in poller.poll((end - now) * 1000):
            if fd == exit_fd:
                poller.unregister(exit_fd)
                code = ended()
                if code is not None:
                    grace_end = time.monotonic() + 0.05  # what it started may still hold its output open
            else:
                take(fd)
    if timed_out and started is not None and code is None:
        # L reaps the command: kill what the call started once, and read L's report of it (so the next exec's first
        # reply is its own); an L that does not report within LAUNCHER_REPORT_S (stopped by the session's code: its
        # children then stay zombies) is killed, and its children come to us
        _kill_round(before)
        if select.select([exit_fd], [], [], LAUNCHER_REPORT_S)[0]:
            code = ended()
        else:
            la.lost()  # type: ignore[union-attr]
        if code is None:
            code = -signal.SIGKILL
    if timed_out:
        reaped = _kill_new(before)
        if code is None:
            code = os.waitstatus_to_exitcode(reaped[pid]) if pid in reaped else own_status()
    if exit_is_pidfd:  # (else it is L's socket: L's own, or closed with it)
        os.close(exit_fd)
    if cmd_fd >= 0 and cmd_fd != exit_fd:
        os.close(cmd_fd)
    for fd in list(open_fds):  # drain what is buffered, never wait for a writer
        for _ in range(64):
            if fd not in open_fds or not select.select([fd], [], [], 0)[0]:
                break
            take(fd)
    for fd in (out_r, err_r):
        os.close(fd)
    _reap_orphans()
    if timed_out:
        exit_code = 124
    else:
        assert code is not None
        exit_code = code if code >= 0 else 128 - code
    out, err = bytes(bufs[out_r]), bytes(bufs[err_r])
    return ({"ok": True, "exit_code": exit_code, "stdout": len(out), "timed_out": timed_out, "truncated": truncated,
             "duration_s": time.monotonic() - t0}, [out, err])


# ---------------------------------------------------------------- files
class _As:
    """Effective uid/gid of the session's user for a file operation (so it cannot be tricked into root's rights and
    what it creates belongs to the session's user; the agent holds no supplementary groups)."""

    def __init__(self, uid: int) -> None:
        self.uid = uid

    def __enter__(self) -> None:
        os.setegid(self.uid)
        os.seteuid(self.uid)

    def __exit__(self, *a: Any) -> None:
        os.seteuid(0)
        os.setegid(0)


def _check_path(p: Any, what: str = "path") -> str:
    """A path of a request (`_base.check_path`), UserError else."""
    return check_path(p, what, UserError)


def _components(st: dict[str, Any], p: str) -> list[str]:
    """The components of a request's path in the session's root: relative paths start at the workdir, `..` is
    resolved lexically and stops at the root."""
    full = p if p.startswith("/") else st["workdir"] + "/" + p
    return [c for c in posixpath.normpath("/" + full).split("/") if c]


#: whether openat2 works here (probed on first use; ENOSYS or a seccomp EPERM: the walk instead)
_OPENAT2: bool | None = None


def _probe_openat2() -> bool:
    global _OPENAT2
    if _OPENAT2 is None:
        try:
            os.close(_openat2(-100, "/", os.O_PATH | os.O_CLOEXEC, 0, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS))
            _OPENAT2 = True
        except OSError:
            _OPENAT2 = False
    return _OPENAT2


def open_in_root(root_fd: int, path: str, flags: int, mode: int = 0, *, openat2: bool | None = None) -> int:
    """Open `path` as a path of the root `root_fd` (relative paths too): `..` stops at the root, and magic links
    (/proc/*/fd/*, /proc/*/root, /proc/*/cwd, /proc/*/exe) are refused (ELOOP). With openat2 (Linux >= 5.6; the
    default where it works) symlinks resolve inside the root (RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS); without it
    (`openat2=False`) the path is walked a component at a time with O_NOFOLLOW and every symlink is refused (ELOOP)."""
    comps = [c for c in posixpath.normpath("/" + path).split("/") if c]
    use = _probe_openat2() if openat2 is None else openat2
    if use:
        return _openat2(root_fd, "/" + "/".join(comps), flags | os.O_CLOEXEC, mode,
                        RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    fd = os.dup(root_fd)
    try:
        for c in comps[:-1]:
            nfd = os.open(c, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
            kind = stat.S_IFMT(os.fstat(fd).st_mode)
            if kind == stat.S_IFLNK:
                raise OSError(errno.ELOOP, "a symbolic link (refused where the kernel has no openat2)", c)
            if kind != stat.S_IFDIR:
                raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), c)
        return os.open(comps[-1] if comps else ".", flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    finally:
        os.close(fd)


def _makedirs(root_fd: int, comps: list[str]) -> None:
    """Make the missing directories of `comps` (with the caller's rights: the session user's), never through a link
    that appears on the way."""
    i = len(comps)
    fd = -1
    while i > 0:
        try:
            fd = open_in_root(root_fd, "/" + "/".join(comps[:i]), os.O_PATH | os.O_DIRECTORY)
            break
        except FileNotFoundError:
            i -= 1
    if fd < 0:
        fd = os.dup(root_fd)
    try:
        for c in comps[i:]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(c, 0o755, dir_fd=fd)
            nfd = os.open(c, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), c)
    finally:
        os.close(fd)


def _regular(fd: int, st: dict[str, Any], shown: Any) -> None:
    """Refuse what is not a regular file of the session: /proc's files (the agent's own process among them), FIFOs,
    devices, directories."""
    s = os.fstat(fd)
    if s.st_dev == st["proc_dev"]:
        raise UserError(f"{_show(shown)}: /proc holds no file of the session")
    if not stat.S_ISREG(s.st_mode):
        raise UserError(f"{_show(shown)}: not a regular file")


def _root_fd() -> int:
    return os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def do_read(req: dict[str, Any], st: dict[str, Any], blob: Blob) -> tuple[dict[str, Any], list[bytes]]:
    path = _check_path(req.get("path"))
    comps = _components(st, path)
    chunks: list[bytes] = []
    with _As(st["uid"]):
        root = _root_fd()
        try:
            fd = open_in_root(root, "/" + "/".join(comps), os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        finally:
            os.close(root)
        try:
            _regular(fd, st, path)
            n = 0
            while True:
                b = os.read(fd, 1 << 20)
                if not b:
                    break
                n += len(b)
                if n > MAX_FILE:
                    raise UserError(f"{_show(path)}: larger than {MAX_FILE} bytes")
                chunks.append(b)
        finally:
            os.close(fd)
    return {"ok": True}, chunks


def do_write(req: dict[str, Any], st: dict[str, Any], blob: Blob) -> tuple[dict[str, Any], list[bytes]]:
    path = _check_path(req.get("path"))
    mode = req.get("mode", 0o644)
    if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o7777:
        raise UserError(f"write: mode must be an int from 0 to 0o7777, got {_show(mode)}")
    comps = _components(st, path)
    if not comps:
        raise UserError(f"{_show(path)}: a directory")
    with _As(st["uid"]):
        root = _root_fd()
        try:
            _makedirs(root, comps[:-1])
            fd = open_in_root(root, "/" + "/".join(comps), os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY,
                              mode)
        finally:
            os.close(root)
        try:
            _regular(fd, st, path)  # before anything is truncated or written
            os.ftruncate(fd, 0)
            while blob.left:
                _write_all(fd, blob.read())
        finally:
            os.close(fd)
    return {"ok": True}, []


_diff_armed = [False]


def _diff_cpu_spent(*a: Any) -> None:
    if _diff_armed[0]:
        _diff_armed[0] = False
        raise _DiffTooSlow("the workspace's diff ran out of CPU time (too much changed data to diff)", "diff_bytes")


def do_diff(req: dict[str, Any], st: dict[str, Any], blob: Blob) -> tuple[dict[str, Any], list[bytes]]:
    max_bytes = req.get("max_bytes", 64 << 20)
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
        raise UserError(f"diff: max_bytes must be a positive int, got {_show(max_bytes)}")
    uid = st["uid"]

    @contextlib.contextmanager
    def as_root() -> Iterator[None]:
        os.seteuid(0)
        os.setegid(0)
        try:
            yield
        finally:
            os.setegid(uid)
            os.seteuid(uid)

    # the workspace is read with the session user's rights, only what lies on its own filesystem (a link swapped in
    # mid-walk reaches nothing more than the session's own code could read); the seed, trusted, with ours. The CPU
    # it may take is bounded (a timer: the trainer's deadline for the call is that plus a grace), so pathological
    # files make the diff the policy's failure, not a lost agent
    with _As(uid):
        _diff_armed[0] = True
        signal.setitimer(signal.ITIMER_PROF, float(st["limits"]["exec_timeout_s"]))
        try:
            patch = gitdiff.diff_trees(st["seed"], st["workdir"], max_bytes=max(256 << 20, max_bytes),
                                       max_patch_bytes=max_bytes, old_access=as_root, one_filesystem=True)
        except gitdiff.DiffTooLarge as e:
            raise LimitError(str(e), "diff_bytes") from None
        finally:
            _diff_armed[0] = False
            signal.setitimer(signal.ITIMER_PROF, 0)
    return {"ok": True}, [patch.encode("utf-8", "surrogateescape")]


# ---------------------------------------------------------------- main
def serve(st: dict[str, Any]) -> Staged:
    """Answer requests one at a time, until "reset" (returns the next session's root, `reset`), "close" or EOF
    (exits). A reply's kind says whose failure an error is: "user" (the request's content: a bad path, type or
    mode, a missing file -- the caller's), "limit" (the session's own limits), "infra" (ours)."""
    ops = {"exec": do_exec, "read": do_read, "write": do_write, "diff": do_diff}
    while True:
        req = read_frame(0)
        if req is None or req.get("op") == "close":
            _kill_all_but_me()
            if req is not None:
                write_frame(1, {"ok": True})
            os._exit(0)
        if req.get("op") == "reset":
            try:
                staged = reset(st)
            except Exception as e:  # a session that cannot be reset is never used again: this agent ends
                write_frame(1, {"ok": False, "error": f"reset: {_show(e)}", "kind": "infra"})
                os._exit(2)
            write_frame(1, {"ok": True, "reset": req.get("n"), "how": staged.how})
            return staged
        n = req.get("blob", 0)
        blob = Blob(0, n if isinstance(n, int) and n > 0 else 0)
        name = req.get("op")
        out: list[bytes] = []
        try:
            op = ops.get(name) if isinstance(name, str) else None
            if op is None:
                raise UserError(f"unknown op {_show(name)}")
            reply, out = op(req, st, blob)
            blob.drain()
        except EOFError:
            _kill_all_but_me()
            os._exit(0)
        except UserError as e:
            reply = {"ok": False, "error": f"{name}: {e}", "kind": "user"}
        except LimitError as e:
            reply = {"ok": False, "error": f"{name}: {e}", "kind": "limit", "limit": e.limit}
        except MemoryError:
            reply = {"ok": False, "error": f"{name}: the session's memory is full", "kind": "limit",
                     "limit": "memory"}
        except OSError as e:
            reply = {"ok": False, "error": f"{name}: {e.strerror or e}", "kind": "user", "errno": e.errno}
        except (ValueError, TypeError, UnicodeError, KeyError, OverflowError) as e:  # from the request's content
            reply = {"ok": False, "error": f"{name}: {_show(e)}", "kind": "user"}
        except Exception as e:
            reply = {"ok": False, "error": f"{name}: {_show(e)}", "kind": "infra"}
        try:
            blob.drain()
        except EOFError:
            _kill_all_but_me()
            os._exit(0)
        write_frame(1, reply, out)


class Staged:
    """A root ready for `start_session`: its path `r` ("" is our own root), its scratch tmpfs `s`, how it is made,
    whether it is `fresh` (no /proc, /dev yet; switched to at start) or our own root, kept, and `image`: "host", or
    where the image its overlay lies over is reachable from here (the host's path before the first switch, IMAGE
    after: `finish_root` binds it there for the next reset)."""

    def __init__(self, r: str, s: str, how: str, fresh: bool, image: str) -> None:
        self.r, self.s, self.how, self.fresh, self.image = r, s, how, fresh, image


def reset(st: dict[str, Any]) -> Staged:
    """Make this agent ready for another session, leaving nothing of the last one: every other process of the pid
    namespace killed and reaped (none may be left), a fresh IPC namespace (the last one's SysV objects and POSIX
    queues go with it: nothing else holds it), and every place the session could write replaced. The host image's
    root is kept (nothing in it is the session's to write: root's tmpfs, read-only binds, root's files): the last
    session's mounts (its scratch tmpfs, workspace, /tmp, /var/tmp, /dev/shm, seed) are detached, the directories
    made for them removed, and a new scratch tmpfs mounted at SCRATCH. An image's root (an overlay, whose upper layer
    the session wrote) is built anew at STAGE, and `start_session` switches to it, detaching this one whole."""
    signal.alarm(0)
    la = st.pop("launcher", None)
    _kill_all_but_me()
    if la is not None:
        la.lost()
    left = _session_pids()
    if left:
        raise OSError(errno.EBUSY, f"{len(left)} of the session's processes could not be killed")
    os.chdir("/")
    _check(_libc.unshare(CLONE_NEWIPC), "unshare(CLONE_NEWIPC)")
    disk_mb = st["limits"]["disk_mb"]
    if st["image"] != "host":
        os.makedirs(STAGE, mode=0o700, exist_ok=True)
        return Staged(STAGE + "/root", STAGE + "/s", build_root(STAGE, st["image"], disk_mb), True, st["image"])
    for m in reversed(st["mounts"]):
        _umount2(m, MNT_DETACH)
    for d in st["made"]:  # (deepest first)
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(d)
    _root_only_dir("")
    os.makedirs(SCRATCH, mode=0o700, exist_ok=True)
    mount("tmpfs", SCRATCH, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={disk_mb}m,nr_inodes={scratch_inodes(disk_mb)},mode=0700")
    return Staged("", SCRATCH, "host system dirs read-only (the root kept, the session's mounts new)", False, "host")


def session_main(parent_fd: int) -> None:
    """C: pid 1 of the session's pid namespace. Builds a root (`prepare`), then serves sessions one after another:
    each `start` finishes the staged root and switches to it, `serve` answers the session's requests, and a
    "reset" stages the next root (`reset`) for the next `start`, until "close" or EOF."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if select.select([parent_fd], [], [], 0)[0]:  # P died before we asked to die with it
        os._exit(1)
    os.close(parent_fd)
    _set_name(b"rlf-session")
    signal.signal(signal.SIGALRM, lambda *a: os._exit(3))
    signal.signal(signal.SIGPROF, _diff_cpu_spent)
    prep = read_frame(0)
    if prep is None:
        os._exit(0)
    base, image = prep["root_mount"], prep["image"]
    try:
        _check(_libc.unshare(CLONE_NEWIPC), "unshare(CLONE_NEWIPC)")  # (ours alone: P stays out of it)
        how = build_root(base, image, prep["disk_mb"])
    except Exception as e:
        write_frame(1, {"ok": False, "error": f"building the session root: {e!r}", "kind": "infra"})
        os._exit(2)
    write_frame(1, {"ok": True, "how": how})
    staged = Staged(base + "/root", base + "/s", how, True, image)
    while True:
        start = read_frame(0)
        if start is None or start.get("op") == "close":
            os._exit(0)
        staged = serve(start_session(start, staged))


def _seed_fd(start: dict[str, Any]) -> int | None:
    """The seed's detached mount, sent by the trainer right after a start whose "seed_fd" is true: one byte with one
    descriptor (SCM_RIGHTS); read with recvmsg, never with a plain read (which would drop the descriptor)."""
    if not start.get("seed_fd"):
        return None
    sock = socket.socket(fileno=os.dup(0))
    try:
        sock.setblocking(True)
        msg, fds, _flags, _addr = socket.recv_fds(sock, 1, 2)
    finally:
        sock.close()
    if msg != b"\0" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise OSError(errno.EPROTO, f"the seed's descriptor did not come ({msg!r}, {len(fds)} descriptors)")
    return fds[0]


#: how this agent last switched to a fresh root (`switch_root`'s words), said again for a kept root
_ENTERED = [""]


def start_session(start: dict[str, Any], staged: Staged) -> dict[str, Any]:
    """Finish the `staged` root for the session `start` describes, switch to it (a fresh one), and reply; the
    session's state (`st`) for `serve`. Any failure is replied and ends the agent."""
    r, s, how = staged.r, staged.s, staged.how
    try:
        seed_fd = _seed_fd(start)
        lim = start["limits"]
        seed = seed_fd if seed_fd is not None else start.get("seed")
        size_scratch(s, lim["disk_mb"])
        if start.get("writable_root"):
            if not how.startswith("overlay"):
                raise OSError(f"writable_root needs overlayfs for the session's root ({how})")
            open_root(r)
        image = None if staged.image == "host" else staged.image
        mounts, made = finish_root(r, s, start["workdir"], start["uid"], seed, image, staged.fresh)
        if not staged.fresh:
            mounts.insert(0, SCRATCH)  # (undone last)
        if seed_fd is not None:
            os.close(seed_fd)  # (attached: closing it now leaves the seed mounted, and us holding nothing)
        _ipc_limits()
        _libc.sethostname(b"sandbox", 7)
        if staged.fresh:
            _ENTERED[0] = switch_root(r)
            how += "; " + _ENTERED[0]
        else:
            how += f"; {_ENTERED[0]}, for an earlier session (this root kept)"
        # nothing of the host stays open: stderr (the host's /dev/null) becomes the session's
        devnull = os.open("/dev/null", os.O_RDWR)
        os.dup2(devnull, 2)
        os.close(devnull)
        # the root agent imports nothing from the session's root (a writable root could plant a module there)
        sys.path[:] = []
        sys.path_importer_cache.clear()
        os.setgroups([])  # (so a file request made with the session user's uid has no group of root's either)
        proc_dev = os.stat("/proc").st_dev
        _probe_openat2()
        os.chdir(start["workdir"])
        if lim.get("session_timeout_s"):
            signal.alarm(int(lim["session_timeout_s"]) + 5)
    except Exception as e:
        write_frame(1, {"ok": False, "error": f"starting the session: {e!r}", "kind": "infra"})
        os._exit(2)
    st = {"limits": lim, "uid": start["uid"], "workdir": start["workdir"], "env": start["env"],
          "seed": SEED if seed is not None else None, "proc_dev": proc_dev,
          "image": "host" if image is None else IMAGE, "mounts": mounts, "made": made}
    _seccomp_prog()  # built before the first exec's fork
    # a recycled agent's next root is built from this one (`reset`): not where the image is only bound read-only
    write_frame(1, {"ok": True, "how": how + ("" if _OPENAT2 else "; file paths walked without openat2"),
                    "recyclable": how.startswith(("overlay", "host"))})
    return st


def agent_main(network: bool, parent: int) -> None:
    """P: in the host's pid namespace (forked by Z, `parent`, with its socket on fds 0 and 1)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # Z died before we asked to die with it
        os._exit(1)
    # (C unshares its IPC namespace itself, and again for each recycled session: no process outside the session,
    # P included, holds it, so the last session's SysV objects and POSIX queues go with the reset)
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWUTS | (0 if network else CLONE_NEWNET)
    _check(_libc.unshare(flags), "unshare")
    # the session's processes are re-parented to us when C (their pid 1) dies: we reap them, so that the session's
    # cgroups are empty when we exit (the host's init may reap late, or never)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    # P and C are exempt from the OOM killer where the host lets us (CAP_SYS_RESOURCE): inside the session's cgroup
    # it picks the policy's processes, whose every exec starts at 1000 (its first choice anyway); C inherits this
    with contextlib.suppress(OSError):
        _set_oom_score_adj(-1000)
    # our cwd is the old root, so C's pivot_root moves it (and our root) to the session's root with its own
    os.chdir("/")
    me = os.pidfd_open(os.getpid())
    pid = os.fork()
    if pid == 0:  # pragma: no cover - C
        try:
            session_main(me)
        finally:
            os._exit(1)
    os.close(me)
    os.close(0)
    write_frame(1, {"pid": pid})
    os.close(1)
    os.close(2)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, lambda *a: os.kill(pid, signal.SIGKILL))
    _, status = os.waitpid(pid, 0)
    signal.alarm(10)  # bounded: a process stuck in the kernel does not keep us (the owner then kills us)
    try:
        while True:  # the kernel SIGKILLed every process of the namespace when C died: reap them all
            os.waitpid(-1, 0)
    except ChildProcessError:
        pass
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _reap_agents(*_a: Any) -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def zygote() -> None:
    """Z: the backend's agent forker. Requests are SEQPACKET messages on fd 0, `{"network": bool}`; each gets a P
    (`agent_main`) and the reply `{"pid": P}` carries two descriptors: the backend's end of P's socket and a pidfd of
    P (so the backend waits for and kills exactly that process, never a reused pid). EOF: exit (the backend closes
    us only once its agents are gone; those left die with us). Z holds nothing but this socket: its environment is
    empty and it never reads a session's data."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(1)
    _set_name(b"rlf-zygote")
    _seccomp_prog()  # built once: every session's C inherits it
    signal.signal(signal.SIGCHLD, _reap_agents)
    ctl = socket.socket(fileno=0)
    me = os.getpid()
    while True:
        try:
            msg = ctl.recv(4096)
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            continue
        if not msg:
            os._exit(0)
        try:
            req = json.loads(msg)
            network = bool(req.get("network"))
        except (ValueError, AttributeError):
            ctl.send(json.dumps({"error": "bad request"}).encode())
            continue
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # no reaping between the fork and the pidfd: the pidfd must name P, not a process that reused its pid
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
        try:
            pid = os.fork()
        except OSError as e:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
            ours.close()
            theirs.close()
            ctl.send(json.dumps({"error": f"fork: {e.strerror or e}"}).encode())
            continue
        if pid == 0:  # pragma: no cover - P
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_SETMASK, [])
                os.dup2(theirs.fileno(), 0)
                os.dup2(theirs.fileno(), 1)
                os.closerange(3, 65536)  # Z's socket, our end's twin: P holds its own socket only
                agent_main(network, me)
            finally:
                os._exit(1)
        theirs.close()
        pidfd = os.pidfd_open(pid)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
        try:
            socket.send_fds(ctl, [json.dumps({"pid": pid}).encode()], [ours.fileno(), pidfd])
        finally:
            ours.close()
            os.close(pidfd)


if __name__ == "__main__":
    if "--zygote" in sys.argv:
        zygote()
    else:  # one agent on this process's own stdin/stdout (what Z forks, started by hand: debugging)
        agent_main("--network" in sys.argv, os.getppid())
