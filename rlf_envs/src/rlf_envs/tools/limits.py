"""A FIFO concurrency limiter with an O(1) fast path (asyncio.Semaphore's is O(waiters) on 3.11)."""

from __future__ import annotations

import asyncio
from collections import deque
from types import TracebackType


class Limiter:
    """At most `limit` holders; waiters are served first-in first-out. Use on one event loop."""

    __slots__ = ("_waiters", "inflight", "limit")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.inflight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> None:
        if self.inflight < self.limit and not self._waiters:
            self.inflight += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # release() hands its slot over by resolving the future
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed to us as we were cancelled: pass it on
            else:
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.inflight -= 1

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
