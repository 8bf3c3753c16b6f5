"""Kept for one release: see `rlf_train.rollout.endpoint.sessions`. `SessionError` and `SessionLimits` were renamed
`EndpointError` and `EndpointLimits` (the sandbox sessions own those names: `rlf_envs.sandbox.sessions`)."""

from __future__ import annotations

from rlf_train.rollout.endpoint.sessions import (
    BREAK_KINDS,
    EndpointError,
    EndpointLimits,
    GenTurn,
    Point,
    Prepared,
    PromptCache,
    Segment,
    Session,
    SessionStore,
    StartKind,
    request_key,
    tools_key,
)

SessionError = EndpointError
SessionLimits = EndpointLimits

__all__ = ["BREAK_KINDS", "EndpointError", "EndpointLimits", "GenTurn", "Point", "Prepared", "PromptCache",
           "Segment", "Session", "SessionError", "SessionLimits", "SessionStore", "StartKind", "request_key",
           "tools_key"]
