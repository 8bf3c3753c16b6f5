"""One supervised run (`main`): read the job's public part, confine, start the worker, read the private part, wait
or judge, and write the one result line.

Stdlib only, like every module the supervisor loads: it runs with a bare interpreter (see `_supervisor`).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import struct
import sys
import time
from typing import Any

from rlf_envs.sandbox._base import (
    MAX_INT_DIGITS,
    MAX_JOB_BYTES,
    PR_SET_CHILD_SUBREAPER,
    PR_SET_DUMPABLE,
    Deadline,
    Guards,
    _prctl,
    _set_name,
)
from rlf_envs.sandbox._cgroup import _memory_cgroup, _remove_cgroup
from rlf_envs.sandbox._harness import Channel, _run_tests
from rlf_envs.sandbox._mounts import _enter_namespaces
from rlf_envs.sandbox._workerproc import Worker, _finish, _run_identity, _stdin_memfd

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
