"""Micro-batching of concurrent searches into one retriever call.

Many rollouts each asking for a handful of queries are gathered for at most `max_wait_s` (measured
from the oldest waiting request) or until `max_batch` queries, then answered by ONE
`search_batch` call (one encoder pass + one faiss search) in a worker thread, so the event loop
keeps accepting requests meanwhile. While a batch runs, the next one accumulates.

Identical queries in a batch are searched once (GRPO's G samples of one prompt often issue the same
query). With `flush_when_idle` (in-process use, where every concurrent caller is a task on the same
loop) a batch is sent as soon as one loop iteration passes with no new request, instead of waiting
out `max_wait_s`; a server, whose requests trickle in from sockets, keeps the timed wait.

`inline_below_s`: a batch expected (from recent batches' time per query) to take less than this (a BM25
index: about a millisecond for 64 queries) is searched on the loop itself; two thread hops and a core
whose caches are cold cost about as much. Anything slower (a dense encoder) goes to the worker thread,
so that the loop keeps serving.

A `RemoteRetriever` (a retrieval server, e.g. the Search env's HTTP backend) is searched on the loop instead:
each batch is its own task, so the next batch does not wait for the previous reply, and every query gets its
own hits or its own error (one bad query does not fail the others of its batch).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from rlf_envs.errors import RlfError
from rlf_envs.retrieval.types import Hit, Retriever


class BatcherClosed(RlfError, RuntimeError):
    """The batcher was closed while a request waited."""


@runtime_checkable
class RemoteRetriever(Protocol):
    """A retriever answered on the event loop (a server). `asearch_batch` gets distinct queries and, for each, the
    largest topk a caller asked of it; it returns one entry per query: its hits (best first, at least that
    topk's prefix), or the exception that query alone fails with. Raising fails every query of the batch."""

    async def asearch_batch(self, queries: list[str], topks: list[int]) -> list[list[Hit] | Exception]: ...


@dataclass(slots=True)
class _Pending:
    queries: list[str]
    topk: int
    future: asyncio.Future[list[list[Hit]]]
    arrived: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class BatcherStats:
    batches: int = 0
    queries: int = 0
    requests: int = 0
    max_batch_queries: int = 0
    unique_queries: int = 0  # queries actually searched (after de-duplication within each batch)
    search_seconds: float = 0.0

    def record(self, requests: int, queries: int, unique: int) -> None:
        self.batches += 1
        self.requests += requests
        self.queries += queries
        self.unique_queries += unique
        self.max_batch_queries = max(self.max_batch_queries, queries)

    @property
    def mean_batch_queries(self) -> float:
        return self.queries / self.batches if self.batches else 0.0


class MicroBatcher:
    """Coalesces concurrent `search` calls on one event loop into batched `search_batch` calls.

    Results are identical to calling `retriever.search_batch(queries, topk)` directly, provided the
    retriever's top-k is prefix-consistent (rlf's DenseIndex and BM25Index are): a batch is searched
    once with its largest topk and each request's lists are truncated to its own topk. A `RemoteRetriever`
    gets `asearch_batch` calls instead, each batch as its own task on the loop.
    """

    def __init__(
        self,
        retriever: Retriever | RemoteRetriever,
        max_batch: int = 256,
        max_wait_s: float = 0.002,
        flush_when_idle: bool = False,
        inline_below_s: float = 0.0,
        send_at: int | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if send_at is not None and send_at < 1:
            raise ValueError("send_at must be >= 1 (or None: wait until max_batch)")
        if max_wait_s < 0:
            raise ValueError("max_wait_s must be >= 0")
        self.retriever = retriever
        self._remote = retriever if isinstance(retriever, RemoteRetriever) else None
        self._remote_batches: dict[asyncio.Task[None], list[_Pending]] = {}  # remote batches in flight
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        #: a batch holding this many queries is searched at once, without waiting `max_wait_s` for more (a
        #: request that already carries a whole batch, from a coalescing trainer, does not wait)
        self.send_at = max_batch if send_at is None else min(send_at, max_batch)
        self.flush_when_idle = flush_when_idle
        self.inline_below_s = inline_below_s
        self._per_query_s: float | None = None  # moving average of search time per query (None: none yet)
        self.stats = BatcherStats()
        self._pending: list[_Pending] = []
        self._queued = 0  # queries in _pending
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight: list[_Pending] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlf-retrieval")
        self._closed = False

    def _ensure_started(self) -> asyncio.Event:
        if self._closed:
            raise BatcherClosed("the retrieval batcher is closed")
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._loop is not loop:
            # first use, or used from a new event loop: whatever waited on an old loop is gone with it
            self._pending.clear()
            self._remote_batches.clear()
            self._queued = 0
            self._loop = loop
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run(), name="rlf-retrieval-batcher")
        assert self._wake is not None
        return self._wake

    async def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        """Top-`topk` hits for each query, best first (batched with concurrent callers)."""
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        if not queries:
            return []
        wake = self._ensure_started()
        fut: asyncio.Future[list[list[Hit]]] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(list(queries), topk, fut))
        self._queued += len(queries)
        if len(self._pending) == 1 or self._queued >= self.send_at:
            wake.set()  # the runner waits for a first request, or for a full batch: not woken per request
        return await fut

    def _queued_queries(self) -> int:
        return self._queued

    def _take_batch(self) -> list[_Pending]:
        batch: list[_Pending] = []
        n = 0
        while self._pending and (not batch or n + len(self._pending[0].queries) <= self.max_batch):
            p = self._pending.pop(0)
            self._queued -= len(p.queries)
            if p.future.done():  # the caller gave up (cancelled / deadline)
                continue
            batch.append(p)
            n += len(p.queries)
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._pending:
                continue
            await self._gather_more()
            batch = self._take_batch()
            if not batch:
                continue
            if self._remote is not None:  # on the loop, as its own task: the next batch need not wait for it
                task = loop.create_task(self._search_remote(self._remote, batch), name="rlf-retrieval-batch")
                self._remote_batches[task] = batch
                task.add_done_callback(lambda t: self._remote_batches.pop(t, None))
                if self._pending:  # more than max_batch were waiting: the rest go out next
                    self._wake.set()
                continue
            assert not isinstance(self.retriever, RemoteRetriever)
            queries = [q for p in batch for q in p.queries]
            topk = max(p.topk for p in batch)
            unique = list(dict.fromkeys(queries))  # first-seen order
            t0 = time.monotonic()
            self._inflight = batch
            try:
                if self._per_query_s is not None and self._per_query_s * len(unique) < self.inline_below_s:
                    found = self.retriever.search_batch(unique, topk)
                else:
                    found = await loop.run_in_executor(self._executor, self.retriever.search_batch, unique, topk)
                if len(unique) == len(queries):
                    results = found
                else:
                    by_query = dict(zip(unique, found, strict=True))
                    results = [by_query[q] for q in queries]
            except Exception as e:
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            finally:
                self._inflight = []
                took = time.monotonic() - t0
                self.stats.search_seconds += took
                per = took / len(unique)
                self._per_query_s = per if self._per_query_s is None else 0.8 * self._per_query_s + 0.2 * per
            self.stats.record(len(batch), len(queries), len(unique))
            pos = 0
            for p in batch:
                part = results[pos : pos + len(p.queries)]
                pos += len(p.queries)
                if not p.future.done():
                    p.future.set_result([hits[: p.topk] for hits in part])
            if self._pending:
                self._wake.set()

    async def _search_remote(self, remote: RemoteRetriever, batch: list[_Pending]) -> None:
        topks: dict[str, int] = {}  # each distinct query, first-seen order, with the largest topk asked of it
        for p in batch:
            for q in p.queries:
                topks[q] = max(topks.get(q, 0), p.topk)
        unique = list(topks)
        t0 = time.monotonic()
        try:
            found = await remote.asearch_batch(unique, list(topks.values()))
            by_query: dict[str, list[Hit] | Exception] = dict(zip(unique, found, strict=True))
        except Exception as e:
            by_query = dict.fromkeys(unique, e)
        finally:
            self.stats.search_seconds += time.monotonic() - t0
        self.stats.record(len(batch), sum(len(p.queries) for p in batch), len(unique))
        for p in batch:
            if p.future.done():  # the caller gave up meanwhile
                continue
            part = [by_query[q] for q in p.queries]
            error = next((r for r in part if isinstance(r, Exception)), None)
            if error is not None:
                p.future.set_exception(error)
            else:
                p.future.set_result([hits[: p.topk] for hits in part])  # type: ignore[index]

    async def _gather_more(self) -> None:
        """Let more requests join the batch: until `max_batch` queries, `max_wait_s` after the oldest
        request, or (flush_when_idle) the first loop iteration that brings no new request. From `send_at`
        queries on it does not wait; the batch then takes whatever is queued, up to `max_batch`."""
        assert self._wake is not None
        while (n := self._queued_queries()) < self.send_at:
            remaining = self._pending[0].arrived + self.max_wait_s - time.monotonic()
            if remaining <= 0:
                return
            if self.flush_when_idle:
                await asyncio.sleep(0)  # one loop iteration: tasks already scheduled reach search()
                self._wake.clear()
                if self._queued_queries() == n:
                    return
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), remaining)
            self._wake.clear()

    async def aclose(self) -> None:
        """Stop the batcher: waiting callers get BatcherClosed, a running search is allowed to finish (a remote
        batch's request is cancelled)."""
        self._closed = True
        stranded = [*self._inflight, *self._pending]  # captured first: cancelling the runner clears _inflight
        remote, self._remote_batches = self._remote_batches, {}
        stranded += [p for batch in remote.values() for p in batch]
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for t in remote:
            t.cancel()
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(t for t in remote if t.get_loop() is loop), return_exceptions=True)
        for p in [*stranded, *self._pending]:
            if not p.future.done():
                p.future.set_exception(BatcherClosed("the retrieval batcher was closed"))
        self._pending.clear()
        self._queued = 0
        self._inflight = []
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
