"""The pool's zygote: a clean template that only forks idle pre-confined supervisors and direct workers (see
`rlf_envs.sandbox.pool`).

Stdlib only, like every module the supervisor loads: it runs with a bare interpreter (see `_supervisor`).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct

from rlf_envs.sandbox import _cgroup, _mounts
from rlf_envs.sandbox._base import (
    CLONE_NEWNS,
    CLONE_NEWPID,
    CONFINED,
    DIRECT,
    DIRECT_READY,
    DIRECT_UNCONFINED,
    MNT_DETACH,
    PR_SET_PDEATHSIG,
    Guards,
    _check,
    _libc,
    _prctl,
    _set_name,
)
from rlf_envs.sandbox._cgroup import CGROUP_PREFIX, _cgroup_parent, _memory_cgroup, _remove_cgroup, _sweep_cgroups
from rlf_envs.sandbox._mounts import (
    _host_snapshot,
    _own_python_dirs,
    _private_filesystem,
    _run_cwd,
    _unshare,
    build_root,
    prebuild_root,
    preconfine,
)
from rlf_envs.sandbox._run import _read_worker_src, main, read_frame
from rlf_envs.sandbox._seccomp import _seccomp_prog
from rlf_envs.sandbox._workerproc import (
    _close_fds_except,
    _default_signals,
    _parent_gone,
    _reset_signals,
    _run_and_exit,
    _run_identity,
    _stdin_memfd,
    _worker_env,
    _worker_preexec,
)

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
                preconfine(_mounts._ROOT_MOUNT)
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
        if ok and _mounts._ROOT_MOUNT:
            prebuild_root(_mounts._ROOT_MOUNT)
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
            _mounts._ROOT = (root_mount, build_root(root_mount, _own_python_dirs(), keep_slave=base_dir))
            _mounts._SHARED = True
        except OSError:
            _mounts._ROOT, _mounts._SHARED = None, False
    if root_mount and _mounts._ROOT is None:
        _mounts._ROOT_MOUNT = root_mount  # each idle supervisor or direct worker builds it in its own namespace
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
        forks += 1
        _cgroup._CGROUP_NAME = f"{CGROUP_PREFIX}{os.getpid()}-{forks}"

    def forget_cgroup(pid: int) -> None:
        name = cgroups.pop(pid, None)
        where = _cgroup_parent()
        if name and not isinstance(where, str):
            _remove_cgroup(os.path.join(where[0], name), 0)

    def spawn(confined: bool = True) -> tuple[int, int, int, int]:
        next_cgroup()
        entry = _spawn_supervisor(worker_src, confined)
        cgroups[entry[0]] = str(_cgroup._CGROUP_NAME)
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
        cgroups[entry[0]] = str(_cgroup._CGROUP_NAME)
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
        from rlf_envs.sandbox.cleanup import remove_tree

        remove_tree(base_dir)
