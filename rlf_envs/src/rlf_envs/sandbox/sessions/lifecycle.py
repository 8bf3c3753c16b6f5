"""The lifecycle every session backend shares, written once: admission (at most `max_starting` creates at a time,
at most `creates_per_s` a second, so hundreds of episodes queue instead of timing out), a warm pool per key filled
in the background, a reaper round every `reap_every_s`, the open sessions, and the order of closing (no new
creates; the reaper stops; pool fills finish; sessions close; idle warm workers go; the engine's own clean-up).

A backend (`LocalBackend`, `DockerBackend`, a hosted provider's) subclasses `PooledBackend` and supplies what
differs by engine: how a session is made from a spec (`create`, inside `async with self.admit():`), what a warm
worker is and how it is discarded (the `WarmPool`'s `usable` / `discard`), its reaper round (`reap_round`) and
what its close leaves to clean up (`close_engine`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from typing import Any, Generic, TypeVar

from rlf_envs.sandbox.sessions.types import CreateRate, Session, SessionBackend, SessionClosed

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
W = TypeVar("W")


class WarmPool(Generic[K, W]):
    """Idle workers per key (a started agent, a running container), filled in the background up to `size`. It is an
    optimisation: a create makes a worker on demand when none is ready. `lease` hands out the newest usable one;
    an unusable one (died while idle, too old) is discarded. Every discard is awaited by `aclose`."""

    def __init__(self, size: int, usable: Callable[[W], bool], discard: Callable[[W], Awaitable[None]],
                 what: str = "session") -> None:
        self.size = size
        self.usable = usable
        self._discard = discard
        self.what = what
        self._idle: dict[K, list[W]] = {}
        self._filling: set[K] = set()
        self._tasks: set[asyncio.Future[Any]] = set()
        self.closed = False

    def idle(self, key: K) -> list[W]:
        """The idle workers of `key`, oldest first (a copy)."""
        return list(self._idle.get(key, ()))

    def all_idle(self) -> list[W]:
        """Every idle worker, of every key (a copy)."""
        return [w for ws in self._idle.values() for w in ws]

    def fill(self, key: K, make: Callable[[], Awaitable[W]]) -> None:
        """Top `key` up to `size` in the background with workers from `make` (one fill per key at a time)."""
        if self.size <= 0 or key in self._filling or self.closed:
            return
        self._filling.add(key)

        async def fill() -> None:
            try:
                while len(self._idle.get(key, ())) < self.size and not self.closed:
                    w = await make()
                    if self.closed:  # closed while it started: it goes, it is not handed out
                        await self._discard(w)
                        return
                    self._idle.setdefault(key, []).append(w)
            except Exception as e:
                log.warning("%s pool for %s could not fill: %r", self.what, key, e)
            finally:
                self._filling.discard(key)

        self._track(fill())

    def lease(self, key: K) -> W | None:
        """The newest usable idle worker of `key` (removed from the pool), or None."""
        idle = self._idle.get(key)
        while idle:
            w = idle.pop()
            if self.usable(w):
                return w
            self.drop(w)
        return None

    def put(self, key: K, w: W) -> bool:
        """Keep `w` idle for `key` (a worker back from a closed session, made ready for another by its backend);
        False once the pool is closed (the caller then discards it)."""
        if self.closed:
            return False
        self._idle.setdefault(key, []).append(w)
        return True

    def drop(self, w: W) -> None:
        """Discard `w` in the background (awaited by `aclose`)."""
        self._track(self._discard(w))

    def prune(self, stale: Callable[[W], bool]) -> int:
        """Discard the idle workers `stale` says should go; how many."""
        n = 0
        for idle in self._idle.values():
            for w in [w for w in idle if stale(w)]:
                idle.remove(w)
                self.drop(w)
                n += 1
        return n

    def _track(self, coro: Awaitable[Any]) -> None:
        t: asyncio.Future[Any] = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def aclose(self, fill_wait_s: float) -> None:
        """No more fills; the running ones end after their current start (cancelling one in the middle of starting
        could lose the worker it makes), within `fill_wait_s`; then every idle worker is discarded, and awaited."""
        self.closed = True
        fills = list(self._tasks)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*fills, return_exceptions=True), fill_wait_s)
        idle = [w for ws in self._idle.values() for w in ws]
        self._idle.clear()
        for w in idle:
            self.drop(w)
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


class PooledBackend(SessionBackend):
    """A `SessionBackend` with the shared lifecycle (see the module docstring)."""

    def __init__(self, *, max_starting: int, creates_per_s: float, reap_every_s: float) -> None:
        self.max_starting = max_starting
        self.creates_per_s = creates_per_s
        self.reap_every_s = reap_every_s
        self._sem: asyncio.Semaphore | None = None
        self._rate = CreateRate(creates_per_s, max_starting)
        self._sessions: set[Session] = set()
        self._reaper: asyncio.Task[None] | None = None
        self._closed = False

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """A create's turn: SessionClosed once the backend is closed; at most `max_starting` at a time; the reaper
        starts with the first create."""
        if self._closed:
            raise SessionClosed(f"the {self.name} session backend is closed")
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_starting)
        if self._reaper is None and self.reap_every_s > 0:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_loop())
        async with self._sem:
            yield

    async def rate_limit(self) -> None:
        """Wait for the create rate (a create that makes a new worker, not one leased from the pool)."""
        await self._rate.wait()

    async def reap_round(self) -> None:
        """One reaper round (every `reap_every_s` while the backend is open): remove what dead owners left."""
        await asyncio.to_thread(self.reap)

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.reap_every_s)
            with contextlib.suppress(Exception):
                await self.reap_round()

    async def close_sessions(self) -> None:
        await asyncio.gather(*(s.aclose() for s in list(self._sessions)), return_exceptions=True)

    async def close_lifecycle(self, pool: WarmPool[Any, Any] | None, fill_wait_s: float) -> bool:
        """The shared part of `aclose`, in order; False when the backend was closed already."""
        if self._closed:
            return False
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
        if pool is not None:
            pool.closed = True  # no new fills while the sessions close
        await self.close_sessions()
        if pool is not None:
            await pool.aclose(fill_wait_s)
        return True
