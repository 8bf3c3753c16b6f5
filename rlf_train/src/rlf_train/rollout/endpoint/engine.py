"""The endpoint's engine front: requests from many sessions batched into the rollout engine's calls.

The rollout engine is a `GenerateBatchFn` (`rlf_envs.env.episodes`): the trainer's local sampler or
its vLLM engine, the same functions the env-driven rollouts call. Calls block while the model runs, so they
run on a thread of their own (with its own event loop); the server's loop keeps accepting requests
meanwhile. A batch (one engine call) takes every request waiting: the batcher waits until every open session
has one waiting, or the burst of arrivals pauses for `window_s`, or `max_wait_s` passed. So 64 concurrent
agents in lock-step cost about what 64 env-driven episodes do.

A request may carry a sampling seed (the server gives each call of a session one, derived from the run's seed):
an engine that takes per-context `seeds` (the local sampler, `rlf_train.rollout.local.local_generate_batch`) then
samples each request from its own seed, so its tokens do not depend on which requests share its batch or the
order they arrived in.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future as ThreadFuture
from dataclasses import dataclass, field

from rlf_envs.env.episodes import GenerateBatchFn, Generation


@dataclass
class EngineStats:
    """What the engine front did since it was last reset: batches, requests, generated tokens and time."""

    batches: int = 0
    requests: int = 0
    gen_tokens: int = 0
    gen_seconds: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)


@dataclass
class _Pending:
    prompt: list[int]
    max_tokens: int
    future: asyncio.Future[tuple[Generation, int]]
    seed: int | None = None


class EngineFront:
    """`await generate(prompt_ids, max_tokens) -> (Generation, policy_version)`, batched (module docstring).

    `generate_batch` is swapped with `set_engine` when the sampling settings or weights change; `version` is
    the policy version of the weights the engine holds. `pause()` / `resume()` hold new batches back while
    the weights are swapped (requests wait; none fails)."""

    def __init__(self, generate_batch: GenerateBatchFn, stop: Sequence[str], version: int = 0,
                 window_s: float = 0.002, max_wait_s: float = 0.05, max_batch: int = 256) -> None:
        self.generate_batch = generate_batch
        self.stop = list(stop)
        self.version = version
        self.window_s = window_s
        self.max_wait_s = max_wait_s
        self.expected: Callable[[], int] = lambda: 1  # how many requests a full round has (the open sessions)
        # called on the engine's thread before each batch; returns the policy version that will generate it
        # (async RL: the newest published weights are loaded there, between engine calls)
        self.refresh: Callable[[], int] | None = None
        self.max_batch = max_batch
        self.stats = EngineStats()
        self._queue: list[_Pending] = []
        self._wake: asyncio.Event | None = None
        self._runner: asyncio.Task[None] | None = None
        self._open: asyncio.Event | None = None  # made on the serving loop (`start`)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def set_engine(self, generate_batch: GenerateBatchFn, version: int) -> None:
        self.generate_batch = generate_batch
        self.version = version

    @staticmethod
    def takes_seeds(generate_batch: GenerateBatchFn) -> bool:
        """Whether an engine's `generate_batch` takes per-context `seeds` (else requests' seeds are not passed)."""
        try:
            return "seeds" in inspect.signature(generate_batch).parameters
        except (TypeError, ValueError):
            return False

    # -- life (on the serving loop) -------------------------------------------------------------------
    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._open = asyncio.Event()
        self._open.set()
        ready = threading.Event()

        def engine_thread() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=engine_thread, name="rlf-endpoint-engine", daemon=True)
        self._thread.start()
        ready.wait()
        self._runner = asyncio.create_task(self._run(), name="rlf-endpoint-batcher")

    async def close(self) -> None:
        self._closed = True
        if self._runner is not None:
            self._runner.cancel()
            try:
                await self._runner
            except (asyncio.CancelledError, Exception):
                pass
        for p in self._queue:
            if not p.future.done():
                p.future.set_exception(RuntimeError("the endpoint's engine was closed"))
        self._queue.clear()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def pause(self) -> None:
        assert self._open is not None
        self._open.clear()

    def resume(self) -> None:
        assert self._open is not None
        self._open.set()
        if self._wake is not None:
            self._wake.set()

    @property
    def paused(self) -> bool:
        return self._open is not None and not self._open.is_set()

    # -- requests ----------------------------------------------------------------------------------------
    async def generate(self, prompt: list[int], max_tokens: int, seed: int | None = None) -> tuple[Generation, int]:
        """`seed`: this request's sampling seed (None: one from the engine's generator)."""
        if self._closed or self._wake is None:
            raise RuntimeError("the endpoint's engine is not running")
        fut: asyncio.Future[tuple[Generation, int]] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(prompt, max_tokens, fut, seed))
        self._wake.set()
        return await fut

    async def _run(self) -> None:
        assert self._wake is not None and self._open is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._open.wait()
            if not self._queue:
                continue
            await self._gather()
            batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
            batch = [p for p in batch if not p.future.done()]  # a client that went away
            if self._queue:
                self._wake.set()
            if not batch:
                continue
            t0 = time.perf_counter()
            try:
                gens, version = await self._call([p.prompt for p in batch], [p.max_tokens for p in batch],
                                                 [p.seed for p in batch])
                if len(gens) != len(batch):
                    raise RuntimeError(f"the engine returned {len(gens)} generations for {len(batch)} prompts")
            except Exception as e:  # every waiting request gets the error (HTTP 500), the server goes on
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            self.stats.gen_seconds += time.perf_counter() - t0
            self.stats.batches += 1
            self.stats.requests += len(batch)
            self.stats.batch_sizes.append(len(batch))
            for p, g in zip(batch, gens, strict=True):
                self.stats.gen_tokens += len(g.ids)
                if not p.future.done():
                    p.future.set_result((g, version))

    async def _gather(self) -> None:
        """Wait for this round's requests: until every open session has one waiting (`expected`), or none
        arrived for `window_s` (the burst is over), or `max_wait_s` passed."""
        if self.window_s <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        seen = -1
        while len(self._queue) < min(self.expected(), self.max_batch) and len(self._queue) != seen \
                and loop.time() < deadline:
            seen = len(self._queue)
            await asyncio.sleep(self.window_s)

    async def _generate(self, contexts: list[list[int]], max_tokens: list[int], seeds: list[int | None]
                        ) -> tuple[Sequence[Generation], int]:
        """On the engine's thread: the weights swap (`refresh`), then the batch; the version that generated it."""
        version = self.refresh() if self.refresh is not None else self.version
        fn = self.generate_batch
        if any(s is not None for s in seeds) and self.takes_seeds(fn):
            return await fn(contexts, max_tokens, self.stop, seeds=seeds), version  # type: ignore[call-arg]
        return await fn(contexts, max_tokens, self.stop), version

    async def _call(self, contexts: list[list[int]], max_tokens: list[int], seeds: list[int | None] | None = None
                    ) -> tuple[Sequence[Generation], int]:
        assert self._loop is not None
        fut: ThreadFuture[tuple[Sequence[Generation], int]] = asyncio.run_coroutine_threadsafe(
            self._generate(contexts, max_tokens, seeds if seeds is not None else [None] * len(contexts)), self._loop)
        return await asyncio.wrap_future(fut)
