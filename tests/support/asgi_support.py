"""Test helper: serve an ASGI app (FastAPI) with uvicorn on a free 127.0.0.1 port in a thread, ready within a
deadline, stopped in `finally`. Used by the OpenEnv and NeMo-Gym adapter tests and benchmarks/adapters_rl.py.
Imported as `asgi_support` (not `tests.…`): verl's wheel ships a top-level `tests` package."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

READY_DEADLINE_S = 60.0
STOP_DEADLINE_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve(app: Any, port: int | None = None) -> Iterator[str]:
    """`with serve(app) as url:` the app answers at `url` (http://127.0.0.1:PORT) inside the block."""
    import importlib.util

    import uvicorn

    port = port or free_port()
    ws = "websockets-sansio" if importlib.util.find_spec("websockets") else "none"  # OpenEnv's sessions are WebSockets
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws=ws)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"asgi-{port}", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + READY_DEADLINE_S
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"the server on port {port} did not start within {READY_DEADLINE_S}s")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=STOP_DEADLINE_S)
        if thread.is_alive():
            raise RuntimeError(f"the server on port {port} did not stop within {STOP_DEADLINE_S}s")
