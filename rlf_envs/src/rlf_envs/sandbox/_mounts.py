"""Guards of the filesystem and namespaces: the run's own root (a read-only tmpfs of binds, built once by the zygote
or while idle), its private scratch tmpfs and work dir, hidden task data, and entering the namespaces.

Stdlib only, like every module the supervisor loads: it runs with a bare interpreter (see `_supervisor`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import sys
from typing import Any

from rlf_envs.sandbox._base import (
    AT_FDCWD,
    AT_RECURSIVE,
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    CLONE_NEWUTS,
    DEV_NODES,
    ETC_FILES,
    MNT_DETACH,
    MOUNT_ATTR_NODEV,
    MOUNT_ATTR_NOSUID,
    MOUNT_ATTR_RDONLY,
    MOUNT_SETATTR,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
    MS_SLAVE,
    NEW_ROOT,
    PRIVATE_DIRS,
    SYSTEM_DIRS,
    Guards,
    _check,
    _libc,
    _mount,
)


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
