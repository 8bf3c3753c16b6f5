"""The scoring process's side of a direct worker (`runner._run_direct`), against scripted workers that go wrong in
ways the real one cannot be made to from outside as root: it reports that it could not enter its namespaces, it
dies before or after reading the job, its set-up fails after it read the job, it answers garbage. Each scripted
worker is a real process speaking the real protocol over the descriptors a `DirectLease` carries (job socket,
stdout/stderr pipes, a pidfd, and a status pipe on which a thread plays the zygote: it writes the wait status once
the process has exited). The pool under test is a real supervised pool: where the scoring process must fall back
to a supervisor, the code really runs there, once."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from rlf_envs.sandbox import SandboxLimits, SandboxPool, run_python
from rlf_envs.sandbox.pool import DirectLease

pytestmark = [pytest.mark.envs, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[1]
FAST = SandboxLimits(timeout_s=10)

# The scripted worker: argv = behaviour, job socket fd. It reads the job with the real frame reader.
WORKER = textwrap.dedent("""
    import json, os, sys
    from rlf_envs.sandbox._supervisor import DIRECT_READY, DIRECT_UNCONFINED, read_frame
    behaviour, fd = sys.argv[1], int(sys.argv[2])
    if behaviour == "unconfined":
        os.write(fd, DIRECT_UNCONFINED)
        os._exit(0)
    if behaviour == "gone":
        os._exit(0)
    os.write(fd, DIRECT_READY)
    job = read_frame(fd)
    print("job for", job["mode"], flush=True)  # lands in the run's stdout pipe
    if behaviour == "dies_after_job":
        os._exit(1)
    if behaviour == "setup_error":
        os.write(fd, (json.dumps({"error": "the sandbox could not start the code: OSError: no uid left"}) + "\\n")
                 .encode())
        os._exit(127)
    if behaviour == "garbage":
        os.write(fd, b"not a verdict\\n")
        os.close(fd)
        os._exit(0)
    raise SystemExit(f"unknown behaviour {behaviour}")
""")


class ScriptedPool(SandboxPool):
    """A supervised pool whose `lease_direct` hands out scripted workers (`behaviours`, one per lease)."""

    def __init__(self, behaviours: list[str]) -> None:
        super().__init__(2, direct=False)
        self.direct = True  # as a root pool's: lease_direct is asked first
        self.behaviours = list(behaviours)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.supervised_leases = 0

    def lease_direct(self) -> DirectLease | None:
        if not self.direct:
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        st_r, st_w = os.pipe()
        env = {**os.environ, "PYTHONPATH": str(ROOT / "rlf_envs" / "src")}
        proc = subprocess.Popen([sys.executable, "-c", WORKER, self.behaviours.pop(0), str(theirs.fileno())],
                                pass_fds=(theirs.fileno(),), stdout=out_w, stderr=err_w, env=env)
        for fd in (theirs.detach(), out_w, err_w):
            os.close(fd)
        self.procs.append(proc)

        def zygote() -> None:  # reaps it and writes its wait status, as the zygote does
            code = proc.wait()
            try:
                os.write(st_w, struct.pack("!i", code << 8 if code >= 0 else -code))
            except BrokenPipeError:  # the scoring process stopped listening (it fell back to a supervisor)
                pass
            os.close(st_w)

        threading.Thread(target=zygote, daemon=True).start()
        return DirectLease(pid=proc.pid, pidfd=os.pidfd_open(proc.pid), job_fd=ours.detach(), out_fd=out_r,
                           err_fd=err_r, status_fd=st_r)

    def lease(self, confined: bool = True) -> Any:
        self.supervised_leases += 1
        return super().lease(confined)


def run(pool: ScriptedPool, code: str = "print('ran', 6 * 7)") -> Any:
    try:
        return asyncio.run(run_python(code, "", FAST, pool=pool))
    finally:
        pool.close()
        for p in pool.procs:
            p.wait(timeout=10)


@pytest.mark.parametrize("behaviour", ["gone", "dies_after_job"])
def test_a_worker_that_dies_before_its_verdict_costs_no_run(behaviour: str) -> None:
    # no code ran in it (it had not sent its guards): the run goes to a supervisor, exactly once
    pool = ScriptedPool([behaviour])
    r = run(pool)
    assert r.exit_code == 0 and r.stdout == "ran 42\n" and r.error is None, r
    assert "job for" not in r.stdout  # nothing of the dead worker's output is taken for the run's
    assert pool.supervised_leases == 1
    assert pool.direct  # a dead worker says nothing about the others: direct workers stay on
    assert "supervisor" in r.guards and "fresh_worker" in r.guards


def test_an_unconfined_worker_turns_direct_workers_off(caplog: pytest.LogCaptureFixture) -> None:
    pool = ScriptedPool(["unconfined", "unconfined"])
    with caplog.at_level(logging.WARNING, logger="rlf_envs.sandbox"):
        r = run(pool)
    assert r.exit_code == 0 and r.stdout == "ran 42\n" and r.error is None, r
    assert pool.supervised_leases == 1
    assert not pool.direct and pool.behaviours == ["unconfined"]  # never asked for a direct worker again
    assert any("could not enter its namespaces" in m for m in caplog.messages), caplog.messages
    # confined by the supervisor, as far as this machine allows (as non-root, user namespaces may be off)
    assert "pid_ns" in r.guards or "namespaces" in r.missing_guards, r


def test_a_set_up_error_after_the_job_is_the_runs_error_not_a_rerun() -> None:
    pool = ScriptedPool(["setup_error"])
    r = run(pool)
    assert r.error == "the sandbox could not start the code: OSError: no uid left", r
    assert r.exit_code is None and not r.timed_out and not r.ok
    assert pool.supervised_leases == 0  # it had the job: running it again elsewhere could run it twice


def test_a_worker_answering_garbage_gives_an_error_not_a_result() -> None:
    pool = ScriptedPool(["garbage"])
    r = run(pool)
    assert r.error is not None and "no set-up verdict" in r.error, r
    assert r.exit_code is None and r.guards == {}
    assert pool.supervised_leases == 0
