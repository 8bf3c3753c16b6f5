"""The in-session agent of the local backend (stdlib only; run as `python -I -S _agent.py`, never imported by the
trainer). Trusted: it holds root inside the session's namespaces; what it runs does not. Run as a script, it makes
`rlf_envs`, `rlf_envs.sandbox` and `rlf_envs.sandbox.sessions` bare namespaces (as `sandbox/_supervisor.py` does: their
`__init__` never runs) and loads the sandbox's stdlib-only modules by their package names: the Linux ABI (`_base`),
the one seccomp filter of the sandbox (`_seccomp`: every exec gets exactly a stateless run's filter) and `gitdiff`.

Process tree of one session::

    trainer ──stdin/stdout frames──▶ P (host pid ns: unshares mount/pid/ipc/uts[/net], forks C, waits for it)
                                      └─ C = pid 1 of the session's pid namespace: builds the root (tmpfs + read-only
                                         binds of the host's system dirs, or an overlay over an image root), the
                                         workspace (a size-limited tmpfs holding a copy of the seed), chroots, then
                                         serves requests one at a time; each exec is a fork that drops to the
                                         session's uid (rlimits, no_new_privs, no capabilities, the sandbox's
                                         seccomp filter) and execs the command

Frames: 4-byte big-endian length + JSON, on the agent's stdin (requests) and stdout (replies). The first frame P
writes is {"pid": <C's host pid>} so the owner label can name it before anything waits on C. Every process of the
session dies with C (pid 1), C asks for SIGKILL when P dies and P when the trainer dies (PR_SET_PDEATHSIG); the
owner reaper covers what that misses. All mounts live in the session's mount namespace only, so they go with it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import resource
import select
import shutil
import signal
import stat
import struct
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
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
    PR_SET_CHILD_SUBREAPER,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
    SYSTEM_DIRS,
    _check,
    _libc,
    _set_name,
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


def bind(src: str, dst: str, writable: bool = False) -> None:
    mount(src, dst, None, MS_BIND | MS_REC)
    mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_NOSUID | (0 if writable else MS_RDONLY))


# ---------------------------------------------------------------- frames
def read_frame(fd: int) -> dict[str, Any] | None:
    head = _read_exact(fd, 4)
    if head is None:
        return None
    (n,) = struct.unpack(">I", head)
    body = _read_exact(fd, n)
    if body is None:
        return None
    return json.loads(body)


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        b = os.read(fd, n - len(buf))
        if not b:
            return None
        buf += b
    return bytes(buf)


def write_frame(fd: int, obj: dict[str, Any]) -> None:
    body = json.dumps(obj).encode()
    data = struct.pack(">I", len(body)) + body
    while data:
        data = data[os.write(fd, data):]


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
    os.mkdir(r + "/dev/shm", 0o1777)
    os.chmod(r + "/dev/shm", 0o1777)


def build_root(r: str, image: str, disk_mb: int) -> str:
    """Mount the session's root at `r` (an empty directory) in our mount namespace. Returns how (for the guards)."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
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
        how = "host system dirs read-only"
    else:
        # an overlay over the image root: writes go to a tmpfs upper layer (bounded), the image stays untouched; the
        # session's root is then r/merged
        scratch = r + "/.scratch"
        mount("tmpfs", r, "tmpfs", MS_NOSUID, f"size={disk_mb}m,mode=0755")
        os.makedirs(scratch + "/upper", 0o755)
        os.makedirs(scratch + "/work", 0o755)
        os.makedirs(r + "/merged", 0o755)
        try:
            mount("overlay", r + "/merged", "overlay", MS_NOSUID,
                  f"lowerdir={image},upperdir={scratch}/upper,workdir={scratch}/work")
            how = "overlay over the image (tmpfs upper layer)"
        except OSError:
            bind(image, r + "/merged")
            how = "image bound read-only (overlayfs unavailable)"
    return how


def open_root(r: str) -> None:
    """`SessionSpec.writable_root`: every directory of the session's overlay sticky and world-writable (a metadata
    copy-up into the session's own tmpfs upper layer; the image is untouched). The session user can then add
    entries anywhere, but (sticky) not rename or remove the image's own, and the image's files keep their modes."""
    for dirpath, _dirs, _files in os.walk(r):
        st = os.lstat(dirpath)
        if stat.S_ISDIR(st.st_mode):
            os.chmod(dirpath, stat.S_IMODE(st.st_mode) | 0o1777)


def finish_root(r: str, workdir: str, disk_mb: int, uid: int, seed: str | None) -> None:
    """The per-session part: /proc, /dev, /tmp, the workspace (a tmpfs of disk_mb holding a copy of the seed)."""
    for d in ("/proc", "/tmp", "/dev"):
        os.makedirs(r + d, mode=0o755, exist_ok=True)
    _devices(r)
    mount("proc", r + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    tmp_mb = max(16, min(disk_mb, 1024))
    mount("tmpfs", r + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_mb}m,mode=1777")
    for d in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(r + d) and not os.path.islink(r + d):
            mount("tmpfs", r + d, "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_mb}m,mode=1777")
    ws = r + workdir
    os.makedirs(ws, mode=0o755, exist_ok=True)
    mount("tmpfs", ws, "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_mb}m,mode=0755,uid={uid},gid={uid}")
    if seed:
        shutil.copytree(seed, ws, symlinks=True, dirs_exist_ok=True)
        os.chmod(ws, 0o755)
        for dirpath, dirnames, filenames in os.walk(ws):
            for n in dirnames + filenames:
                os.lchown(os.path.join(dirpath, n), uid, uid)
    # the session's user has a name (git, whoami, getpwuid): appended to the root's own copy of the user database
    # (the host image's is a copy in the root tmpfs, an image's is in the overlay's upper layer)
    for name, line in (("passwd", f"sandbox:x:{uid}:{uid}:sandbox:{workdir}:/bin/sh\n"),
                       ("group", f"sandbox:x:{uid}:\n")):
        path = f"{r}/etc/{name}"
        try:
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "a") as f:
                    f.write(line)
        except OSError:
            pass


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


def _child(req: dict[str, Any], st: dict[str, Any], stdin_fd: int, out_w: int, err_w: int) -> None:
    try:
        os.setsid()
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 65536)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        for s in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(s, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        lim = st["limits"]
        mem = lim["memory_mb"] << 20
        for res, v in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_NPROC, lim["pids"]),
                       (resource.RLIMIT_FSIZE, lim["disk_mb"] << 20), (resource.RLIMIT_CORE, 0),
                       (resource.RLIMIT_NOFILE, 4096)):
            resource.setrlimit(res, (v, v))
        uid = st["uid"]
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        _seccomp()  # the sandbox's filter (`rlf_envs.sandbox._seccomp`): the last step before the command
        cwd = req.get("cwd") or st["workdir"]
        os.chdir(cwd)
        env = dict(st["env"])
        env.update(req.get("env") or {})
        if "shell" in req:
            sh = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
            argv = [sh, "-lc" if sh == "/bin/bash" else "-c", req["shell"]]
        else:
            argv = req["argv"]
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


def _kill_new(before: set[int]) -> dict[int, int]:
    """SIGKILL every process of the session that did not exist before the call (what the call started, wherever it
    moved: a new session, a double fork), until none is left. Returns the wait statuses reaped on the way."""
    reaped: dict[int, int] = {}
    for _ in range(10000):
        new = _session_pids() - before
        if not new:
            break
        for p in new:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reaped.update(_reap_orphans())
        time.sleep(0.001)
    return reaped


def do_exec(req: dict[str, Any], st: dict[str, Any]) -> dict[str, Any]:
    cap = int(st["limits"]["output_bytes"])
    timeout = float(req["timeout"])
    stdin = base64.b64decode(req.get("stdin") or "")
    _reap_orphans()
    before = _session_pids()
    memfd = os.memfd_create("stdin", 0)
    os.write(memfd, stdin)
    os.lseek(memfd, 0, 0)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        _child(req, st, memfd, out_w, err_w)
    os.close(memfd)
    os.close(out_w)
    os.close(err_w)
    pidfd = os.pidfd_open(pid)
    bufs = {out_r: bytearray(), err_r: bytearray()}
    truncated = False
    timed_out = False
    status: int | None = None
    deadline = t0 + timeout
    poller = select.poll()
    for fd in (out_r, err_r, pidfd):
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

    grace_end: float | None = None
    while open_fds or status is None:
        now = time.monotonic()
        end = deadline if grace_end is None else min(deadline, grace_end)
        if now >= end:
            timed_out = grace_end is None or now >= deadline
            break
        for fd, _ev in poller.poll((end - now) * 1000):
            if fd == pidfd:
                poller.unregister(pidfd)
                status = os.waitpid(pid, 0)[1]
                grace_end = time.monotonic() + 0.05  # what it started may still hold its output open
            else:
                take(fd)
    if timed_out:
        reaped = _kill_new(before)
        if status is None:
            status = reaped[pid] if pid in reaped else os.waitpid(pid, 0)[1]
    os.close(pidfd)
    for fd in list(open_fds):  # drain what is buffered, never wait for a writer
        for _ in range(64):
            if fd not in open_fds or not select.select([fd], [], [], 0)[0]:
                break
            take(fd)
    for fd in (out_r, err_r):
        os.close(fd)
    _reap_orphans()
    assert status is not None
    if timed_out:
        code = 124
    elif os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
    else:
        code = 128 + os.WTERMSIG(status)
    return {"ok": True, "exit_code": code, "stdout": base64.b64encode(bytes(bufs[out_r])).decode(),
            "stderr": base64.b64encode(bytes(bufs[err_r])).decode(), "timed_out": timed_out,
            "truncated": truncated, "duration_s": time.monotonic() - t0}


# ---------------------------------------------------------------- files
class _As:
    """Effective uid/gid of the session's user for a file operation (so it cannot be tricked into root's rights and
    what it creates belongs to the session's user)."""

    def __init__(self, uid: int) -> None:
        self.uid = uid

    def __enter__(self) -> None:
        os.setegid(self.uid)
        os.seteuid(self.uid)

    def __exit__(self, *a: Any) -> None:
        os.seteuid(0)
        os.setegid(0)


def _path(st: dict[str, Any], p: str) -> str:
    return p if p.startswith("/") else os.path.join(st["workdir"], p)


def do_read(req: dict[str, Any], st: dict[str, Any]) -> dict[str, Any]:
    with _As(st["uid"]):
        fd = os.open(_path(st, req["path"]), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return {"ok": False, "error": f"{req['path']}: not a regular file", "kind": "user"}
            chunks, n = [], 0
            while True:
                b = os.read(fd, 1 << 20)
                if not b:
                    break
                n += len(b)
                if n > MAX_FILE:
                    return {"ok": False, "error": f"{req['path']}: larger than {MAX_FILE} bytes", "kind": "user"}
                chunks.append(b)
        finally:
            os.close(fd)
    return {"ok": True, "data": base64.b64encode(b"".join(chunks)).decode()}


def do_write(req: dict[str, Any], st: dict[str, Any]) -> dict[str, Any]:
    data = base64.b64decode(req["data"])
    path = _path(st, req["path"])
    with _As(st["uid"]):
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC, req.get("mode", 0o644))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return {"ok": False, "error": f"{req['path']}: not a regular file", "kind": "user"}
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
    return {"ok": True}


def do_diff(req: dict[str, Any], st: dict[str, Any]) -> dict[str, Any]:
    seed = f"/proc/self/fd/{st['seed_fd']}" if st.get("seed_fd") is not None else None
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

    try:
        # the workspace is read with the session user's rights (a link swapped in mid-walk reaches nothing more
        # than the session's own code could read); the seed, trusted, with ours
        with _As(uid):
            patch = gitdiff.diff_trees(seed, st["workdir"], max_bytes=int(req.get("max_bytes", 256 << 20)),
                                       old_access=as_root)
    except gitdiff.DiffTooLarge as e:
        return {"ok": False, "error": str(e), "kind": "user"}
    return {"ok": True, "patch": patch}


# ---------------------------------------------------------------- main
def serve(st: dict[str, Any]) -> None:
    ops = {"exec": do_exec, "read": do_read, "write": do_write, "diff": do_diff}
    while True:
        req = read_frame(0)
        if req is None or req.get("op") == "close":
            _kill_all_but_me()
            if req is not None:
                write_frame(1, {"ok": True})
            os._exit(0)
        op = ops.get(req.get("op", ""))
        if op is None:
            write_frame(1, {"ok": False, "error": f"unknown op {req.get('op')!r}", "kind": "infra"})
            continue
        try:
            reply = op(req, st)
        except OSError as e:
            reply = {"ok": False, "error": f"{req.get('op')}: {e.strerror or e}", "kind": "user",
                     "errno": e.errno}
        except Exception as e:
            reply = {"ok": False, "error": f"{req.get('op')}: {e!r}", "kind": "infra"}
        write_frame(1, reply)


def session_main(parent_fd: int) -> None:
    """C: pid 1 of the session's pid namespace."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if select.select([parent_fd], [], [], 0)[0]:  # P died before we asked to die with it
        os._exit(1)
    os.close(parent_fd)
    _set_name(b"rlf-session")
    signal.signal(signal.SIGALRM, lambda *a: os._exit(3))
    prep = read_frame(0)
    if prep is None:
        os._exit(0)
    r = prep["root_mount"]
    try:
        how = build_root(r, prep["image"], prep["disk_mb"])
        if prep["image"] != "host":
            r = r + "/merged"
    except Exception as e:
        write_frame(1, {"ok": False, "error": f"building the session root: {e!r}", "kind": "infra"})
        os._exit(2)
    write_frame(1, {"ok": True, "how": how})
    start = read_frame(0)
    if start is None:
        os._exit(0)
    try:
        lim = start["limits"]
        seed_fd = None
        if start.get("seed"):
            seed_fd = os.open(start["seed"], os.O_RDONLY | os.O_DIRECTORY)
        if start.get("writable_root"):
            if not how.startswith("overlay"):
                raise OSError(f"writable_root needs overlayfs for the session's root ({how})")
            open_root(r)
        finish_root(r, start["workdir"], lim["disk_mb"], start["uid"], start.get("seed"))
        _libc.sethostname(b"sandbox", 7)
        os.chroot(r)
        if start.get("writable_root"):
            # the root agent imports nothing from a root the session user can add files to
            sys.path[:] = []
            sys.path_importer_cache.clear()
        os.chdir(start["workdir"])
        if lim.get("session_timeout_s"):
            signal.alarm(int(lim["session_timeout_s"]) + 5)
    except Exception as e:
        write_frame(1, {"ok": False, "error": f"starting the session: {e!r}", "kind": "infra"})
        os._exit(2)
    st = {"limits": lim, "uid": start["uid"], "workdir": start["workdir"], "env": start["env"], "seed_fd": seed_fd}
    _seccomp_prog()  # built before the first exec's fork
    write_frame(1, {"ok": True})
    serve(st)


def main() -> None:
    """P: in the host's pid namespace."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(1)
    network = "--network" in sys.argv
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | (0 if network else CLONE_NEWNET)
    _check(_libc.unshare(flags), "unshare")
    # the session's processes are re-parented to us when C (their pid 1) dies: we reap them, so that the session's
    # cgroups are empty when we exit (the host's init may reap late, or never)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
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


if __name__ == "__main__":
    main()
