"""Shared helpers for verifier implementations."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, TypeVar

from rlf_envs.rewards.base import Verifier
from rlf_envs.rewards.config import VerifierConfig, validate_kwargs
from rlf_envs.types import Score, Trajectory

CfgT = TypeVar("CfgT", bound=VerifierConfig)


class ConfiguredVerifier(Verifier, Generic[CfgT]):
    """A verifier whose parameters are one typed config. Construct from the config or from keyword
    arguments, which are validated with the same rules (and error messages) as YAML."""

    config_cls: ClassVar[type[VerifierConfig]]

    def __init__(self, config: CfgT | None = None, **kwargs: Any) -> None:
        if config is not None and kwargs:
            raise TypeError(f"{type(self).__name__}: pass either a config or keyword arguments, not both")
        cfg = config if config is not None else validate_kwargs(self.config_cls, kwargs)
        if not isinstance(cfg, self.config_cls):
            raise TypeError(f"{type(self).__name__} needs a {self.config_cls.__name__}, got {type(cfg).__name__}")
        self.cfg: CfgT = cfg  # type: ignore[assignment]
        self.name = cfg.name or cfg.type
        self.fallback = cfg.fallback

    def __repr__(self) -> str:
        fields = {k: v for k, v in self.cfg.model_dump(exclude={"type"}).items() if v is not None}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"

    def result(self, value: float, extra: Mapping[str, float] | None = None, per_turn: tuple[float, ...] = ()) -> Score:
        """A Score whose info holds `name` -> value plus `name/<key>` entries for `extra`."""
        info = {self.name: float(value)}
        if extra:
            info.update({f"{self.name}/{k}": float(v) for k, v in extra.items()})
        return Score(float(value), per_turn=per_turn, info=info)


class LoopSemaphore:
    """An asyncio.Semaphore per event loop (a verifier may be used from several loops over its life)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._sem: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def get(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._sem is None or self._loop is not loop:
            self._sem, self._loop = asyncio.Semaphore(self.limit), loop
        return self._sem


def action_texts(trajectory: Trajectory) -> list[str]:
    """The policy's own text of each turn (observations excluded)."""
    return [t.action.text for t in trajectory.turns]


async def aclose_verifier(verifier: Verifier) -> None:
    """Release a verifier's resources (HTTP sessions...) if it holds any; composites close their children."""
    close = getattr(verifier, "aclose", None)
    if close is not None:
        await close()
