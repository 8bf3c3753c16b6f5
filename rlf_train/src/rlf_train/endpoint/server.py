"""Kept for one release: see `rlf_train.rollout.endpoint.server`."""

from __future__ import annotations

from rlf_train.rollout.endpoint.server import ChatRequest, Completion, PolicyServer, to_messages

__all__ = ["ChatRequest", "Completion", "PolicyServer", "to_messages"]
