"""Coarse per-call deadlines with one timer per time bucket instead of one timer per call.

`asyncio.timeout()` arms and disarms a loop timer for every call; at hundreds of concurrent calls that
is a measurable share of a tool call's overhead. Tool deadlines are seconds, so a resolution of a few
milliseconds is plenty: calls whose deadlines fall in the same bucket share one timer, which cancels
whatever is still running in the bucket when it fires. The cancelled call sees `TimeoutError`.
"""

from __future__ import annotations

import asyncio
import math


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

    def deadline(self, seconds: float) -> _Deadline:
        """Like `asyncio.timeout(seconds)` (raises TimeoutError), at `resolution_s` granularity."""
        return _Deadline(self, seconds)


class _Deadline:
    """`async with wheel.deadline(s):` a class, not a generator-based context manager: it is entered
    once per tool call."""

    __slots__ = ("key", "seconds", "task", "timeout", "wheel")

    def __init__(self, wheel: DeadlineWheel, seconds: float) -> None:
        self.wheel = wheel
        self.seconds = seconds
        self.task: asyncio.Task[object] | None = None
        self.timeout: asyncio.Timeout | None = None
        self.key = 0

    async def __aenter__(self) -> None:
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - always inside a task on a running loop
            self.timeout = asyncio.timeout(self.seconds)
            await self.timeout.__aenter__()
            return
        self.task = task
        w = self.wheel
        loop = asyncio.get_running_loop()
        self.key = key = math.ceil((loop.time() + self.seconds) / w.resolution_s)
        bucket = w._buckets.get(key)
        if bucket is None:
            bucket = w._buckets[key] = set()
            loop.call_at(key * w.resolution_s, w._fire, key)
        bucket.add(task)

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if self.timeout is not None:  # pragma: no cover
            await self.timeout.__aexit__(exc_type, exc, tb)  # type: ignore[arg-type]
            return
        task, w = self.task, self.wheel
        assert task is not None
        b = w._buckets.get(self.key)
        if b is not None:
            b.discard(task)
        fired = task in w._fired
        w._fired.discard(task)
        # our timer cancelled the task: that cancellation becomes TimeoutError (unless another is pending)
        if fired and exc_type is not None and issubclass(exc_type, asyncio.CancelledError) and task.uncancel() == 0:
            raise TimeoutError from None
