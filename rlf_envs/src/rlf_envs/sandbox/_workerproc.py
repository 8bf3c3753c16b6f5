"""The untrusted worker's process: its set-up (uid, rlimits, seccomp, root, cgroup), forking or starting it, running the
code in a forked interpreter as `python -I main.py` would, capturing its output, and killing its whole tree.

Stdlib only, like every module the supervisor loads: it runs with a bare interpreter (see `_supervisor`).
"""

from __future__ import annotations

import atexit
import builtins
import errno
import os
import random
import resource
import select
import selectors
import signal
import sys
import time
import types
from typing import Any

from rlf_envs.sandbox._base import (
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
    PYTHON_INT_DIGITS,
    Guards,
    _mount,
    _prctl,
    _set_name,
)
from rlf_envs.sandbox._cgroup import _join_cgroup
from rlf_envs.sandbox._mounts import _enter_root, _hidden_top, _run_cwd
from rlf_envs.sandbox._seccomp import SOCKET_FAMILIES, _drop_capabilities, _seccomp

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
    g.ok("no_new_namespaces", "seccomp: unshare, setns and clone with a namespace flag fail with EPERM (clone3 with "
                              "ENOSYS: glibc falls back to clone); bpf, perf_event_open, userfaultfd fail with EPERM")
    return uid, nproc


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
