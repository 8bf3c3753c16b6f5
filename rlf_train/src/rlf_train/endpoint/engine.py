"""Kept for one release: see `rlf_train.rollout.endpoint.engine`."""

from __future__ import annotations

from rlf_train.rollout.endpoint.engine import EngineFront, EngineStats

__all__ = ["EngineFront", "EngineStats"]
