"""Coarse per-call deadlines with one timer per time bucket instead of one timer per call.

`asyncio.timeout()` arms and disarms a loop timer for every call; at hundreds of concurrent calls that
is a measurable share of a tool call's overhead. Tool deadlines are seconds, so a resolution of a few
milliseconds is plenty: calls whose deadlines fall in the same bucket share one timer, which cancels
whatever is still running in the bucket when it fires. The cancelled call sees `TimeoutError`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class DeadlineWheel:
    """Use from one event loop. `resolution_s` bounds how late a deadline may fire."""

    def __init__(self, resolution_s: float = 0.005) -> None:
        self.resolution_s = resolution_s
        self._buckets: dict[int, set[asyncio.Task[object]]] = {}
        self._fired: set[asyncio.Task[object]] = set()

    def _fire(self, key: int) -> None:
        for task in self._buckets.pop(key, ()):
            if not task.done():
                self._fired.add(task)
                task.cancel()

    @asynccontextmanager
    async def deadline(self, seconds: float) -> AsyncIterator[None]:
        """Like `asyncio.timeout(seconds)` (raises TimeoutError), at `resolution_s` granularity."""
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - always inside a task on a running loop
            async with asyncio.timeout(seconds):
                yield
            return
        loop = asyncio.get_running_loop()
        key = math.ceil((loop.time() + seconds) / self.resolution_s)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = set()
            loop.call_at(key * self.resolution_s, self._fire, key)
        bucket.add(task)  # type: ignore[arg-type]
        try:
            yield
        except asyncio.CancelledError:
            if task in self._fired:
                self._fired.discard(task)  # type: ignore[arg-type]
                if task.uncancel() == 0:
                    raise TimeoutError from None
            raise
        finally:
            b = self._buckets.get(key)
            if b is not None:
                b.discard(task)  # type: ignore[arg-type]
            self._fired.discard(task)  # type: ignore[arg-type]
