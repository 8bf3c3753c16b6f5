"""`serve --workers N`: N server processes on one port, each with its own event loop, micro-batcher and index.

The kernel spreads incoming connections over the workers' SO_REUSEPORT sockets. This is for indexes whose
search holds the GIL (BM25: Python and small numpy calls), where one process does its HTTP work and its
searches one after the other on one core; N processes use N cores. A dense index's encoder and faiss release
the GIL, so one process already overlaps HTTP and search (and N processes load N encoders).

This process (the parent) loads nothing: it reserves the port, starts the workers as `serve ... --workers 1
--port P --reuse-port`, prints the listening line once all are ready, forwards SIGTERM/SIGINT to them and waits
for them. Workers stop when their stdin (a pipe from the parent) closes, so they never outlive it.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from types import FrameType

from .process import READY


def _reserve(host: str, port: int) -> socket.socket:
    """A bound, NOT listening SO_REUSEPORT socket: it holds the port (0: any free one) until the workers have
    bound theirs, and never receives a connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def run_workers(package: str, argv: list[str], workers: int, host: str, port: int, start_timeout_s: float,
                stop_timeout_s: float) -> int:
    """Run `workers` copies of `python -m package serve ...argv` on one port; returns the exit code."""
    reserved = _reserve(host, port)
    port = reserved.getsockname()[1]
    cmd = [sys.executable, "-m", package, *argv, "--workers", "1", "--port", str(port), "--reuse-port"]
    procs: list[subprocess.Popen[str]] = []
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    old = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for _ in range(workers):
            procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        first = ""
        for proc in procs:
            line = _wait_ready(proc, start_timeout_s, stop)
            if line is None:
                return 0 if stop.is_set() else 1
            first = first or line
        reserved.close()
        print(first.rstrip().rstrip(")") + f", {workers} workers)", flush=True)
        while not stop.wait(0.2):
            if any(p.poll() is not None for p in procs):
                print("rlf retrieval server: a worker exited; stopping the others", file=sys.stderr, flush=True)
                return 1
        print("rlf retrieval server: shutting down", file=sys.stderr, flush=True)
        return 0
    finally:
        reserved.close()
        _stop_all(procs, stop_timeout_s)
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _wait_ready(proc: subprocess.Popen[str], timeout_s: float, stop: threading.Event) -> str | None:
    """The worker's listening line, or None if it exited, overstayed `timeout_s` or we were told to stop."""
    assert proc.stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline() if proc.stdout else ""), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    while reader.is_alive() and not stop.is_set() and time.monotonic() < deadline:
        reader.join(0.1)
    if lines and READY.search(lines[0]):
        threading.Thread(target=_drain, args=(proc,), daemon=True).start()  # a full pipe must not block it
        return lines[0]
    if not stop.is_set():
        why = f"exited with {proc.poll()}" if proc.poll() is not None else f"not ready after {timeout_s:g}s"
        print(f"error: a retrieval server worker {why}", file=sys.stderr, flush=True)
    return None


def _drain(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    with contextlib.suppress(OSError, ValueError):
        for line in proc.stdout:
            print(line, end="", flush=True)


def _stop_all(procs: list[subprocess.Popen[str]], timeout_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        if p.stdin is not None:
            with contextlib.suppress(OSError):
                p.stdin.close()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
