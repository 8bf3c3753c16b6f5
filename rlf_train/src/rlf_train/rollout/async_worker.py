"""Rollouts ahead of the learner (`rollout.mode: async`, docs/guides/async-rl.md): what every async worker shares.

- `Admission`: the staleness bound. Group k (the k-th GRPO group of the run, in data order) belongs to update
  u(k) = k // groups_per_update + 1, which trains starting from weights version u(k) - 1. A group may start only when
  the rollout's weights version v satisfies v >= u(k) - 1 - max_staleness; versions only grow while an episode runs,
  so no token of it is more than max_staleness versions behind the policy that trains on it. Nothing is ever
  discarded: work that would be too stale is never started.
- `AsyncWorker`: the skeleton of a worker on rlf's event-loop thread (where the tools live): a coroutine fills each
  update's batch part by part while the learner's thread updates, and `next_batch(u)` waits for a whole batch. The
  env worker (`env_source.AsyncRollout`) and the agent worker (`agent_source.AgentWorker`) are built on it; the env
  worker in a process of its own (`env_source.ProcessRollout`) keeps the same learner-side face (`RolloutWorker`).
- `AsyncPlan`: what the learner hands a source to start its worker (`Source.async_worker`).
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlf_envs import runtime
from rlf_envs.types import Trajectory
from rlf_train.rollout.batch import SamplingParams


@dataclass(frozen=True)
class AdmissionEvent:
    """One group's start: which group, the update that trains on it, the weights version it started at."""

    group: int  # k: the group's index in the run's data order
    update: int  # u(k): the update that trains on it
    version: int  # the rollout's weights version when it started


@dataclass
class Admission:
    """The staleness bound as admission control (see the module docstring). `events` logs every start."""

    groups_per_update: int
    max_staleness: int
    events: list[AdmissionEvent] = field(default_factory=list)

    def update_of(self, group: int) -> int:
        return group // self.groups_per_update + 1

    def allows(self, group: int, version: int) -> bool:
        return version >= self.update_of(group) - 1 - self.max_staleness

    def admit(self, group: int, version: int) -> None:
        if not self.allows(group, version):
            raise RuntimeError(f"admission: group {group} (update {self.update_of(group)}) may not start at "
                               f"weights version {version} with max_staleness {self.max_staleness}")
        self.events.append(AdmissionEvent(group, self.update_of(group), version))


@dataclass
class AsyncBatch:
    """The finished groups of one update, rows in data order (G samples of a prompt contiguous)."""

    update: int
    trajectories: list[Trajectory]
    gen_tokens: int
    episodes: Any = None  # rlf_train.rollout.batch.Rollouts when rows are an agent's segments (AgentWorker)


@dataclass
class WorkerTimes:
    """Where the rollout worker's wall time went (seconds since `start`)."""

    generate: float = 0.0  # generating (the worker's busy time)
    wall: float = 0.0


@dataclass
class AsyncPlan:
    """What the learner hands a rollout source to start its async worker: the policy to copy, the sampling, the
    staleness bound, each update's prompts (one task index per group), the updates to run, how many weight versions
    the worker may still need (`keep`), the group size, the engine's batch size and the sampler's generator."""

    model: Any  # the learner's policy: the worker takes a frozen copy (or its weights in shared memory)
    params: SamplingParams
    admission: Admission
    prompts: dict[int, list[int]]  # update -> its task indices
    first_update: int
    last_update: int
    keep: int
    group_size: int
    batch_size: int
    gen: Any  # torch.Generator
    env_hook: Callable[[Any], None] | None = None  # applied to a worker process's own envs (benchmarks)


class RolloutWorker(Protocol):
    """The learner's side of an async worker: `store` takes the published weights, `next_batch(u)` gives update u's
    batch (u = first_update, first_update + 1, ...), `times` says where the worker's time went."""

    admission: Admission
    times: WorkerTimes

    @property
    def store(self) -> Any: ...

    def start(self) -> None: ...

    def next_batch(self, update: int, timeout: float = ...) -> AsyncBatch: ...

    def stop(self, timeout: float = ...) -> None: ...


def frozen_copy(model: Any) -> Any:
    """A copy of the policy for a rollout worker (no gradients)."""
    worker_model = copy.deepcopy(model)
    for p in worker_model.parameters():
        p.requires_grad_(False)
    return worker_model


class AsyncWorker:
    """The skeleton of an async worker on rlf's loop: `start()`, then `next_batch(u)` for each update, `stop()`.

    A subclass writes `_work` (the coroutine that finishes the parts of each update's batch and hands each over with
    `_put`), `_parts(u)` (how many parts make update u's batch) and `_batch(u, parts)` (the parts as an `AsyncBatch`).
    A worker error is raised in the learner's `next_batch`; the worker's own clean-up goes in `_finish`."""

    #: how errors and timeouts name the worker and what it makes
    what = "async rollout worker"
    items = "rollouts"

    def __init__(self, store: Any, admission: Admission) -> None:
        self.store, self.admission = store, admission
        self.times = WorkerTimes()
        self._cond = threading.Condition()
        self._done: dict[int, dict[int, Any]] = {}  # update -> part -> finished part
        self._error: BaseException | None = None
        self._stop = False
        self._future: Any = None

    # ------------------------------------------------------------------ learner side
    def start(self) -> None:
        self._future = asyncio.run_coroutine_threadsafe(self._main(), runtime.get_loop())

    def next_batch(self, update: int, timeout: float = 3600.0) -> AsyncBatch:
        """Wait until every part of `update` has finished; a worker error is raised here."""
        need = self._parts(update)
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._done.get(update, {})) < need:
                if self._error is not None:
                    raise RuntimeError(f"the {self.what} failed: {self._error!r}") from self._error
                if self._future is not None and self._future.done() and self._error is None:
                    raise RuntimeError(f"the {self.what} stopped before update {update}'s batch was done")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"update {update}'s {self.items} not done after {timeout:.0f} s")
                self._cond.wait(min(left, 0.5))
            taken = self._take(update)
        return self._batch(update, taken)

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the worker (episodes in flight are abandoned: a resumed run starts them again)."""
        self._stop = True
        fut, self._future = self._future, None
        if fut is not None:
            self._halt(fut)
            try:
                fut.result(timeout)
            except BaseException:
                fut.cancel()

    # ------------------------------------------------------------------ worker side (rlf's loop thread)
    async def _main(self) -> None:
        try:
            await self._work()
        except BaseException as e:
            with self._cond:
                self._error = e
                self._cond.notify_all()
            raise
        finally:
            await self._finish()
            with self._cond:
                self._cond.notify_all()

    def _put(self, update: int, part: int, value: Any) -> None:
        """Hand a finished part of `update`'s batch to the learner's side."""
        with self._cond:
            self._done.setdefault(update, {})[part] = value
            self._cond.notify_all()

    # ------------------------------------------------------------------ what a worker writes
    async def _work(self) -> None:
        raise NotImplementedError

    async def _finish(self) -> None:
        """Clean-up when `_work` ends, however it ends."""

    def _halt(self, future: Any) -> None:
        """What `stop` does before it waits for `_work` to end (default: nothing; `_work` sees `self._stop`)."""

    def _parts(self, update: int) -> int:
        raise NotImplementedError

    def _take(self, update: int) -> Any:
        """Under the lock, once `update` is complete: its parts, removed."""
        return self._done.pop(update)

    def _batch(self, update: int, parts: Any) -> AsyncBatch:
        raise NotImplementedError
