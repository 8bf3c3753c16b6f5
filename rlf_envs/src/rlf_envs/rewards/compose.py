"""Composition: weighted sums, gates (if/then/else), and max/min over verifiers.

Children are scored concurrently with `safe_score`, so a failing child contributes its fallback
(and an `<name>/error` info entry) instead of failing the whole composite.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SerializeAsAny, model_validator

from rlf_envs.rewards.base import Verifier
from rlf_envs.rewards.common import aclose_verifier
from rlf_envs.rewards.config import BuildContext, VerifierConfig, VerifierSpec, _dispatch, register_verifier
from rlf_envs.types import Score, Task, Trajectory


def merge_info(scores: Sequence[Score]) -> dict[str, float]:
    """Union of the children's info; a key seen twice gets a `<i>.` prefix so nothing is lost."""
    out: dict[str, float] = {}
    for i, s in enumerate(scores):
        for k, v in s.info.items():
            out[f"{i}.{k}" if k in out else k] = v
    return out


def combine_per_turn(scores: Sequence[Score], weights: Sequence[float]) -> tuple[float, ...]:
    """Element-wise weighted sum of per-turn values (shorter lists are zero-padded)."""
    n = max((len(s.per_turn) for s in scores), default=0)
    if n == 0:
        return ()
    out = [0.0] * n
    for s, w in zip(scores, weights, strict=True):
        for i, v in enumerate(s.per_turn):
            out[i] += w * v
    return tuple(out)


class _Composite(Verifier):
    children: list[Verifier]

    async def aclose(self) -> None:
        for c in self.children:
            await aclose_verifier(c)


# ------------------------------------------------------------------------------------------------ weighted


class Weighted(_Composite):
    """sum_i w_i * v_i (divided by sum |w_i| when `normalize`), optionally clipped to [clip_min, clip_max]."""

    def __init__(
        self,
        terms: Sequence[tuple[Verifier, float]],
        *,
        normalize: bool = False,
        clip_min: float | None = None,
        clip_max: float | None = None,
        name: str = "weighted",
        fallback: float = 0.0,
    ) -> None:
        if not terms:
            raise ValueError("Weighted needs at least one (verifier, weight) term")
        for v, w in terms:
            if not isinstance(v, Verifier) or not isinstance(w, int | float) or not math.isfinite(w):
                raise TypeError(f"Weighted terms are (Verifier, finite weight) pairs, got ({v!r}, {w!r})")
        self.children = [v for v, _ in terms]
        self.weights = [float(w) for _, w in terms]
        self.normalize, self.clip_min, self.clip_max = normalize, clip_min, clip_max
        self.name, self.fallback = name, fallback

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        scores = await asyncio.gather(*(c.safe_score(trajectory, task) for c in self.children))
        value = sum(w * s.value for w, s in zip(self.weights, scores, strict=True))
        weights = self.weights
        if self.normalize:
            total = sum(abs(w) for w in self.weights) or 1.0
            value /= total
            weights = [w / total for w in self.weights]
        if self.clip_min is not None:
            value = max(self.clip_min, value)
        if self.clip_max is not None:
            value = min(self.clip_max, value)
        info = merge_info(scores)
        info[self.name] = value
        return Score(value, per_turn=combine_per_turn(scores, weights), info=info)


class TermConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    verifier: VerifierSpec
    weight: float = 1.0


@register_verifier
class WeightedConfig(VerifierConfig):
    """Weighted sum of `terms` (each `{verifier: {...}, weight: w}`)."""

    type: Literal["weighted"] = "weighted"
    terms: list[TermConfig] = Field(min_length=1)
    normalize: bool = False
    clip_min: float | None = None
    clip_max: float | None = None

    @model_validator(mode="after")
    def _clip(self) -> WeightedConfig:
        if self.clip_min is not None and self.clip_max is not None and self.clip_min > self.clip_max:
            raise ValueError(f"clip_min ({self.clip_min}) must be <= clip_max ({self.clip_max})")
        return self

    def build(self, ctx: BuildContext) -> Weighted:
        return Weighted(
            [(t.verifier.build(ctx), t.weight) for t in self.terms],
            normalize=self.normalize,
            clip_min=self.clip_min,
            clip_max=self.clip_max,
            name=self.name or "weighted",
            fallback=self.fallback,
        )


# -------------------------------------------------------------------------------------------------- gate


class Gate(_Composite):
    """If `gate` scores >= `threshold`, the score of `inner`; else `otherwise` (a number or a verifier).

    The inner verifier is not run when the gate fails (saves judge / tool calls)."""

    def __init__(
        self,
        gate: Verifier,
        inner: Verifier,
        otherwise: float | Verifier = 0.0,
        *,
        threshold: float = 0.5,
        name: str = "gate",
        fallback: float = 0.0,
    ) -> None:
        self.gate, self.inner, self.otherwise, self.threshold = gate, inner, otherwise, threshold
        self.children = [gate, inner] + ([otherwise] if isinstance(otherwise, Verifier) else [])
        self.name, self.fallback = name, fallback

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        g = await self.gate.safe_score(trajectory, task)
        passed = g.value >= self.threshold
        if passed:
            branch = await self.inner.safe_score(trajectory, task)
        elif isinstance(self.otherwise, Verifier):
            branch = await self.otherwise.safe_score(trajectory, task)
        else:
            branch = Score(float(self.otherwise))
        info = merge_info([g, branch])
        info[f"{self.name}/passed"] = float(passed)
        info[self.name] = branch.value
        return Score(branch.value, per_turn=branch.per_turn, info=info)


def _number_or_verifier(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a number or a verifier mapping, got a boolean")
    if isinstance(value, int | float):
        return float(value)
    return _dispatch(value)


@register_verifier
class GateConfig(VerifierConfig):
    """`inner` if `gate` passes (value >= threshold), else `otherwise` (number or verifier; default 0)."""

    type: Literal["gate"] = "gate"
    gate: VerifierSpec
    inner: VerifierSpec
    otherwise: Annotated[float | SerializeAsAny[VerifierConfig], BeforeValidator(_number_or_verifier)] = 0.0
    threshold: float = 0.5

    def build(self, ctx: BuildContext) -> Gate:
        other = self.otherwise.build(ctx) if isinstance(self.otherwise, VerifierConfig) else self.otherwise
        return Gate(
            self.gate.build(ctx),
            self.inner.build(ctx),
            other,
            threshold=self.threshold,
            name=self.name or "gate",
            fallback=self.fallback,
        )


# ----------------------------------------------------------------------------------------------- max / min


class Extremum(_Composite):
    """The max (or min) of several verifiers' values; per-turn values come from the chosen child."""

    def __init__(self, verifiers: Sequence[Verifier], *, mode: Literal["max", "min"] = "max",
                 name: str | None = None, fallback: float = 0.0) -> None:
        if not verifiers:
            raise ValueError(f"{mode} needs at least one verifier")
        self.children = list(verifiers)
        self.mode = mode
        self.name, self.fallback = name or mode, fallback

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        scores = await asyncio.gather(*(c.safe_score(trajectory, task) for c in self.children))
        pick = (max if self.mode == "max" else min)(scores, key=lambda s: s.value)
        info = merge_info(scores)
        info[self.name] = pick.value
        return Score(pick.value, per_turn=pick.per_turn, info=info)


def Max(verifiers: Sequence[Verifier], **kw: Any) -> Extremum:
    """The best of several verifiers, e.g. Max([ExactMatch(), Weighted([(FormatCheck(), 0.1)])])."""
    return Extremum(verifiers, mode="max", **kw)


def Min(verifiers: Sequence[Verifier], **kw: Any) -> Extremum:
    """The worst of several verifiers."""
    return Extremum(verifiers, mode="min", **kw)


@register_verifier
class MaxConfig(VerifierConfig):
    """The highest value among `verifiers`."""

    type: Literal["max"] = "max"
    verifiers: list[VerifierSpec] = Field(min_length=1)

    def build(self, ctx: BuildContext) -> Extremum:
        return Extremum([v.build(ctx) for v in self.verifiers], mode="max", name=self.name, fallback=self.fallback)


@register_verifier
class MinConfig(VerifierConfig):
    """The lowest value among `verifiers`."""

    type: Literal["min"] = "min"
    verifiers: list[VerifierSpec] = Field(min_length=1)

    def build(self, ctx: BuildContext) -> Extremum:
        return Extremum([v.build(ctx) for v in self.verifiers], mode="min", name=self.name, fallback=self.fallback)
