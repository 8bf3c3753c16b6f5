"""A fork server with no guard at all: the ceiling of any fork-per-run Python sandbox. For benchmarks only.

A warm interpreter (the sandbox pool's preloaded modules imported, its heap frozen) forks one child per call.
The child changes into the call's work dir, sends stdout and stderr to one file there, `exec`s the code and
exits; the server answers with the exit status once it has reaped the child. No namespaces, no uid, no rlimits,
no mounts, no output cap, no deadline, no cleanup of what the code leaves: whatever a sandbox does per run
costs more than this, so a sandbox's steps/s over this server's is its share of what forking allows.

    server: python -I bare_fork.py --serve MODULE,MODULE,...      (requests on stdin, a unix socket)
    client: BareForkServer(preload).run(work_dir, code) -> (output, exit status)
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
from typing import Any

OUTPUT = "bare_fork_output.txt"


def serve(preload: list[str]) -> None:
    """Answer `[id, dir, code]` lines on fd 0 with `[id, exit status]` lines, one forked child per request."""
    import gc
    import selectors

    for name in preload:
        try:
            __import__(name)
        except ImportError:
            pass
    gc.freeze()
    ctrl = socket.socket(fileno=os.dup(0))
    sel = selectors.DefaultSelector()
    sel.register(ctrl, selectors.EVENT_READ, None)
    buf = b""
    while True:
        for key, _ in sel.select():
            if key.data is not None:  # a child's pidfd: it exited
                rid, pid = key.data
                _, status = os.waitpid(pid, 0)
                sel.unregister(key.fileobj)
                os.close(key.fd)
                ctrl.sendall(json.dumps([rid, os.waitstatus_to_exitcode(status)]).encode() + b"\n")
                continue
            data = ctrl.recv(1 << 20)
            if not data:
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                rid, work_dir, code = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(work_dir, code)
                sel.register(os.pidfd_open(pid), selectors.EVENT_READ, (rid, pid))


def _child(work_dir: str, code: str) -> None:  # pragma: no cover - runs in the forked child
    status = 1
    try:
        os.chdir(work_dir)
        fd = os.open(OUTPUT, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # not the request socket: a child outliving the server must not keep it open
        os.closerange(3, 1 << 20)  # nor its copy of it, or the other children's pidfds
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        exec(compile(code, "main.py", "exec"), {"__name__": "__main__"})
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(status)


class BareForkServer:
    """The trainer's side: `await run(dir, code)` from any event loop (a reader thread resolves the calls)."""

    def __init__(self, preload: tuple[str, ...]) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), "--serve", ",".join(preload)],
                                     stdin=theirs.fileno())
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self.pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[int]]] = {}
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True, name="bare-fork-reader").start()

    async def run(self, work_dir: str, code: str) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()
        with self.lock:
            self.next_id += 1
            self.pending[self.next_id] = (loop, done)
            self.sock.sendall(json.dumps([self.next_id, work_dir, code]).encode() + b"\n")
        status = await done
        with open(os.path.join(work_dir, OUTPUT), encoding="utf-8", errors="replace") as f:
            return f.read(), status

    def _read(self) -> None:
        try:
            for line in self.sock.makefile("rb"):
                rid, status = json.loads(line)
                with self.lock:
                    loop, done = self.pending.pop(rid)
                loop.call_soon_threadsafe(done.set_result, status)
        except OSError:  # closed under us
            pass
        with self.lock:  # the server is gone: calls still waiting fail instead of hanging
            pending, self.pending = self.pending, {}
        gone = RuntimeError(f"the bare fork server exited (status {self.proc.poll()}) before answering")
        for loop, done in pending.values():
            loop.call_soon_threadsafe(done.set_exception, gone)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # the server is already gone
            pass
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> BareForkServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    serve([m for m in sys.argv[2].split(",") if m])
