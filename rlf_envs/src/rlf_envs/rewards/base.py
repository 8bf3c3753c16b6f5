"""The verifier interface: `async score(trajectory, task) -> Score`, and `ToolInvoker`, what tool-verified
verifiers call tools through (both plain contracts, imported by config, common and the verifiers)."""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from rlf_envs.types import Score, Task, ToolResult, Trajectory

log = logging.getLogger(__name__)


class Verifier(abc.ABC):
    """Scores a finished trajectory. Subclasses implement `score`; `score_batch` runs them
    concurrently. Verifiers must not raise for bad policy output (score it low instead); an
    exception is logged with the task id and replaced by `fallback` (see `safe_score`)."""

    name: str = "verifier"
    fallback: float = 0.0

    def __deepcopy__(self, memo: dict[int, object]) -> Verifier:
        # verifiers may hold sessions / caches shared by all envs; gymnasium.make deep-copies kwargs
        return self

    @abc.abstractmethod
    async def score(self, trajectory: Trajectory, task: Task) -> Score: ...

    async def safe_score(self, trajectory: Trajectory, task: Task) -> Score:
        try:
            return await self.score(trajectory, task)
        except Exception as e:  # a verifier bug must not kill the batch
            log.warning("verifier %s failed on task %s: %r; scoring %s", self.name, task.id, e, self.fallback)
            return Score(self.fallback, info={f"{self.name}/error": 1.0})

    async def score_batch(self, trajectories: Sequence[Trajectory]) -> list[Score]:
        return list(await asyncio.gather(*(self.safe_score(t, t.task) for t in trajectories)))


class GroupVerifier(abc.ABC):
    """Scores the G trajectories of one task together (e.g. a judge that ranks a GRPO group in one call):
    `score_group` returns one Score per trajectory, in their order. Like a Verifier it must not raise for bad
    policy output, and its own failures end in a logged, counted fallback (never an exception that kills a
    batch). Score a flat batch of groups with `rlf_envs.rewards.score_groups`."""

    name: str = "group_verifier"

    def __deepcopy__(self, memo: dict[int, object]) -> GroupVerifier:
        return self  # holds sessions / counters shared by every user

    @abc.abstractmethod
    async def score_group(self, trajectories: Sequence[Trajectory], task: Task) -> list[Score]: ...

    def metrics(self) -> dict[str, float]:
        """Cumulative counters (cost, failures...) for logging; the trainer logs their change per step."""
        return {}

    async def aclose(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release HTTP sessions and the like."""


@runtime_checkable
class ToolInvoker(Protocol):
    """Calls a tool by name. The env's ToolCaller satisfies this."""

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult: ...
