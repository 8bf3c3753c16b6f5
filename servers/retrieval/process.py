"""Run the retrieval server as a subprocess on a free loopback port (for tests, benchmarks, scripts)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from types import TracebackType

ROOT = Path(__file__).resolve().parents[2]
#: the line a server (or `serve --workers N`) prints once it accepts connections; group 1 is its URL
READY = re.compile(r"listening on (http://\S+)")


class ServerProcess:
    """`with ServerProcess(index_dir) as srv: srv.url` — started, ready, and always reaped.

    Extra CLI flags go in `args` (e.g. ["--max-topk", "10"]). The server binds 127.0.0.1 on a port
    the OS picks; `url` is read from its first stdout line. `stop()` sends SIGTERM (or `sig`) and
    waits up to `stop_timeout_s`, then kills.
    """

    def __init__(
        self,
        index_dir: str | Path,
        args: list[str] | None = None,
        start_timeout_s: float = 60.0,
        stop_timeout_s: float = 10.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.index_dir = Path(index_dir)
        self.args = list(args or [])
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.env = env
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.stderr_tail: deque[str] = deque(maxlen=200)
        self.returncode: int | None = None

    def start(self) -> ServerProcess:
        env = dict(os.environ if self.env is None else self.env)
        paths = [str(ROOT), str(ROOT / "rlf_envs" / "src")]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        cmd = [sys.executable, "-m", "servers.retrieval", "serve", "--index", str(self.index_dir), "--port", "0"]
        self.proc = subprocess.Popen(
            [*cmd, *self.args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        ready = threading.Event()
        threading.Thread(target=self._read_stdout, args=(ready,), daemon=True).start()
        deadline = time.monotonic() + self.start_timeout_s
        while not ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = "exited" if self.proc.poll() is not None else f"not ready after {self.start_timeout_s}s"
                self.stop()
                raise RuntimeError(f"retrieval server {why}; stderr:\n" + "".join(self.stderr_tail))
        return self

    def _read_stdout(self, ready: threading.Event) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            m = READY.search(line)
            if m and not ready.is_set():
                self.url = m.group(1)
                ready.set()

    def _drain_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_tail.append(line)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signal the server and wait for it; returns its exit code (killed if it overstays)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.returncode = self.proc.returncode
        return self.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
