"""The sandbox's trusted side, shared part: the Linux ABI it uses (namespaces, mounts, prctl through libc), the
wire constants of the pool's protocol, the record of guards in force, and the harness's exceptions.

Stdlib only, like every module the supervisor loads: it runs with a bare interpreter (see `_supervisor`).
"""

from __future__ import annotations

import ctypes
import os
import sys

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


class Guards:
    """What this run is contained by; reported back to the scoring process."""

    def __init__(self) -> None:
        self.applied: dict[str, str] = {}  # guard -> how
        self.missing: dict[str, str] = {}  # guard -> why not

    def ok(self, name: str, how: str) -> None:
        self.applied[name] = how

    def no(self, name: str, why: str) -> None:
        self.missing[name] = why


# ------------------------------------------------------------------ a session's root (`sessions/_agent.py`)
#: pivot_root(2) and openat2(2) by number (glibc wraps neither everywhere); openat2 is the same on every arch
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine)
SYS_OPENAT2 = 437 if os.uname().machine in ("x86_64", "aarch64") else None
RESOLVE_NO_XDEV, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_BENEATH, RESOLVE_IN_ROOT = 1, 2, 4, 8, 16
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _pivot_root(new_root: str, put_old: str) -> None:
    """pivot_root(2); OSError (ENOSYS where this arch's number is unknown) when it fails."""
    if SYS_PIVOT_ROOT is None:
        raise OSError(38, "pivot_root: no syscall number for this architecture")
    _check(int(_libc.syscall(ctypes.c_long(SYS_PIVOT_ROOT), os.fsencode(new_root), os.fsencode(put_old))),
           "pivot_root")


def _umount2(target: str, flags: int) -> None:
    _check(_libc.umount2(os.fsencode(target), flags), f"umount2 {target}")


#: open_tree(2) and move_mount(2) (Linux >= 5.2), the same numbers on every architecture: a detached copy of a
#: directory's mount (an fd), attached in another mount namespace by whoever receives it (a recycled session's seed)
SYS_OPEN_TREE, SYS_MOVE_MOUNT = 428, 429
OPEN_TREE_CLONE, MOVE_MOUNT_F_EMPTY_PATH = 1, 4


def _syscall_fd(nr: int, *args: object, what: str) -> int:
    ret = int(_libc.syscall(ctypes.c_long(nr), *args))
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


def open_tree_clone(path: str) -> int:
    """A detached recursive copy of the mount tree at `path` (open_tree with OPEN_TREE_CLONE | AT_RECURSIVE), as a
    close-on-exec descriptor; closing it unmounts the copy unless `move_mount` attached it. OSError otherwise."""
    return _syscall_fd(SYS_OPEN_TREE, ctypes.c_int(AT_FDCWD), os.fsencode(path),
                       ctypes.c_uint(OPEN_TREE_CLONE | os.O_CLOEXEC | AT_RECURSIVE), what=f"open_tree {path}")


def move_mount_fd(fd: int, target: str) -> None:
    """Attach the detached mount `fd` (from `open_tree_clone`) at `target` in the caller's mount namespace."""
    _syscall_fd(SYS_MOVE_MOUNT, ctypes.c_int(fd), b"", ctypes.c_int(AT_FDCWD), os.fsencode(target),
                ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH), what=f"move_mount {target}")


def _openat2(dirfd: int, path: str, flags: int, mode: int, resolve: int) -> int:
    """openat2(2) (Linux >= 5.6): a new descriptor, or OSError (ENOSYS where the kernel or arch has none)."""
    if SYS_OPENAT2 is None:
        raise OSError(38, "openat2: no syscall number for this architecture")
    how = _OpenHow(flags, mode, resolve)
    fd = int(_libc.syscall(ctypes.c_long(SYS_OPENAT2), ctypes.c_int(dirfd), os.fsencode(path), ctypes.byref(how),
                           ctypes.c_size_t(ctypes.sizeof(how))))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)
    return fd


PATH_MAX = 4096


def check_path(p: object, what: str, error: type[Exception]) -> str:
    """A path a session request names: a str, not empty, without NUL, encodable, shorter than PATH_MAX; `error(msg)`
    otherwise (the caller's fault: the trainer side raises SessionError, the in-session agent its user error)."""
    if not isinstance(p, str):
        raise error(f"{what} must be a str, got {type(p).__name__}")
    if not p:
        raise error(f"{what} is empty")
    if "\0" in p:
        raise error(f"{what} {p[:200]!r} holds a NUL byte")
    try:
        n = len(p.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:
        raise error(f"{what} {p[:200]!r} is not encodable (a lone surrogate)") from None
    if n >= PATH_MAX:
        raise error(f"{what} is {n} bytes long (at most {PATH_MAX - 1})")
    return p
