"""The sandbox supervisor: a trusted, stdlib-only process between the scoring process and untrusted code.

Started by `rlf_envs.sandbox.runner` as `python -I _supervisor.py` in a new session, with a JSON job on
stdin. It applies every containment guard the OS allows, starts the untrusted worker, and writes ONE
result line (prefixed with the job's nonce) to its stdout, which the worker never holds. See the
package docstring (`rlf_envs/sandbox/__init__.py`) for the design and why the verdict cannot be forged.

Do not import rlf_envs here: this file runs with a bare interpreter.
"""

from __future__ import annotations

import atexit
import base64
import builtins
import contextlib
import ctypes
import errno
import json
import os
import random
import resource
import select
import selectors
import signal
import socket
import stat
import struct
import sys
import time
import types
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE, MS_SLAVE = 4096, 16384, 1 << 18, 1 << 19
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NAME, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 15, 36, 38
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
#: the run's root filesystem (`_make_root`): a read-only tmpfs holding read-only binds of the system's programs and
#: libraries, a few files of /etc, the usual device nodes, the interpreter's directories, fresh bounded tmpfs
#: scratch dirs and the work dir; built at NEW_ROOT in the run's mount namespace, then made the worker's root
#: (`_enter_root`): nothing else of the host is reachable, whatever its permissions
NEW_ROOT = "/tmp"
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "passwd", "group", "nsswitch.conf", "hosts",
             "os-release")
DEV_NODES = ("null", "zero", "full", "random", "urandom")
MNT_DETACH, AT_FDCWD, AT_RECURSIVE = 2, -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 1, 2, 4
MOUNT_SETATTR = 442  # the same number on every architecture (Linux >= 5.12)
MAX_REPLY_BYTES = 8 << 20
MAX_JOB_BYTES = 256 << 20
PYTHON_INT_DIGITS = sys.get_int_max_str_digits()  # the default a fresh interpreter has
MAX_INT_DIGITS = 100_000
#: a pool's lease requests: an idle pre-confined supervisor (default jobs), a plain one forked on demand, or an
#: idle direct worker (a default `run` job as root: one process per run, see `_direct_child`)
CONFINED, PLAIN, DIRECT = b"g", b"p", b"d"
#: a direct worker's first byte on its job socket: pre-confined (it waits for a job), or not (it exits)
DIRECT_READY, DIRECT_UNCONFINED = b"+", b"-"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, arg, 0, 0, 0), f"prctl({option})")


def _set_name(name: bytes) -> None:
    """The process's name in ps/top/perf (`comm`, 15 bytes): rlf-sbx-zygote, rlf-sbx-super, rlf-sbx-run."""
    _libc.prctl(PR_SET_NAME, ctypes.cast(ctypes.c_char_p(name), ctypes.c_void_p).value or 0, 0, 0, 0)


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(s: str | None) -> bytes | None:
        return s.encode() if s is not None else None

    _check(_libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


class Deadline(BaseException):
    """The job's wall-clock deadline passed (raised in the supervisor by SIGALRM)."""


class SolutionError(Exception):
    """An exception raised inside the solution that has no builtin counterpart, or the solution died."""


class SolutionDied(SolutionError):
    pass


# ---------------------------------------------------------------------------------------------- guards


class Guards:
    """What this run is contained by; reported back to the scoring process."""

    def __init__(self) -> None:
        self.applied: dict[str, str] = {}  # guard -> how
        self.missing: dict[str, str] = {}  # guard -> why not

    def ok(self, name: str, how: str) -> None:
        self.applied[name] = how

    def no(self, name: str, why: str) -> None:
        self.missing[name] = why


def _world_traversable(path: str) -> bool:
    try:
        return bool(os.stat(path).st_mode & 0o001)
    except OSError:
        return False


def _hidden_top(path: str) -> str | None:
    """The top-most ancestor of `path` that other users cannot traverse (e.g. /root, mode 0700)."""
    parts = os.path.realpath(path).split("/")[1:]
    cur = ""
    for p in parts[:-1] if os.path.isfile(path) else parts:
        cur += "/" + p
        if not _world_traversable(cur):
            return cur
    return None


def _make_private_mounts(job: dict[str, Any], g: Guards, workdir: str) -> None:
    """In our new mount namespace: nothing propagates out; fresh tmpfs over /tmp, /var/tmp, /dev/shm (the
    work dir is bound back at its own path); directories other users cannot enter (a 0700 home holding the
    interpreter) are replaced by a tmpfs holding read-only binds of just the interpreter's directories."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    keep_fds: dict[str, int] = {workdir: os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)}
    hidden: dict[str, list[str]] = {}
    for p in job["python_dirs"]:
        top = _hidden_top(p)
        if top is not None and job["drop_uid"]:
            hidden.setdefault(top, []).append(p)
            keep_fds[p] = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
    # the interpreter's own directories under a private dir (e.g. a virtualenv in /tmp) are bound back,
    # read-only, at their own paths, so the fresh tmpfs does not hide the interpreter
    in_private = [p for p in job["python_dirs"] if any(p == d or p.startswith(d + "/") for d in PRIVATE_DIRS)
                  and not any(p in ds for ds in hidden.values())]
    for p in in_private:
        keep_fds.setdefault(p, os.open(p, os.O_RDONLY | os.O_DIRECTORY))
    size = _scratch_size(job)
    for d in PRIVATE_DIRS:
        if os.path.isdir(d):
            _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, f"{size},mode=1777")
    for p in in_private:
        os.makedirs(p, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{keep_fds[p]}", p, None, MS_BIND | MS_REC)
        _mount(None, p, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
    for top, dirs in hidden.items():
        os.makedirs(top, mode=0o755, exist_ok=True)  # gone if it was under a fresh private dir (/tmp/x/.tox)
        _mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
        for p in dirs:
            os.makedirs(p, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{keep_fds[p]}", p, None, MS_BIND | MS_REC)
            _mount(None, p, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
    if any(workdir == d or workdir.startswith(d + "/") for d in PRIVATE_DIRS):
        os.makedirs(workdir, mode=0o711, exist_ok=True)
        _mount(f"/proc/self/fd/{keep_fds[workdir]}", workdir, None, MS_BIND)
    os.chdir(workdir)
    for fd in keep_fds.values():
        os.close(fd)
    g.ok("private_tmp", "fresh tmpfs over " + ", ".join(PRIVATE_DIRS))
    if hidden:
        g.ok("hidden_dirs", ", ".join(sorted(hidden)))


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _bind(src: str, dst: str, writable: bool = False, device: bool = False) -> None:
    """Bind `src` (and what is mounted below it) at `dst`: nosuid, nodev (unless `device`: a device node's own bind)
    and, unless `writable`, read-only, all the way down (mount_setattr, Linux >= 5.12; before, the top mount only)."""
    _mount(src, dst, None, MS_BIND | MS_REC)
    attr = MOUNT_ATTR_NOSUID | (0 if device else MOUNT_ATTR_NODEV) | (0 if writable else MOUNT_ATTR_RDONLY)
    a = _MountAttr(attr, 0, 0, 0)
    if _libc.syscall(MOUNT_SETATTR, AT_FDCWD, dst.encode(), AT_RECURSIVE, ctypes.byref(a), ctypes.sizeof(a)) == 0:
        return
    if ctypes.get_errno() != errno.ENOSYS:
        _check(-1, f"mount_setattr {dst}")
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | (0 if device else MS_NODEV) | (0 if writable else MS_RDONLY)
    if os.statvfs(dst).f_flag & os.ST_NOEXEC:
        flags |= MS_NOEXEC  # a flag locked by a more privileged namespace must be kept
    _mount(None, dst, None, flags)


def _under(path: str, dirs: Any) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


_SNAPSHOT: tuple[list[str], list[tuple[str, str, Any]], list[tuple[str, int]]] | None = None


def _host_snapshot() -> tuple[list[str], list[tuple[str, str, Any]], list[tuple[str, int]]]:
    """What every root copies from the host, read once per process (the zygote, at start: its forks inherit it): the
    system directories that are directories (not links), the entries of ETC_FILES as (name, "link" | "dir" | "file",
    target | None | bytes), one level deep, and the device numbers of DEV_NODES."""
    global _SNAPSHOT
    if _SNAPSHOT is None:
        system = ["/" + d for d in SYSTEM_DIRS if os.path.isdir("/" + d) and not os.path.islink("/" + d)]
        etc: list[tuple[str, str, Any]] = []

        def add(name: str, depth: int) -> None:
            host = "/etc/" + name
            try:
                if os.path.islink(host):
                    etc.append((name, "link", os.readlink(host)))
                elif os.path.isdir(host) and depth == 0:
                    etc.append((name, "dir", None))
                    for sub in sorted(os.listdir(host)):
                        add(f"{name}/{sub}", 1)
                elif os.path.isfile(host):
                    with open(host, "rb") as f:
                        etc.append((name, "file", f.read(1 << 20)))
            except OSError:
                pass

        for name in ETC_FILES:
            add(name, 0)
        devs = [(n, os.stat("/dev/" + n).st_rdev) for n in DEV_NODES if os.path.exists("/dev/" + n)]
        _SNAPSHOT = (system, etc, devs)
    return _SNAPSHOT


def _system_dirs() -> list[str]:
    return _host_snapshot()[0]


def _own_python_dirs() -> list[str]:
    """What `runner._python_dirs` gives for this interpreter: the pool's template binds them while idle."""
    exe = sys.executable
    dirs = {os.path.dirname(os.path.dirname(os.path.realpath(exe))), os.path.dirname(os.path.dirname(exe)),
            sys.prefix, sys.base_prefix}
    return sorted(d for d in dirs if os.path.isdir(d))


#: a root built ahead of any job by an idle pooled supervisor or direct worker (`build_root`): where, and which of
#: the interpreter's directories it holds
_ROOT: tuple[str, frozenset[str]] | None = None
#: in the zygote and its forks: the empty directory (in the pool's base dir) where idle ones build that root
_ROOT_MOUNT: str | None = None
#: whether _ROOT is the zygote's, built once in its own mount namespace (as root) and so a copy in every namespace
#: its forks make: its tmpfs (read-only) is shared by all their runs, so it is never made writable
_SHARED = False


def _mountpoint(r: str, path: str) -> None:
    """Create `path` (absolute) in the root at `r`: in one of its scratch tmpfs, or in the root tmpfs itself, which
    is read-only once built (so made writable for the moment)."""
    if os.path.isdir(r + path):
        return
    if _under(path, PRIVATE_DIRS):
        os.makedirs(r + path, mode=0o755, exist_ok=True)
        return
    _mount(None, r, None, _root_flags(0))
    try:
        os.makedirs(r + path, mode=0o755, exist_ok=True)
    finally:
        _mount(None, r, None, _root_flags(MS_RDONLY))


def _root_flags(extra: int) -> int:
    """The root tmpfs's remount flags: as root it holds the device nodes (so no nodev); in a user namespace, nodev."""
    return MS_REMOUNT | MS_NOSUID | (0 if os.geteuid() == 0 else MS_NODEV) | extra


def _private_except(keep: str) -> None:
    """In our new mount namespace: nothing propagates out, and nothing in, except below `keep` (a shared mount of the
    host: `quota.share`), which becomes a slave: mounts the trainer makes there later (the work dirs' tmpfs) appear
    here and in every namespace copied from ours, never the other way round."""
    _mount(None, "/", None, MS_REC | MS_SLAVE)
    with open("/proc/self/mountinfo") as f:
        points = [ln.split()[4].encode().decode("unicode_escape") for ln in f]
    for p in points:
        if not _under(p, [keep]):
            with contextlib.suppress(OSError):
                _mount(None, p, None, MS_PRIVATE)


def build_root(r: str, python_dirs: list[str], keep_slave: str | None = None) -> frozenset[str]:
    """In our new mount namespace: build what every run's root has (see NEW_ROOT) at `r`, an existing directory,
    and make it read-only. Returns the interpreter directories bound in it. The per-run part (the scratch tmpfs,
    the work dir, hidden paths) is `_make_root`'s. On failure whatever was mounted is detached and the error
    raised. `keep_slave`: a directory whose mounts keep coming in from the host (`_private_except`)."""
    if keep_slave:
        _private_except(keep_slave)
    else:
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
    system = _system_dirs()
    dirs = [p for p in python_dirs if p != "/" and not _under(p, system)]
    keep_fds: dict[str, int] = {}
    old_umask = os.umask(0o022)
    try:
        for p in dirs:  # held open: `r` may hide them (a venv under /tmp)
            keep_fds[p] = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
        # as root the device nodes are made in it (they work only without nodev; the run can make none: no
        # CAP_MKNOD, and the root is read-only); in a user namespace they are binds of the host's
        root = os.geteuid() == 0
        _mount("tmpfs", r, "tmpfs", MS_NOSUID | (0 if root else MS_NODEV), "size=4m,nr_inodes=4096,mode=0755")
        try:
            _, etc, devs = _host_snapshot()
            for d in SYSTEM_DIRS:
                host = "/" + d
                if os.path.islink(host):
                    os.symlink(os.readlink(host), r + host)
                elif host in system:
                    os.mkdir(r + host)
                    _bind(host, r + host)
            os.mkdir(r + "/etc")
            for name, kind, data in etc:  # copies, not binds: fewer mounts to make and tear down per run
                path = f"{r}/etc/{name}"
                if kind == "link":
                    os.symlink(data, path)
                elif kind == "dir":
                    os.mkdir(path)
                else:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    try:
                        os.write(fd, data)
                    finally:
                        os.close(fd)
            for d in ("/dev", "/proc", "/var", *PRIVATE_DIRS):
                os.mkdir(r + d, 0o755)
            for name, rdev in devs:
                path = f"{r}/dev/{name}"
                try:
                    if not root:
                        raise PermissionError
                    os.mknod(path, stat.S_IFCHR | 0o666, rdev)
                    os.chmod(path, 0o666)
                except PermissionError:
                    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
                    _bind("/dev/" + name, path, writable=True, device=True)
            for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                                 ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
                os.symlink(target, r + "/dev/" + name)
            for p in dirs:
                if not _under(p, PRIVATE_DIRS):  # (those go into the run's fresh scratch tmpfs: per run)
                    os.makedirs(r + p, mode=0o755, exist_ok=True)
                    _bind(f"/proc/self/fd/{keep_fds[p]}", r + p)
            _mount(None, r, None, _root_flags(MS_RDONLY))  # the root itself: read-only
        except BaseException:
            _libc.umount2(r.encode(), MNT_DETACH)
            raise
    finally:
        os.umask(old_umask)
        for fd in keep_fds.values():
            os.close(fd)
    return frozenset(p for p in dirs if not _under(p, PRIVATE_DIRS))


def prebuild_root(r: str) -> None:
    """In an idle pooled supervisor or direct worker, inside its mount namespace: the static part of the run's root
    (`build_root`, for this interpreter), so that a run only adds its own part. A failure leaves it to the run."""
    global _ROOT
    try:
        _ROOT = (r, build_root(r, _own_python_dirs()))
    except OSError:
        _ROOT = None


def _make_root(job: dict[str, Any], g: Guards, workdir: str) -> None:
    """The run's root (see NEW_ROOT), in our new mount namespace: the static part built while idle
    (`prebuild_root`) or now, at NEW_ROOT; then the run's own part: fresh bounded tmpfs over its /tmp, /var/tmp and
    /dev/shm, the interpreter's directories not bound yet (read-only), the work dir (the only writable directory of
    the host) and `job["hide"]`, paths (task data) hidden even where they lie inside what is bound (an installed
    package's data in the interpreter's site-packages). The worker then makes it its root (`_enter_root`): nothing
    else of the host is visible, no /run, /home, /srv, /var, /sys, no checkout, no dataset, no Unix socket of the
    host. Raises OSError if the kernel refuses a step."""
    global _ROOT, _SHARED
    system = _system_dirs()
    dirs = [p for p in job["python_dirs"] if p != "/" and not _under(p, system)]
    if _ROOT is not None and _SHARED and not all(
            _under(p, PRIVATE_DIRS) or os.path.isdir(_ROOT[0] + p) for p in [workdir, *dirs] if p not in _ROOT[1]):
        # the zygote's root is shared (read-only) by every run: a mount point it lacks means a root of our own
        _libc.umount2(_ROOT[0].encode(), MNT_DETACH)
        _ROOT, _SHARED = (None, False)
    keep_fds: dict[str, int] = {}
    try:  # held open: NEW_ROOT may hide them (a work dir, a venv under /tmp)
        keep = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
        for p in dirs:
            keep_fds[p] = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
        how = " (built once by the pool's zygote)" if _SHARED else " (built while idle)" if _ROOT else ""
        if _ROOT is None:
            _ROOT = (NEW_ROOT, build_root(NEW_ROOT, job["python_dirs"]))
    except BaseException:
        for fd in keep_fds.values():
            os.close(fd)
        raise
    r, bound = _ROOT
    _ROOT, _SHARED = None, False  # one run per root (a shared one: this namespace's copy)
    dirs = [p for p in dirs if p not in bound]
    try:
        size = _scratch_size(job)
        for d in PRIVATE_DIRS:
            _mount("tmpfs", r + d, "tmpfs", MS_NOSUID | MS_NODEV, f"{size},mode=1777")
        for p in dirs:
            _mountpoint(r, p)
            _bind(f"/proc/self/fd/{keep_fds[p]}", r + p)
        _mountpoint(r, workdir)
        _bind(f"/proc/self/fd/{keep}", r + workdir, writable=True)
        for p in job.get("hide", ()):
            if os.path.isdir(r + p):
                _mount("tmpfs", r + p, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k,mode=0555")
            elif os.path.lexists(r + p):
                _bind("/dev/null", r + p)
    except BaseException:
        _libc.umount2(r.encode(), MNT_DETACH)
        raise
    finally:
        os.close(keep)
        for fd in keep_fds.values():
            os.close(fd)
    job["_new_root"], job["_root_cwd"] = r, workdir
    g.ok("minimal_root", "the run's root is a read-only tmpfs with read-only binds of " + ", ".join(system)
         + ", the interpreter and a few files of /etc; the device nodes " + ", ".join(DEV_NODES)
         + "; nothing else of the host" + how)
    g.ok("private_tmp", "fresh tmpfs over " + ", ".join(PRIVATE_DIRS) + f" ({size} each); the work dir is the only "
                        "writable directory of the host")


def _scratch_size(job: dict[str, Any]) -> str:
    """The tmpfs options bounding each scratch dir (/tmp, /var/tmp, /dev/shm): 4 x file_mb (at least 16 MB) and 1024
    inodes per MB (millions of empty files would be kernel memory the size limit does not count)."""
    mb = max(16, job["limits"]["file_mb"] * 4)
    return f"size={mb}m,nr_inodes={mb * 1024}"


def _run_cwd(job: dict[str, Any], workdir: str) -> str:
    """The work dir's path before the worker enters the run's root (there, inside NEW_ROOT); `_enter_root` then
    moves it to the work dir's own path."""
    return job["_new_root"] + job["_root_cwd"] if job.get("_new_root") else workdir


def _enter_root(root: str, workdir: str) -> None:
    """In the worker (pid 1 of the run's pid namespace), before it drops its privileges: mount its /proc in the root
    `_make_root` built and make that root its own (chroot). The host's tree stays mounted in the run's mount
    namespace, outside that root: getting out of a chroot takes a capability (CAP_SYS_CHROOT, CAP_SYS_ADMIN) and
    the worker holds none once set up (the run's uid; `_drop_capabilities` in a user namespace), no process of the
    run's pid namespace is outside it (so no /proc/<pid>/root leads out) and no descriptor of the host is left
    open. (pivot_root + detaching the host's tree cost ~4 ms of wall time per run, an RCU grace period.)"""
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chroot(root)
    os.chdir(workdir)


def _unshare(network: bool, g: Guards, new_pid: bool = True) -> bool:
    """Unshare pid/mount/ipc/uts (+net unless `network`); as non-root inside a new user namespace. Records the
    guards in `g`; returns whether the namespaces are in force (the next child is pid 1 of a new pid namespace).
    `new_pid=False`: no new pid namespace, for a direct worker, which is pid 1 of the one it was forked into."""
    flags = CLONE_NEWNS | (CLONE_NEWPID if new_pid else 0) | CLONE_NEWIPC | CLONE_NEWUTS
    if not network:
        flags |= CLONE_NEWNET
    uid, gid = os.geteuid(), os.getegid()
    user_ns = uid != 0
    try:
        _check(_libc.unshare(flags | (CLONE_NEWUSER if user_ns else 0)), "unshare")
    except OSError as e:
        g.no("namespaces", f"unshare refused ({e.strerror}); as non-root, unprivileged user namespaces may be "
                           "disabled (sysctl kernel.unprivileged_userns_clone / AppArmor userns restriction)")
        return False
    if user_ns:
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
        g.ok("user_ns", f"uid {uid} mapped to itself; the worker has no capabilities")
    g.ok("pid_ns", "the worker is pid 1 of its own pid namespace: it sees no outside process, and its death kills "
                   "every process it started")
    g.ok("ipc_uts_ns", "own IPC and hostname namespaces")
    if flags & CLONE_NEWNET:
        g.ok("net_ns", "own network namespace with no interfaces up: no network")
    else:
        g.no("net_ns", "network allowed by SandboxLimits.network=True")
    return True


#: set in a pooled supervisor that entered its namespaces while idle, before any job (see `preconfine`): whether
#: that worked, and the guards it recorded
_PRECONFINED: tuple[bool, Guards] | None = None


def preconfine(root_mount: str | None = None) -> None:
    """In an idle pooled supervisor, before it reads a job: enter the namespaces every default job gets (pid,
    mount, ipc, uts, net; a user namespace as non-root), so that creating them is not on a run's path. Only jobs
    with `namespaces=True, network=False` are sent to such a supervisor (`SandboxPool.lease(confined=True)`);
    everything per run (the private mounts, the run's uid, rlimits, the worker's fork) still happens per run.
    `root_mount`: an empty directory where the static part of the run's root is built now (`prebuild_root`)."""
    global _PRECONFINED
    g = Guards()
    _PRECONFINED = (_unshare(False, g), g)
    if _PRECONFINED[0] and root_mount:
        prebuild_root(root_mount)


def _enter_namespaces(job: dict[str, Any], g: Guards, workdir: str) -> bool:
    """The run's namespaces (entered now, or already by `preconfine`) and its private mounts. Returns whether
    the worker will be pid 1 of a new pid namespace."""
    lim = job["limits"]
    if _PRECONFINED is not None:
        if not lim["namespaces"] or lim["network"]:
            raise RuntimeError("a pre-confined sandbox supervisor got a job with namespaces off or network on "
                               "(rlf_envs.sandbox.runner must lease a plain one for it)")
        ok, pre = _PRECONFINED
        g.applied.update(pre.applied)
        g.missing.update(pre.missing)
        if not ok:
            return False
    elif not lim["namespaces"]:
        g.no("namespaces", "disabled by SandboxLimits.namespaces=False")
        return False
    elif not _unshare(lim["network"], g):
        return False
    _private_filesystem(job, g, workdir)
    return True


def _private_filesystem(job: dict[str, Any], g: Guards, workdir: str) -> None:
    """The run's own root (`_make_root`), or where the kernel refuses a step of it, the older private /tmp
    (`_make_private_mounts`: fresh tmpfs over /tmp, /var/tmp, /dev/shm, the rest of the host visible)."""
    try:
        _make_root(job, g, workdir)
        return
    except OSError as e:
        g.no("minimal_root", f"could not build the run's own root ({e}); it sees the host's files (read-only "
                             "where the run's uid cannot write), /tmp, /var/tmp and /dev/shm are private")
    try:
        _make_private_mounts(job, g, workdir)
    except OSError as e:
        g.no("private_tmp", f"mount failed ({e}); /tmp is shared with the host")


# ---------------------------------------------------------------------------------------------- worker


def _pidfd(pid: int) -> int | None:
    """A pidfd of `pid` (readable once that process has exited); None before Linux 5.3."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _parent_gone(parent_fd: int) -> bool:
    poller = select.poll()
    poller.register(parent_fd, select.POLLIN)
    return bool(poller.poll(0))


#: the seccomp filter every run gets (`_seccomp`), per audit arch: the kernel's key management calls (add_key,
#: request_key, keyctl) fail with EPERM; socket and socketpair only for SOCKET_FAMILIES (others EAFNOSUPPORT); io_uring
#: (whose IORING_OP_SOCKET opens a socket without socket(2)) fails with ENOSYS; on i386 the multiplexed socketcall,
#: whose arguments a filter cannot read, fails with EPERM (our interpreter is 64-bit: only an `int 0x80` gets there).
#: x32 calls are x86_64 numbers with bit 30 set (masked off below).
AUDIT_ARCH_X86_64, AUDIT_ARCH_I386, AUDIT_ARCH_AARCH64, AUDIT_ARCH_ARM = 0xC000003E, 0x40000003, 0xC00000B7, 0x40000028
KEY_SYSCALLS = {AUDIT_ARCH_X86_64: (248, 249, 250), AUDIT_ARCH_I386: (286, 287, 288),
                AUDIT_ARCH_AARCH64: (217, 218, 219), AUDIT_ARCH_ARM: (309, 310, 311)}
#: (socket, socketpair) per arch
SOCKET_SYSCALLS = {AUDIT_ARCH_X86_64: (41, 53), AUDIT_ARCH_I386: (359, 360), AUDIT_ARCH_AARCH64: (198, 199),
                   AUDIT_ARCH_ARM: (281, 288)}
SOCKETCALL_SYSCALLS = {AUDIT_ARCH_I386: (102,)}
IO_URING_SYSCALLS = (425, 426, 427)  # io_uring_setup, _enter, _register: the same on every arch
#: the only socket families a run may open: local sockets and IP (which its network namespace isolates). Not AF_VSOCK
#: (not namespaced: a channel between runs and to the hypervisor), AF_NETLINK (glibc's getaddrinfo falls back without
#: it), AF_PACKET, AF_BLUETOOTH, AF_ALG, ... (kernel attack surface a Python program does not need)
SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10}
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _seccomp_filter() -> list[tuple[int, int, int, int]]:
    """The classic BPF program of `_seccomp` (see KEY_SYSCALLS): per known arch, the refused calls return their
    errno and socket/socketpair are allowed for SOCKET_FAMILIES only (their first argument, an int: the low word);
    all else, and every other arch, is allowed. Assembled with symbolic labels (jumps are forward only)."""
    ld_w_abs, jeq_k, alu_and_k, ret_k = 0x20, 0x15, 0x54, 0x06
    prog: list[tuple[int, int, Any, Any]] = []  # (code, jt label, jf label, k); labels resolved below
    labels: dict[str, int] = {}

    def label(name: str) -> None:
        labels[name] = len(prog)

    def jeq(k: int, jt: str | int = 0, jf: str | int = 0) -> None:
        prog.append((jeq_k, jt, jf, k))  # type: ignore[arg-type]

    for arch in KEY_SYSCALLS:
        a = f"a{arch}"
        prog.append((ld_w_abs, 0, 0, 4))  # seccomp_data.arch
        jeq(arch, 0, f"{a}_end")
        prog.append((ld_w_abs, 0, 0, 0))  # seccomp_data.nr
        if arch == AUDIT_ARCH_X86_64:
            prog.append((alu_and_k, 0, 0, 0xBFFFFFFF))  # x32 numbers are x86_64's + 0x40000000
        for nr in KEY_SYSCALLS[arch] + SOCKETCALL_SYSCALLS.get(arch, ()):
            jeq(nr, "eperm")
        for nr in IO_URING_SYSCALLS:
            jeq(nr, "enosys")
        for nr in SOCKET_SYSCALLS[arch]:
            jeq(nr, "family")
        prog.append((ret_k, 0, 0, SECCOMP_RET_ALLOW))
        label(f"{a}_end")
    prog.append((ret_k, 0, 0, SECCOMP_RET_ALLOW))  # an arch we do not know
    label("family")
    prog.append((ld_w_abs, 0, 0, 16))  # seccomp_data.args[0], low 32 bits (little-endian)
    for fam in SOCKET_FAMILIES.values():
        jeq(fam, "allow")
    prog.append((ret_k, 0, 0, SECCOMP_RET_ERRNO | errno.EAFNOSUPPORT))
    label("allow")
    prog.append((ret_k, 0, 0, SECCOMP_RET_ALLOW))
    label("eperm")
    prog.append((ret_k, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM))
    label("enosys")
    prog.append((ret_k, 0, 0, SECCOMP_RET_ERRNO | errno.ENOSYS))
    out: list[tuple[int, int, int, int]] = []
    for i, (code, jt, jf, k) in enumerate(prog):
        def off(target: str | int, i: int = i) -> int:
            if isinstance(target, int):
                return target
            d = labels[target] - i - 1
            assert 0 <= d < 256, "seccomp jump out of range"
            return d

        out.append((code, off(jt), off(jf), k) if code == jeq_k else (code, 0, 0, k))
    return out


def _seccomp() -> None:
    """The run's seccomp filter (after PR_SET_NO_NEW_PRIVS; inherited by every process the code starts, kept across
    exec): no kernel keyrings -- keys outlive processes, a key added to a user keyring stays until reboot, its
    serial is listed in /proc/keys and, opened to all, any uid can read it: a channel from one run to the next, and
    per-uid kernel memory that one uid per run never gives back; sockets of SOCKET_FAMILIES only (AF_VSOCK is not
    isolated by the network namespace); no io_uring. Python code has no use for any of them."""
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(_seccomp_prog()), 0, 0), "seccomp")


_PROG: tuple[Any, Any] | None = None


def _seccomp_prog() -> Any:
    """The filter of `_seccomp` as the kernel takes it; made once per process (the zygote's forks inherit it)."""
    global _PROG
    if _PROG is None:
        ins = _seccomp_filter()
        arr = (_SockFilter * len(ins))(*[_SockFilter(*i) for i in ins])
        _PROG = (arr, _SockFprog(len(ins), ctypes.cast(arr, ctypes.POINTER(_SockFilter))))
    return _PROG[1]


def _drop_capabilities() -> None:
    """Empty effective, permitted and inheritable sets (capset): a worker forked inside a user namespace holds every
    capability there until it execs, enough to undo its mounts."""
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(_libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")


def _worker_preexec(job: dict[str, Any], pid_ns: bool, uid: int | None, nproc: int | None,
                    parent_fd: int | None = None, reset_signals: bool = True) -> Any:
    """The worker's own set-up, run in the child before the code. `parent_fd`: a pidfd of the supervisor
    (`_pidfd`), to notice that it died before the worker asked to die with it. `reset_signals=False`: the
    caller's signal state is already a fresh interpreter's (a direct worker, forked from the zygote)."""
    lim = job["limits"]

    def preexec() -> None:
        if reset_signals:
            _reset_signals()
        _join_cgroup(job)  # (before the root: the cgroup fs is outside it; before the uid: the run cannot leave it)
        if pid_ns and job.get("_new_root"):
            _enter_root(job["_new_root"], job["_root_cwd"])
        elif pid_ns:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        mem = lim["memory_mb"] << 20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_mb"] << 20,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim["max_open_files"],) * 2)
        if nproc is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        if uid is None and os.geteuid() != 0:
            _drop_capabilities()  # a forked worker keeps what its user namespace gave the supervisor
        _prctl(PR_SET_NO_NEW_PRIVS, 1)  # setuid binaries (su, sudo, ping) cannot regain privileges
        _seccomp()
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it: we die -> the worker dies
        # the supervisor may have died before the line above, and then no signal ever comes: its pidfd is
        # readable once it has exited (getppid() cannot tell in a new pid namespace: it is 0 either way)
        if parent_fd is not None:
            if _parent_gone(parent_fd):
                os._exit(111)
        elif os.getppid() != job["_supervisor_pid"] and not pid_ns:
            os._exit(111)

    return preexec


def _choose_identity(job: dict[str, Any], g: Guards) -> tuple[int | None, int | None]:
    """The uid the worker runs as (None: ours) and its RLIMIT_NPROC (None: no process-count guard)."""
    lim = job["limits"]
    want = lim["max_processes"]
    reachable = {"hidden_dirs", "minimal_root"} & set(g.applied)  # the run's uid can reach the interpreter
    blocked = [p for p in job["python_dirs"] if _hidden_top(p)] if not reachable else []
    if os.geteuid() == 0 and job["drop_uid"] is not None and blocked:
        g.no("uid", f"runs as root: the interpreter's directory {blocked[0]} is inside {_hidden_top(blocked[0])}, "
                    "which other uids cannot enter, and no mount namespace is available to expose it; install "
                    "Python in a world-readable place or set `python` to one")
        g.no("nproc", "RLIMIT_NPROC is ignored for root")
        return None, None
    if os.geteuid() == 0 and job["drop_uid"] is not None:
        uid = job["drop_uid"]
        g.ok("uid", f"runs as unprivileged uid {uid} (unique to this run): cannot signal, trace or read the "
                    "environment of root's processes, cannot write root's files")
        g.ok("nproc", f"RLIMIT_NPROC={want} on the run's own uid")
        return uid, want
    if os.geteuid() == 0:
        g.no("uid", "runs as root: " + job["drop_uid_reason"])
        g.no("nproc", "RLIMIT_NPROC is ignored for root")
        return None, None
    g.no("uid", "runs as the scoring process's own uid (not root, so it cannot switch to another uid)")
    if "user_ns" in g.applied:
        g.ok("nproc", f"RLIMIT_NPROC={want}, counted inside the run's own user namespace")
        return None, want
    base = len(_processes_of_uid(os.geteuid()))
    g.ok("nproc", f"RLIMIT_NPROC={base + want}: this uid's {base} processes + {want} (shared with your other "
                  "processes, approximate)")
    return None, base + want


def _run_identity(job: dict[str, Any], g: Guards) -> tuple[int | None, int | None]:
    """The guards every worker's set-up adds (session, fresh_worker for a forked one, uid, nproc, rlimits) and
    the uid and RLIMIT_NPROC it runs with (`_choose_identity`)."""
    g.ok("session", "own session and process group; the whole process tree is killed at the end")
    if job.get("fork_worker"):
        g.ok("fresh_worker", "forked from a clean template that never ran code (pool); nothing of another run")
    uid, nproc = _choose_identity(job, g)
    g.ok("rlimits", "address space {memory_mb} MB, CPU {cpu_s} s, file size {file_mb} MB, {max_open_files} "
                    "open files, no core dumps".format(**job["limits"]))
    g.ok("no_keyrings", "seccomp: add_key, request_key and keyctl fail with EPERM (no key of a run outlives it or "
                        "reaches another run)")
    g.ok("socket_families", "seccomp: socket and socketpair only for " + ", ".join(SOCKET_FAMILIES) + " (any other "
                            "family, AF_VSOCK and AF_NETLINK included, fails with EAFNOSUPPORT); no io_uring")
    return uid, nproc


# ------------------------------------------------------------------------------------------- memory cgroup
#
# RLIMIT_AS bounds each process of a run, not the run: a run of N processes could hold N x memory_mb. As root, every
# process of a run is put in a memory cgroup of its own (v2 where the memory controller is there, else v1) limited to
# memory_mb in all (resident memory, page cache and the tmpfs pages it writes; swap included where the kernel
# accounts it); the kernel's OOM killer acts inside it. Named `rlf-sbx-<owner pid>-<n>`: the owner (the supervisor, or
# the zygote for a direct worker) removes it once the run's processes are gone; a dead owner's are swept when a
# zygote starts. Without root (or a memory controller) the bound is RLIMIT_AS per process x RLIMIT_NPROC processes.

CGROUP_PREFIX = "rlf-sbx-"
#: where run cgroups are made: (directory, "v2" | "v1"), or the reason there is none; probed once per process
_CGROUP_PARENT: tuple[str, str] | str | None = None
#: the name of the cgroup of the next run forked here (set by the zygote before each fork; the cold path makes one)
_CGROUP_NAME: str | None = None


def _probe_cgroup_parent() -> tuple[str, str] | str:
    """Where this process may make memory cgroups, or why it may not."""
    if os.geteuid() != 0:
        return "not root: cgroups are not delegated to this uid"
    try:
        with open("/proc/self/cgroup") as f:
            lines = [ln.rstrip("\n").split(":", 2) for ln in f if ln.count(":") >= 2]
        with open("/proc/self/mountinfo") as f:
            mounts = [ln.split() for ln in f]
    except OSError as e:
        return f"cannot read /proc/self/cgroup or mountinfo ({e})"
    v2_mount = v1_mount = None
    for m in mounts:
        sep = m.index("-")
        fstype, opts = m[sep + 1], m[sep + 3].split(",") if len(m) > sep + 3 else []
        if fstype == "cgroup2" and v2_mount is None:
            v2_mount = m[4]
        elif fstype == "cgroup" and "memory" in opts and v1_mount is None:
            v1_mount = m[4]
    for hier, controllers, path in lines:
        if hier == "0" and controllers == "" and v2_mount is not None:
            here = os.path.normpath(v2_mount + "/" + path)
            try:
                with open(os.path.join(here, "cgroup.controllers")) as f:
                    available = f.read().split()
            except OSError:
                continue
            if "memory" not in available:
                continue
            # (no internal processes: our own cgroup holds us, so runs go beside it, in its parent)
            parent = here if os.path.normpath(path) == "/" else os.path.dirname(here)
            if parent == here:
                try:
                    with open(os.path.join(here, "cgroup.subtree_control"), "w") as f:
                        f.write("+memory")
                except OSError:
                    continue
            if os.access(parent, os.W_OK):
                return parent, "v2"
        if "memory" in controllers.split(",") and v1_mount is not None:
            here = os.path.normpath(v1_mount + "/" + path)
            if os.access(here, os.W_OK):
                return here, "v1"
    return "no writable memory cgroup (v2 memory controller or v1 memory hierarchy) for this process"


def _cgroup_parent() -> tuple[str, str] | str:
    global _CGROUP_PARENT
    if _CGROUP_PARENT is None:
        _CGROUP_PARENT = _probe_cgroup_parent()
    return _CGROUP_PARENT


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _memory_cgroup(job: dict[str, Any], g: Guards) -> None:
    """As root: make the run's memory cgroup (`job["_cgroup"]`, joined by the worker in its set-up, before it drops
    its uid) limited to memory_mb for all its processes together. Records the guard either way."""
    lim = job["limits"]
    where = _cgroup_parent()
    fallback = (f"memory_mb is RLIMIT_AS per process: the run's total is bounded by {lim['memory_mb']} MB x "
                f"{lim['max_processes']} processes")
    if isinstance(where, str):
        g.no("memory_cgroup", f"{where}; {fallback}")
        return
    parent, version = where
    path = os.path.join(parent, _CGROUP_NAME or f"{CGROUP_PREFIX}{os.getpid()}-0")
    limit = str(lim["memory_mb"] << 20)
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass
    except OSError as e:
        g.no("memory_cgroup", f"cannot make {path} ({e.strerror}); {fallback}")
        return
    try:
        if version == "v2":
            _write(os.path.join(path, "memory.max"), limit)
            if os.path.exists(os.path.join(path, "memory.swap.max")):
                _write(os.path.join(path, "memory.swap.max"), "0")
        else:
            _write(os.path.join(path, "memory.limit_in_bytes"), limit)
            if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
                with contextlib.suppress(OSError):
                    _write(os.path.join(path, "memory.memsw.limit_in_bytes"), limit)
    except OSError as e:
        _remove_cgroup(path)
        g.no("memory_cgroup", f"cannot limit {path} ({e.strerror}); {fallback}")
        return
    job["_cgroup"] = path
    g.ok("memory_cgroup", f"every process of the run is in one memory cgroup ({version}, {path}): "
                          f"{lim['memory_mb']} MB in all (resident, page cache, tmpfs writes, swap)")


def _join_cgroup(job: dict[str, Any]) -> None:
    """In the worker, before it drops its uid: enter the run's cgroup (every process it starts stays in it)."""
    if job.get("_cgroup"):
        _write(os.path.join(job["_cgroup"], "cgroup.procs"), "0")


def _remove_cgroup(path: str | None, wait_s: float = 0.2) -> bool:
    """rmdir the run's cgroup once its processes are gone (the kernel refuses while any is left: retried briefly)."""
    if not path:
        return True
    end = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > end:
                return False
            time.sleep(0.005)


def _sweep_cgroups() -> None:
    """Remove the empty run cgroups whose owner process is gone (a supervisor or zygote that was killed)."""
    where = _cgroup_parent()
    if isinstance(where, str):
        return
    try:
        names = [n for n in os.listdir(where[0]) if n.startswith(CGROUP_PREFIX)]
    except OSError:
        return
    for name in names:
        try:
            owner = int(name[len(CGROUP_PREFIX):].split("-", 1)[0])
            os.kill(owner, 0)
        except ProcessLookupError:
            _remove_cgroup(os.path.join(where[0], name), 0)
        except (ValueError, PermissionError):
            pass


def _worker_env(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}


# ------------------------------------------------------------------------------------------- the run


class Capture:
    """Capped capture of the worker's stdout and stderr, drained while we wait for anything else."""

    def __init__(self, fds: dict[str, int], cap: int) -> None:
        self.bufs = {name: bytearray() for name in fds}
        self.cap = cap
        self.overflow = False
        self.sel = selectors.DefaultSelector()
        for name, fd in fds.items():
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ, name)

    def pump(self, timeout: float, extra: int | None = None) -> bool:
        """Read what is ready; True if `extra` (another fd) became readable."""
        if extra is not None:
            self.sel.register(extra, selectors.EVENT_READ, None)
        try:
            for key, _ in self.sel.select(max(0.0, timeout)):
                if key.data is None:
                    return True
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    self.sel.unregister(key.fd)
                    continue
                buf = self.bufs[key.data]
                room = self.cap - len(buf)
                buf += chunk[: max(0, room)]
                if len(chunk) > room:
                    self.overflow = True
            return False
        finally:
            if extra is not None:
                self.sel.unregister(extra)

    def text(self, name: str) -> str:
        return self.bufs[name].decode("utf-8", errors="replace")


class Forked:
    """The `subprocess.Popen` surface `Worker` uses, for a worker forked (not exec'd) by a pooled supervisor."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def _wait(self, flags: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped by `_reap`: it is gone, its status with it
                self.returncode = -signal.SIGKILL
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._wait(os.WNOHANG)

    def wait(self) -> int | None:
        return self._wait(0)


def _fork_worker(preexec: Any, argv: list[str], stdin_fd: int, pass_fds: tuple[int, ...],
                 workdir: str, setup_fds: tuple[int, ...] = (), cwd: str | None = None) -> tuple[Forked, int, int]:
    """Fork the worker: the child sets itself up exactly as `subprocess.Popen(..., preexec_fn=preexec)` would
    (new session, fds 0/1/2 and `pass_fds` only, cwd, the minimal environment), then runs `argv`'s program in
    its own interpreter copy; `setup_fds` stay open through the set-up only. Raises OSError (with the child's
    reason) if the set-up failed."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    st_r, st_w = os.pipe()  # the child's set-up verdict: closed empty = ok, else the error text
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        _worker_child(preexec, argv, stdin_fd, out_w, err_w, st_w, pass_fds, workdir, setup_fds, cwd)
    for fd in (out_w, err_w, st_w):
        os.close(fd)
    status = bytearray()
    while chunk := os.read(st_r, 4096):
        status += chunk[: 4096 - len(status)]
    os.close(st_r)
    proc = Forked(pid)
    if status:
        proc.wait()
        for fd in (out_r, err_r):
            os.close(fd)
        raise OSError(errno.EPERM, status.decode(errors="replace"))
    return proc, out_r, err_r


def _close_fds_except(keep: set[int]) -> None:
    """Close every descriptor of this process but `keep`."""
    lo = 0
    for fd in sorted(keep):
        if fd > lo:
            os.closerange(lo, fd)
        lo = fd + 1
    os.closerange(lo, 1 << 20)


def _stdin_memfd(text: str) -> int:
    """A memory file holding `text`, read from its start: the run's stdin."""
    fd = os.memfd_create("stdin")
    os.write(fd, text.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _worker_child(preexec: Any, argv: list[str], stdin_fd: int, out_w: int, err_w: int, st_w: int,
                  pass_fds: tuple[int, ...], workdir: str, setup_fds: tuple[int, ...] = (),
                  cwd: str | None = None) -> None:  # pragma: no cover - runs in the child
    try:
        os.setsid()
        _set_name(b"rlf-sbx-run")
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        _close_fds_except({0, 1, 2, st_w, *pass_fds, *setup_fds})  # everything else goes: the result channel, the job
        os.chdir(cwd or workdir)  # (`cwd`: the work dir inside the run's root, `_run_cwd`)
        preexec()
        for fd in setup_fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(_worker_env(workdir))
        _default_signals()
        os.close(st_w)
    except BaseException as e:
        try:
            os.write(st_w, f"{type(e).__name__}: {e}".encode(errors="replace")[:2000] or b"set-up failed")
        finally:
            os._exit(127)
    _run_and_exit(argv)


def _run_and_exit(argv: list[str]) -> None:  # pragma: no cover - runs in the worker
    """Run the code (`_run_main`) and exit with its status, whatever happens."""
    status = 1
    try:
        status = _run_main(argv)
    except BaseException as e:  # our own bug, not the code's: say so on its stderr
        try:
            os.write(2, f"sandbox worker failed: {type(e).__name__}: {e}\n".encode(errors="replace"))
        except BaseException:
            pass
    finally:
        os._exit(status)


def _reset_signals() -> None:
    """Signal dispositions and mask as a fresh process has them, whatever the trainer was started with (a
    background job of a shell starts with SIGINT and SIGQUIT ignored, and exec keeps ignored signals). Part of
    every supervised worker's set-up (`_worker_preexec`), cold or forked; the zygote does it once for the direct
    workers it forks."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _default_signals() -> None:
    """After `_reset_signals`, what a fresh interpreter then installs itself: a forked worker runs no interpreter
    start-up, so a supervised one does it in its set-up (nothing of the supervisor's is left) and the zygote
    once for its direct workers."""
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _run_main(argv: list[str]) -> int:  # pragma: no cover - runs in the forked worker
    """Run `python -I <script> ...` / `python -I -c <src> ...` (argv) in this interpreter: a fresh `__main__`,
    fresh std streams, then the interpreter's own shutdown (threads joined, atexit, flush). Returns the status."""
    if argv[2] == "-c":
        src: str | bytes | None = argv[3]
        filename, sys.argv = "<string>", ["-c", *argv[4:]]
    else:
        src, filename, sys.argv = None, os.path.abspath(argv[2]), argv[2:]
    sys.set_int_max_str_digits(PYTHON_INT_DIGITS)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)  # noqa: SIM115
    for name in ("stdin", "stdout", "stderr"):  # as a fresh interpreter has them: the same objects
        setattr(sys, f"__{name}__", getattr(sys, name))
    random.seed()  # the template's generator state is shared by every fork: draw a fresh one, as python does
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    if src is None:
        main.__dict__["__file__"] = filename
    sys.modules["__main__"] = main
    status = 0
    try:
        if src is None:
            with open(filename, "rb") as f:
                src = f.read()
        exec(compile(src, filename, "exec"), main.__dict__)
    except SystemExit as e:
        status = _exit_status(e)
    except BaseException as e:
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # without our own frame
        try:
            sys.excepthook(type(e), e.with_traceback(tb), tb)
        except BaseException:
            pass
        status = 1
    threading = sys.modules.get("threading")
    try:
        if threading is not None:
            threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            status = status or 120
    return status


def _exit_status(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    try:
        print(e.code, file=sys.stderr)
    except BaseException:
        pass
    return 1


class Worker:
    def __init__(self, job: dict[str, Any], argv: list[str], pid_ns: bool, uid: int | None, nproc: int | None,
                 stdin_fd: int, pass_fds: tuple[int, ...], workdir: str) -> None:
        import subprocess

        parent_fd = _pidfd(os.getpid())  # for the worker's set-up to check that we are still alive
        preexec = _worker_preexec(job, pid_ns, uid, nproc, parent_fd)
        self.proc: subprocess.Popen[bytes] | Forked
        try:
            if job.get("fork_worker"):
                # pooled: fork this fresh supervisor (a copy of the zygote's clean template plus this run's public
                # job) instead of starting an interpreter; `argv` is then what the child runs in-process
                self.proc, out_fd, err_fd = _fork_worker(preexec, argv, stdin_fd, pass_fds, workdir,
                                                         () if parent_fd is None else (parent_fd,),
                                                         _run_cwd(job, workdir))
            else:  # (preexec_fn runs before close_fds: the child still has parent_fd there)
                self.proc = subprocess.Popen(
                    argv, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=_run_cwd(job, workdir),
                    env=_worker_env(workdir), close_fds=True, pass_fds=pass_fds, start_new_session=True,
                    preexec_fn=preexec,
                )
                assert self.proc.stdout and self.proc.stderr
                out_fd, err_fd = self.proc.stdout.fileno(), self.proc.stderr.fileno()
        finally:
            if parent_fd is not None:
                os.close(parent_fd)
        self.capture = Capture({"stdout": out_fd, "stderr": err_fd}, job["limits"]["max_output_bytes"])
        self.pid_ns, self.uid = pid_ns, uid
        self.killed = False
        # readable once the worker exits; None before Linux 5.3: we notice the exit within one pump interval
        self.exit_fd = _pidfd(self.proc.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill_tree(self) -> None:
        """SIGKILL the worker and everything it started, including descendants in new sessions."""
        if self.killed:
            return
        self.killed = True
        if self.pid_ns:
            # The worker is pid 1 of its namespace: when it dies the kernel kills every process in it. (Our
            # /proc now shows that namespace, so pids read from it must never be signalled from here.)
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            _reap()
            return
        for _ in range(50):
            victims = set(_descendants(os.getpid()))
            if self.uid is not None:
                victims |= _processes_of_uid(self.uid)
            if self.alive():
                victims.add(self.proc.pid)
            if not victims:
                break
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            _reap()
            time.sleep(0.002)
        self.proc.poll()


def _descendants(root: int) -> list[int]:
    """Every live process under `root` (we are a child subreaper, so orphans stay under us)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rfind(b")") + 2 :].split()
        if rest and rest[0] != b"Z":
            children.setdefault(int(rest[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _processes_of_uid(uid: int) -> set[int]:
    out = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    out.add(int(name))
            except OSError:
                pass
    return out


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _finish(w: Worker, deadline: float) -> int | None:
    """Wait (draining output) for the worker to exit or the deadline, then kill its whole tree."""
    timed_out = False
    while w.alive():
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        if w.capture.overflow:
            break
        w.capture.pump(min(left, 0.05), extra=w.exit_fd)
    code = w.proc.returncode
    w.kill_tree()
    end = time.monotonic() + 0.5  # what is still in the pipes (the writers are dead now)
    while w.capture.sel.get_map() and time.monotonic() < end:
        w.capture.pump(0.05)
    return None if timed_out else code


# ------------------------------------------------------------------------------ tests: trusted harness
#
# The tests run HERE, in the trusted supervisor; the solution runs in the worker. Each name the solution
# defines is a `Remote` proxy; calling it sends plain data to the worker and plain data comes back. Values
# are decoded strictly (JSON with type tags), so the test compares real ints/strs/lists built here: a
# returned object with a rigged __eq__ stays in the worker and compares unequal to any plain value.


class Channel:
    def __init__(self, w: Worker, req_fd: int, rep_fd: int, deadline: float) -> None:
        self.w, self.req, self.rep, self.deadline = w, req_fd, rep_fd, deadline
        self.buf = bytearray()
        os.set_blocking(rep_fd, False)

    def request(self, msg: dict[str, Any]) -> Any:
        if not self.w.alive():
            raise SolutionDied("the solution's process has exited")
        data = (json.dumps(msg) + "\n").encode()
        try:
            os.write(self.req, data)  # requests are small; the pipe buffer holds them
        except (BrokenPipeError, BlockingIOError):
            raise SolutionDied("the solution's process stopped reading") from None
        reply = self._read_line()
        if not isinstance(reply, dict) or len(reply) != 1:
            raise SolutionError("malformed reply from the solution's process")
        if "ok" in reply:
            return decode(reply["ok"], self)
        err = reply.get("err")
        if not (isinstance(err, list) and len(err) == 2 and all(isinstance(x, str) for x in err)):
            raise SolutionError("malformed reply from the solution's process")
        raise _exception(err[0], err[1][:2000], iteration=msg.get("op") == "op" and msg.get("name") == "next")

    def _read_line(self) -> Any:
        while True:
            nl = self.buf.find(b"\n")
            if nl >= 0:
                line = bytes(self.buf[:nl])
                del self.buf[: nl + 1]
                try:
                    return json.loads(line)
                except (ValueError, RecursionError):
                    raise SolutionError("undecodable reply from the solution's process") from None
            if len(self.buf) > MAX_REPLY_BYTES:
                raise SolutionError(f"reply larger than {MAX_REPLY_BYTES} bytes")
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise Deadline()
            if self.w.capture.pump(min(left, 0.05), extra=self.rep):
                try:
                    chunk = os.read(self.rep, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    raise SolutionDied("the solution's process closed its reply channel or exited")
                self.buf += chunk
            elif not self.w.alive():
                raise SolutionDied(f"the solution's process exited (status {self.w.proc.returncode})")
            if self.w.capture.overflow:
                raise SolutionDied("output limit exceeded")


#: exceptions that steer control flow: raised inside `all(map(f, xs))`, `next(it, default)`, `sum(...)`, a `for`
#: loop or a generator, a StopIteration ends the iteration early (so `all` of nothing passes), the others unwind the
#: harness itself. A solution's never arrives as one of them (`_exception`): it is a `SolutionRaised` instead.
CONTROL_FLOW = frozenset({"StopIteration", "StopAsyncIteration", "GeneratorExit", "KeyboardInterrupt", "SystemExit"})
_BUILTIN_EXC = {n: e for n, e in vars(builtins).items()
                if isinstance(e, type) and issubclass(e, Exception) and n not in CONTROL_FLOW}


class SolutionRaised(SolutionError):
    """The solution raised an exception that the tests must not see as itself (control flow, see CONTROL_FLOW);
    `name` is its type's name, and the message starts with it."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name


def _exception(name: str, message: str, iteration: bool = False) -> BaseException:
    """The test-side exception for one the solution raised (`name`, `message`): the builtin of that name where it
    carries no control flow, else a SolutionError. `iteration`: the reply to `next()` on a solution's iterator,
    whose StopIteration is the iterator protocol's own end (the only place one is passed on as itself)."""
    if iteration and name == "StopIteration":
        return StopIteration(message)
    exc = _BUILTIN_EXC.get(name)
    return exc(message) if exc is not None else SolutionRaised(name, message)


def decode(v: Any, ch: Channel, depth: int = 0) -> Any:
    if depth > 200:
        raise SolutionError("reply nested too deeply")
    if v is None or type(v) in (bool, int, float, str):
        return v
    if type(v) is list:
        return [decode(x, ch, depth + 1) for x in v]
    if type(v) is dict and len(v) == 1:
        (tag, x), = v.items()
        if tag == "h" and type(x) is int:
            return Remote(x, ch)
        if tag == "b" and type(x) is str:
            return base64.b64decode(x)
        if type(x) is list:
            items = [decode(i, ch, depth + 1) for i in x]
            if tag == "t":
                return tuple(items)
            if tag == "s":
                return set(items)
            if tag == "f":
                return frozenset(items)
            if tag == "d" and all(type(p) is list and len(p) == 2 for p in items):
                return {k: val for k, val in items}
            if tag == "c" and len(items) == 2:
                return complex(items[0], items[1])
    raise SolutionError("malformed value from the solution's process")


_TAGS: dict[type, str] = {tuple: "t", set: "s", frozenset: "f"}


def encode(v: Any, depth: int = 0) -> Any:
    """Test-side arguments: plain data and solution objects only."""
    if depth > 200:
        raise ValueError("argument nested too deeply")
    t = type(v)
    if v is None or t in (bool, int, float, str):
        return v
    if t is Remote:
        return {"h": object.__getattribute__(v, "_h")}
    if t is list:
        return [encode(x, depth + 1) for x in v]
    if t in _TAGS:
        return {_TAGS[t]: [encode(x, depth + 1) for x in v]}
    if t is dict:
        return {"d": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in v.items()]}
    if t is bytes:
        return {"b": base64.b64encode(v).decode()}
    if t is complex:
        return {"c": [v.real, v.imag]}
    raise TypeError(f"a test can pass only plain data (None, bool, int, float, str, bytes, list, tuple, dict, "
                    f"set) or the solution's own objects to the solution, not {t.__name__}")


class Remote:
    """A solution object. Operations on it are answered by the solution; comparing it with a plain value
    is never equal (and ordering raises TypeError), so a rigged __eq__/__lt__ cannot pass a test."""

    __slots__ = ("_ch", "_h")

    def __init__(self, h: int, ch: Channel) -> None:
        object.__setattr__(self, "_h", h)
        object.__setattr__(self, "_ch", ch)

    def _op(self, op: str, *args: Any) -> Any:
        ch = object.__getattribute__(self, "_ch")
        h = object.__getattribute__(self, "_h")
        return ch.request({"op": "op", "h": h, "name": op, "args": encode(list(args))})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        ch = object.__getattribute__(self, "_ch")
        return ch.request({"op": "getattr", "h": object.__getattribute__(self, "_h"), "name": name})

    def __setattr__(self, name: str, value: Any) -> None:
        self._op("setattr", name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ch = object.__getattribute__(self, "_ch")
        return ch.request({"op": "call", "h": object.__getattribute__(self, "_h"), "args": encode(list(args)),
                           "kwargs": encode(kwargs)})

    def _cmp(self, op: str, other: Any) -> Any:
        return self._op(op, other) if type(other) is Remote else NotImplemented

    def __eq__(self, other: object) -> Any:
        return self._cmp("eq", other)

    def __ne__(self, other: object) -> Any:
        return self._cmp("ne", other)

    def __lt__(self, other: Any) -> Any:
        return self._cmp("lt", other)

    def __le__(self, other: Any) -> Any:
        return self._cmp("le", other)

    def __gt__(self, other: Any) -> Any:
        return self._cmp("gt", other)

    def __ge__(self, other: Any) -> Any:
        return self._cmp("ge", other)

    __hash__ = object.__hash__

    def __len__(self) -> int:
        n = self._op("len")
        if type(n) is not int:
            raise TypeError("len() of a solution object did not return an int")
        return n

    def __bool__(self) -> bool:
        return self._op("bool") is True

    def __iter__(self) -> Any:
        return self._op("iter")

    def __next__(self) -> Any:
        return self._op("next")

    def __getitem__(self, key: Any) -> Any:
        return self._op("getitem", key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._op("setitem", key, value)

    def __delitem__(self, key: Any) -> None:
        self._op("delitem", key)

    def __contains__(self, item: Any) -> bool:
        return self._op("contains", item) is True

    def __repr__(self) -> str:
        try:
            r = self._op("repr")
        except Exception:
            return "<solution object>"
        return r if type(r) is str else "<solution object>"

    __str__ = __repr__


#: stdlib modules a solution's name may shadow that are not imported here to stand in for it (side effects)
_NOT_IMPORTED = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "webbrowser"})


def _test_namespace(names: dict[Any, Any]) -> dict[str, Any]:
    """The tests' globals: the solution's top-level names (proxies), except that no name of a builtin or of a stdlib
    module resolves to the solution's: `abs`, `len`, `sorted`, `set`, `math`, `re` stay the real ones here, whatever
    the solution defined (its own code, in the worker, still sees its own definitions). A stdlib module's name is
    the real module (imported here) even if the solution bound it to something else. Also the module `solution`
    (`import solution`, `from solution import f`) with all its names; `from solution import *` gets only the ones
    that shadow nothing. A rewritten worker may send any names: dunder names and non-identifiers are dropped."""
    import importlib

    ns: dict[str, Any] = {"__name__": "__test__", "__builtins__": builtins}
    own: dict[str, Any] = {}
    for k, v in names.items():
        if type(k) is not str or not k.isidentifier() or k.startswith("__"):
            continue
        own[k] = v
        if hasattr(builtins, k):
            continue  # the builtin stays (the test can still reach the solution's as solution.<name>)
        if k in sys.stdlib_module_names:
            if k in sys.modules or k not in _NOT_IMPORTED:
                try:
                    ns[k] = importlib.import_module(k)
                except Exception:
                    pass  # (not importable here: the test must import what it uses)
            continue
        ns[k] = v
    module = types.ModuleType("solution")
    module.__dict__.update(own)
    module.__all__ = [k for k in own if k in ns and ns[k] is own[k]]  # type: ignore[attr-defined]
    sys.modules["solution"] = module
    return ns


def _run_tests(ch: Channel, tests: list[str], results: list[bool], errors: list[str]) -> None:
    """Append one verdict per test to `results` (those done stay if the deadline interrupts us)."""
    try:
        ch.request({"op": "load"})
        names = ch.request({"op": "names"})
        if type(names) is not dict:
            raise SolutionError("malformed names")
    except Deadline:
        raise
    except BaseException as e:
        results += [False] * len(tests)
        errors += [f"solution failed to load: {type(e).__name__}: {e}"[:500]] * len(tests)
        return
    ns = _test_namespace(names)
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"test_{i}.py", "exec"), ns)
            results.append(True)
            errors.append("")
        except Deadline:
            raise
        except BaseException as e:
            results.append(False)
            errors.append(f"{type(e).__name__}: {e}"[:500])


# ------------------------------------------------------------------------------------------------ main


def _read_exact(fd: int, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))  # never more than asked: what follows stays in the kernel's buffer
        if not chunk:
            raise EOFError("the job ended early")
        buf += chunk
    return bytes(buf)


def read_frame(fd: int) -> dict[str, Any]:
    """One length-prefixed JSON object of the job (see `runner.frame`)."""
    (n,) = struct.unpack("!I", _read_exact(fd, 4))
    if n > MAX_JOB_BYTES:
        raise ValueError(f"job part of {n} bytes")
    job = json.loads(_read_exact(fd, n))
    if not isinstance(job, dict):
        raise ValueError("job part is not an object")
    return job


def _read_worker_src() -> str:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")) as f:
        return f.read()


def main(worker_src: str | None = None) -> None:
    """One run. The job comes in two frames on fd 0: the public part (what the worker may know: limits, work
    dir, script, stdin) and the private part (the nonce, the tests), read only after the worker exists, so a
    worker forked from us never holds the private part in its memory, nor any byte of it in a buffer."""
    job = read_frame(0)
    if not job.get("fork_worker"):
        _set_name(b"rlf-sbx-super")
    if "workdir" in job:
        os.chdir(job["workdir"])
    # read before the private mounts: a checkout under /tmp is not visible inside them
    worker_src = worker_src if worker_src is not None else _read_worker_src()
    sys.set_int_max_str_digits(MAX_INT_DIGITS)  # big answers decode; a 8 MB digit string does not stall us
    out_fd = os.dup(1)  # the result channel: only we hold it (the worker gets fresh pipes, close_fds)
    os.dup2(2, 1)  # anything the tests print goes to our stderr, never to the result channel
    start = time.monotonic()
    deadline = start + job["limits"]["timeout_s"]
    job["_supervisor_pid"] = os.getpid()
    g = Guards()
    result: dict[str, Any] = {}
    private: dict[str, Any] | None = None
    w: Worker | None = None
    try:
        workdir = os.getcwd()
        pid_ns = _enter_namespaces(job, g, workdir)  # first: a new user namespace's maps need us dumpable
        _prctl(PR_SET_DUMPABLE, 0)  # no /proc/<us>/{fd,mem,environ} and no ptrace for same-uid processes
        _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans (setsid'd grandchildren) reparent to us: we kill them
        g.ok("supervisor", "non-dumpable, child subreaper, holds the only copy of the result channel")
        uid, nproc = _run_identity(job, g)
        _memory_cgroup(job, g)
        mem = job["limits"]["memory_mb"] << 20
        if job["mode"] == "run":
            stdin_fd = _stdin_memfd(job["stdin"])
            w = Worker(job, [job["python"], "-I", job["script"]], pid_ns, uid, nproc, stdin_fd, (), workdir)
            os.close(stdin_fd)
            private = read_frame(0)
            result["exit_code"] = _finish(w, deadline)
            result["timed_out"] = result["exit_code"] is None and not w.capture.overflow
        else:
            req_r, req_w = os.pipe()
            rep_r, rep_w = os.pipe()
            devnull = os.open(os.devnull, os.O_RDONLY)
            w = Worker(job, [job["python"], "-I", "-c", worker_src, str(req_r), str(rep_w), job["script"]],
                       pid_ns, uid, nproc, devnull, (req_r, rep_w), workdir)
            for fd in (req_r, rep_w, devnull):
                os.close(fd)
            private = read_frame(0)
            resource.setrlimit(resource.RLIMIT_AS, (mem + (256 << 20),) * 2)  # the tests are bounded too
            signal.signal(signal.SIGALRM, _raise_deadline)
            signal.setitimer(signal.ITIMER_REAL, max(0.001, deadline - time.monotonic()))
            results: list[bool] = []
            errors: list[str] = []
            result["timed_out"] = False
            try:
                _run_tests(Channel(w, req_w, rep_r, deadline), private["tests"], results, errors)
            except Deadline:
                result["timed_out"] = True
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            n = len(private["tests"])
            result["results"] = (results + [False] * n)[:n]
            result["errors"] = (errors + ["deadline"] * n)[:n]
            w.kill_tree()
            result["exit_code"] = w.proc.returncode
            end = time.monotonic() + 0.5
            while w.capture.sel.get_map() and time.monotonic() < end:
                w.capture.pump(0.05)
    except Exception as e:  # a set-up step the OS refused (preexec_fn errors arrive as SubprocessError)
        result["error"] = f"the sandbox could not start the code: {type(e).__name__}: {e}"
        if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.ENOENT):
            result["error"] += f" (can the sandbox's uid execute {job['python']}? set `python` to one it can)"
    finally:
        if private is None:
            try:  # the worker never started: the nonce is still needed to report why
                private = read_frame(0)
            except Exception:
                private = {}
        result["nonce"] = private.get("nonce")
        if w is not None:
            w.kill_tree()
            result["stdout"] = w.capture.text("stdout")
            result["stderr"] = w.capture.text("stderr")
            result["output_truncated"] = w.capture.overflow
        _remove_cgroup(job.get("_cgroup"))
        result["guards"], result["missing_guards"] = g.applied, g.missing
        os.write(out_fd, ("\n" + json.dumps(result) + "\n").encode())


def _raise_deadline(signum: int, frame: Any) -> None:
    raise Deadline()


# ------------------------------------------------------------------------------------------ the zygote
#
# `python -I _supervisor.py --zygote SIZE BASE_DIR PRELOAD`, started once per pool by `rlf_envs.sandbox.pool` with a
# SOCK_SEQPACKET control socket as fd 0. It imports what a run needs, then only forks: it keeps up to SIZE
# idle supervisors (each a fresh fork of this clean template that has entered the default namespaces,
# `preconfine`, and is blocked reading its job), hands one out per CONFINED request (its job/result socket, its
# stderr socket and a pidfd, by SCM_RIGHTS) and forks a replacement after replying, off the hot path; a PLAIN
# request (a job with namespaces off or network on) gets a supervisor forked for it that enters nothing ahead.
# It never reads a job, runs code or holds anything of a run. When the
# control socket closes (pool closed, or the trainer died, even by SIGKILL) it kills every supervisor it
# forked (their workers die with them: PDEATHSIG, pid namespace) and removes BASE_DIR (the pool's work dirs).


def _spawn_supervisor(worker_src: str, confined: bool) -> tuple[int, int, int, int]:
    """Fork one idle supervisor (`confined`: it enters the default namespaces at once, see `preconfine`); returns
    (pid, pidfd, job/result socket fd, stderr socket fd), our ends."""
    job_ours, job_theirs = (s.detach() for s in socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM))
    err_ours, err_theirs = (s.detach() for s in socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM))
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the supervisor
        status = 0
        try:
            os.setsid()
            _set_name(b"rlf-sbx-super")
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the zygote dies -> we die (and our worker with us)
            if os.getppid() != parent:
                os._exit(1)
            os.dup2(job_theirs, 0)
            os.dup2(job_theirs, 1)
            os.dup2(err_theirs, 2)
            os.closerange(3, 1 << 20)  # the control socket, the other idle supervisors' sockets
            if confined:
                preconfine(_ROOT_MOUNT)
            main(worker_src)
        except BaseException:
            status = 1
            try:
                import traceback

                traceback.print_exc()
            except BaseException:
                pass
        finally:
            os._exit(status)
    os.close(job_theirs)
    os.close(err_theirs)
    return pid, os.pidfd_open(pid), job_ours, err_ours


def _direct_child(job_fd: int, out_w: int, err_w: int, zygote_fd: int) -> None:  # pragma: no cover - the worker
    """A direct worker: forked by the zygote as pid 1 of a new pid namespace, for one default `run` job as root
    (namespaces on, network off). There is no supervisor process: the scoring process holds the read ends of its
    stdout/stderr pipes, its deadline and a pidfd to kill it (its death kills its whole pid namespace), and the
    zygote, its parent, reports its wait status. It enters its namespaces while idle, then reads the public job
    on `job_fd` (a `run` job has no private part), sets itself up exactly as a supervised worker is set up
    (private mounts, the run's uid, rlimits, no_new_privs, death with the zygote, a minimal environment, default
    signals), sends its guards (or its set-up error) as one JSON line, closes `job_fd` and runs the code
    in-process. Nothing of the job is in its memory before it read it, and it serves exactly one run."""
    try:
        os.setsid()
        _set_name(b"rlf-sbx-run")
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the zygote dies -> we die (and our pid namespace with us)
        if _parent_gone(zygote_fd):
            os._exit(1)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        _close_fds_except({0, 1, 2, job_fd, zygote_fd})  # the control socket, the other workers' fds go
        g = Guards()
        ok = _unshare(False, g, new_pid=False)
        if ok and _ROOT_MOUNT:
            prebuild_root(_ROOT_MOUNT)
        os.write(job_fd, DIRECT_READY if ok else DIRECT_UNCONFINED)
        if not ok:
            os._exit(0)
        job = read_frame(job_fd)
        lim = job["limits"]
        if job.get("mode") != "run" or not lim["namespaces"] or lim["network"]:
            raise RuntimeError("a direct sandbox worker got a job that is not a default run (rlf_envs.sandbox.runner "
                               "must lease a supervisor for it)")
        workdir = job["workdir"]
        _private_filesystem(job, g, workdir)
        g.ok("supervisor", "the scoring process holds the output pipes, the deadline and a pidfd; the zygote "
                           "reports the exit status; the worker holds neither")
        uid, nproc = _run_identity(job, g)
        _memory_cgroup(job, g)
        stdin_fd = _stdin_memfd(job["stdin"])
        os.dup2(stdin_fd, 0)
        os.close(stdin_fd)
        os.chdir(_run_cwd(job, workdir))
        _worker_preexec(job, True, uid, nproc, zygote_fd, reset_signals=False)()  # the zygote's are a fresh one's
        os.close(zygote_fd)
        os.environ.clear()
        os.environ.update(_worker_env(workdir))
        os.write(job_fd, (json.dumps({"guards": g.applied, "missing_guards": g.missing}) + "\n").encode())
        os.close(job_fd)
    except BaseException as e:
        try:
            msg = f"the sandbox could not start the code: {type(e).__name__}: {e}"
            os.write(job_fd, (json.dumps({"error": msg[:2000]}) + "\n").encode())
        finally:
            os._exit(127)
    _run_and_exit([job["python"], "-I", job["script"]])


def _spawn_direct(pid_ns_fd: int) -> tuple[int, int, list[int], int]:
    """Fork one idle direct worker as pid 1 of a new pid namespace (`pid_ns_fd`: ours, to return to). Returns
    (pid, pidfd, [job socket, stdout, stderr, status] our ends for the scoring process, the status pipe's write
    end that we keep: we write the worker's wait status there when we reap it)."""
    job_ours, job_theirs = (s.detach() for s in socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM))
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    st_r, st_w = os.pipe()
    zygote_fd = os.pidfd_open(os.getpid())
    _check(_libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")  # our next child is pid 1 of a new namespace
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the worker
            _direct_child(job_theirs, out_w, err_w, zygote_fd)
    finally:
        if _libc.setns(pid_ns_fd, CLONE_NEWPID) != 0:  # back: supervisors must not be forked into that namespace
            os._exit(3)
    for fd in (job_theirs, out_w, err_w, zygote_fd):
        os.close(fd)
    return pid, os.pidfd_open(pid), [job_ours, out_r, err_r, st_r], st_w


def _direct_pid_ns() -> int | None:
    """Our pid namespace, if we may fork direct workers into new ones and come back (as root), else None."""
    if os.geteuid() != 0:
        return None  # a new user namespace per run would be needed: the supervised path does that
    try:
        fd = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    if _libc.unshare(CLONE_NEWPID) != 0:
        os.close(fd)
        return None
    if _libc.setns(fd, CLONE_NEWPID) != 0:
        os._exit(3)  # our children would go into a new pid namespace: never fork like that
    return fd


def _warm_up() -> None:
    """What every run would otherwise pay first, once in the template: the compiler's lazily built state (the
    AST node types: a first `compile` in a fresh process costs ~2 ms, the next ones ~30 us) and the text
    streams' codec lookups, as `_run_main` uses them. Nothing of a run: the same for all."""
    compile(b"x = [i for i in range(3)]\nprint(x)\n", "<warm-up>", "exec")
    with open(os.devnull, "w", encoding="utf-8", errors="backslashreplace", buffering=1) as f:
        f.write("")
    with open(os.devnull, encoding="utf-8") as f:
        f.read()
    _host_snapshot()  # what each run's root copies from the host
    _cgroup_parent()  # where runs' memory cgroups go
    _seccomp_prog()


def _load_sibling(name: str) -> Any:
    """A stdlib-only module of this package, loaded by path (this file runs as a bare interpreter's script)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_rlf_sandbox_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def zygote(size: int, base_dir: str, preload: list[str]) -> None:
    import importlib
    import subprocess  # noqa: F401 - the template has what a run imports, so no run pays for it
    import threading  # noqa: F401

    _set_name(b"rlf-sbx-zygote")
    # signal dispositions and mask as a fresh interpreter has them, once: a direct worker forked from us keeps
    # them (the trainer may run as a background job, whose ignored signals exec keeps); we change none later
    _reset_signals()
    _default_signals()
    for name in preload:  # modules the code is likely to import: each run gets them already imported
        try:
            importlib.import_module(name)
        except ImportError:
            pass

    import gc

    worker_src = _read_worker_src()
    _warm_up()
    gc.freeze()  # the template's objects are never scanned by a fork's collector: fewer copy-on-write faults
    ctrl = socket.socket(fileno=os.dup(0))
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.chdir("/")
    pid_ns_fd = _direct_pid_ns()
    global _ROOT_MOUNT, _ROOT, _SHARED
    root_mount = os.path.join(base_dir, ".root")
    try:
        os.mkdir(root_mount, 0o700)
    except OSError:  # (each run builds its whole root then)
        root_mount = ""
    if root_mount and os.geteuid() == 0:
        # as root: the static part of every run's root, once, in a mount namespace of our own; each supervisor or
        # direct worker we fork copies it when it makes its own (no mount of it on a run's path, nor idle)
        try:
            _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
            _ROOT, _SHARED = (root_mount, build_root(root_mount, _own_python_dirs(), keep_slave=base_dir)), True
        except OSError:
            _ROOT, _SHARED = None, False
    if root_mount and _ROOT is None:
        _ROOT_MOUNT = root_mount  # each idle supervisor or direct worker builds it in its own namespace
    children: set[int] = set()
    _sweep_cgroups()  # what killed supervisors and zygotes left
    cgroups: dict[int, str] = {}  # child pid -> the cgroup name its run makes (`_memory_cgroup`)
    forks = 0
    idle: list[tuple[int, int, int, int]] = []
    # direct workers: idle ones (pid, pidfd, the scoring process's fds, status write end); the status write end
    # and pidfd of each leased one, until we reap it
    direct_idle: list[tuple[int, int, list[int], int]] = []
    leased: dict[int, tuple[int, int]] = {}
    ready = selectors.DefaultSelector()
    ready.register(ctrl, selectors.EVENT_READ, None)

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                return
            if pid == 0:
                return
            children.discard(pid)
            forget_cgroup(pid)
            for entry in [e for e in idle if e[0] == pid]:  # an idle one died (killed from outside)
                idle.remove(entry)
                for fd in entry[1:]:
                    os.close(fd)
            for d in [e for e in direct_idle if e[0] == pid]:
                direct_idle.remove(d)
                for fd in (d[1], *d[2], d[3]):
                    os.close(fd)
            if pid in leased:
                pidfd, st_w = leased.pop(pid)
                ready.unregister(pidfd)
                os.close(pidfd)
                try:
                    os.write(st_w, struct.pack("!i", status))
                except OSError:  # the scoring process stopped listening
                    pass
                os.close(st_w)

    def next_cgroup() -> None:
        nonlocal forks
        global _CGROUP_NAME
        forks += 1
        _CGROUP_NAME = f"{CGROUP_PREFIX}{os.getpid()}-{forks}"

    def forget_cgroup(pid: int) -> None:
        name = cgroups.pop(pid, None)
        where = _cgroup_parent()
        if name and not isinstance(where, str):
            _remove_cgroup(os.path.join(where[0], name), 0)

    def spawn(confined: bool = True) -> tuple[int, int, int, int]:
        next_cgroup()
        entry = _spawn_supervisor(worker_src, confined)
        cgroups[entry[0]] = str(_CGROUP_NAME)
        children.add(entry[0])
        if confined:
            idle.append(entry)
        return entry

    def spawn_direct() -> None:
        nonlocal pid_ns_fd
        assert pid_ns_fd is not None
        next_cgroup()
        try:
            entry = _spawn_direct(pid_ns_fd)
        except OSError:  # e.g. out of pids or descriptors: supervised runs from now on
            os.close(pid_ns_fd)
            pid_ns_fd = None
            return
        cgroups[entry[0]] = str(_CGROUP_NAME)
        children.add(entry[0])
        direct_idle.append(entry)

    def short() -> bool:
        return len(idle) < size or (pid_ns_fd is not None and len(direct_idle) < size)

    try:
        while True:
            reap()
            if not idle:
                spawn()
            if pid_ns_fd is not None and not direct_idle:
                spawn_direct()
            # a waiting request first; refill one at a time while none is waiting (off the hot path)
            events = ready.select(0 if short() else 1.0)
            if not any(key.data is None for key, _ in events):
                if not events and short():
                    if pid_ns_fd is not None and len(direct_idle) < size:
                        spawn_direct()
                    else:
                        spawn()
                continue  # (a leased direct worker exited: reaped at the top)
            try:
                msg = ctrl.recv(16)
            except OSError:  # ECONNRESET: the trainer died with a request we had not read yet
                msg = b""
            if not msg:
                break  # the pool closed, or the trainer is gone
            reap()
            if msg == DIRECT:
                if not direct_idle and pid_ns_fd is not None:
                    spawn_direct()
                if not direct_idle:  # we cannot make them: the scoring process leases supervisors from now on
                    ctrl.sendmsg([struct.pack("!i", 0)])
                    continue
                pid, pidfd, fds, st_w = direct_idle.pop(0)
                leased[pid] = (pidfd, st_w)
                ready.register(pidfd, selectors.EVENT_READ, pid)
                ctrl.sendmsg([struct.pack("!i", pid)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                         struct.pack("5i", *fds, pidfd))])
                for fd in fds:
                    os.close(fd)
                continue
            if msg == CONFINED:
                pid, pidfd, job_fd, err_fd = idle.pop(0)
            else:  # PLAIN: a job with namespaces off or network on; rare, so forked on demand, never kept idle
                pid, pidfd, job_fd, err_fd = spawn(confined=False)
            ctrl.sendmsg([struct.pack("!i", pid)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                     struct.pack("3i", job_fd, err_fd, pidfd))])
            for fd in (job_fd, err_fd, pidfd):
                os.close(fd)
    finally:
        ready.close()
        for pid in list(children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in list(children):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        for pid in list(cgroups):
            forget_cgroup(pid)
        if root_mount:
            _libc.umount2(root_mount.encode(), MNT_DETACH)  # (ours: the host never had it mounted)
        _libc.umount2(base_dir.encode(), MNT_DETACH)  # our copy of the trainer's shared bind (`quota.share`)
        # whatever the runs left: never raises nor recurses; removing a directory the trainer still has a work dir
        # mounted on (it was killed) detaches that mount too
        _load_sibling("cleanup").remove_tree(base_dir)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--zygote"]:
        zygote(int(sys.argv[2]), sys.argv[3], [m for m in sys.argv[4].split(",") if m])
    else:
        main()
