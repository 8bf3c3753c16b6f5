"""The lifecycle every session backend shares (`sessions.lifecycle`): the warm pool, admission and its create rate,
the reaper, the order of closing. Driven through a small backend written the way a hosted provider's would be: a
`PooledBackend` whose sessions are plain subprocesses in a temporary directory (no isolation: it shows the size of
a backend, it is not one to use), with a warm pool of prepared directories."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from rlf_envs.sandbox.sessions.lifecycle import PooledBackend, WarmPool
from rlf_envs.sandbox.sessions.types import ExecResult, Session, SessionClosed, SessionSpec


class DirSession(Session):
    def __init__(self, backend: DirBackend, root: Path) -> None:
        self.backend, self.root, self.closed = backend, root, False

    async def exec(self, cmd: str | list[str], *, stdin: str | bytes | None = None, timeout_s: float | None = None,
                   env: dict[str, str] | None = None, cwd: str | None = None) -> ExecResult:
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else cmd
        p = await asyncio.create_subprocess_exec(*argv, cwd=self.root, stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.PIPE)
        out, err = await p.communicate()
        return ExecResult(exit_code=p.returncode or 0, stdout=out.decode(), stderr=err.decode())

    async def read_file(self, path: str) -> bytes:
        return (self.root / path).read_bytes()

    async def write_file(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        (self.root / path).write_bytes(data.encode() if isinstance(data, str) else data)

    async def diff(self, max_bytes: int | None = None) -> str:
        return ""

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.backend.closed_sessions.append(self.root.name)
            self.backend._sessions.discard(self)
            shutil.rmtree(self.root, ignore_errors=True)


class DirBackend(PooledBackend):
    """A whole backend on the shared lifecycle: what differs is only how a worker is made and discarded."""

    name = "dir"

    def __init__(self, pool_size: int = 2, max_starting: int = 2, creates_per_s: float = 0.0,
                 reap_every_s: float = 0.0, make_s: float = 0.0) -> None:
        super().__init__(max_starting=max_starting, creates_per_s=creates_per_s, reap_every_s=reap_every_s)
        self.pool: WarmPool[str, Path] = WarmPool(pool_size, usable=lambda d: d.is_dir(), discard=self._discard)
        self.make_s, self.made, self.discarded, self.reaps = make_s, 0, [], 0
        self.starting = self.most_starting = 0
        self.closed_sessions: list[str] = []

    async def _make(self) -> Path:
        await asyncio.sleep(self.make_s)
        self.made += 1
        return Path(tempfile.mkdtemp(prefix="rlf-dir-session-"))

    async def _discard(self, d: Path) -> None:
        self.discarded.append(d.name)
        shutil.rmtree(d, ignore_errors=True)

    def reap(self) -> int:
        self.reaps += 1
        return 0

    async def create(self, spec: SessionSpec) -> DirSession:
        async with self.admit():
            self.starting += 1
            self.most_starting = max(self.most_starting, self.starting)
            try:
                d = self.pool.lease(spec.image)
                self.pool.fill(spec.image, self._make)
                if d is None:
                    await self.rate_limit()
                    d = await self._make()
                s = DirSession(self, d)
                self._sessions.add(s)
                return s
            finally:
                self.starting -= 1

    async def aclose(self) -> None:
        await self.close_lifecycle(self.pool, 10.0)


SPEC = SessionSpec(image="host")


async def _until(cond: Any, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


def test_a_backend_on_the_shared_lifecycle_runs_sessions() -> None:
    async def go() -> None:
        async with DirBackend() as b:
            s = await b.create(SPEC)
            await s.write_file("a.txt", "hi")
            assert (await s.exec("cat a.txt")).stdout == "hi"
            await s.aclose()

    asyncio.run(go())


def test_the_pool_fills_to_size_and_serves_the_newest_usable() -> None:
    async def go() -> None:
        b = DirBackend(pool_size=2)
        first = await b.create(SPEC)  # no warm worker yet: made on demand, then the pool fills
        await _until(lambda: len(b.pool.idle("host")) == 2)
        warm = b.pool.idle("host")
        shutil.rmtree(warm[-1])  # the newest dies while idle: it is discarded, the next one is leased
        s = await b.create(SPEC)
        assert s.root == warm[0]
        await _until(lambda: warm[-1].name in b.discarded)  # discarded in the background
        await _until(lambda: len(b.pool.idle("host")) == 2)
        assert b.made == 1 + 2 + 2  # on demand, the fill, the refill of the two that left (one leased, one dead)
        await b.aclose()
        assert sorted(b.closed_sessions) == sorted([first.root.name, s.root.name])
        assert len(b.discarded) == 3 and not any(Path(tempfile.gettempdir(), n).exists() for n in b.discarded)

    asyncio.run(go())


def test_admission_bounds_starting_creates_and_the_rate_spaces_them() -> None:
    async def go() -> None:
        b = DirBackend(pool_size=0, max_starting=2, make_s=0.05)
        ss = await asyncio.gather(*(b.create(SPEC) for _ in range(6)))
        assert b.most_starting == 2 and b.made == 6
        await b.aclose()
        assert len(b.closed_sessions) == 6 and not b._sessions
        r = DirBackend(pool_size=0, max_starting=8, creates_per_s=20.0)
        t = time.monotonic()
        await asyncio.gather(*(r.create(SPEC) for _ in range(12)))
        assert time.monotonic() - t >= (12 - 8) / 20.0 * 0.9  # a burst of 8, then 20 a second
        await r.aclose()
        del ss

    asyncio.run(go())


def test_the_reaper_runs_while_open_and_stops_at_close() -> None:
    async def go() -> None:
        b = DirBackend(pool_size=0, reap_every_s=0.02)
        await (await b.create(SPEC)).aclose()
        await _until(lambda: b.reaps >= 3)
        await b.aclose()
        n = b.reaps
        await asyncio.sleep(0.1)
        assert b.reaps == n

    asyncio.run(go())


def test_close_refuses_new_creates_closes_sessions_and_waits_for_a_fill_in_flight() -> None:
    async def go() -> None:
        b = DirBackend(pool_size=2, make_s=0.2)
        s = await b.create(SPEC)  # starts a fill that is mid-make when the backend closes
        await asyncio.sleep(0.05)
        await b.aclose()
        assert s.closed and b.pool.idle("host") == []
        assert b.made == len(b.discarded) + 1  # every worker the fill made is discarded, none left idle
        with pytest.raises(SessionClosed, match="dir session backend is closed"):
            await b.create(SPEC)
        await b.aclose()  # idempotent

    asyncio.run(go())
