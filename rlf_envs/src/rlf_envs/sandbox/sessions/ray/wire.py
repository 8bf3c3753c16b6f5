"""What travels between a `RayBackend` and its host actors: the host's configuration, and errors as plain data.

A host actor never lets an exception out of a method (Ray would wrap it, and pickling drops the extra arguments of
an exception such as `SessionLimitExceeded.limit`): it returns `("ok", value)`, `("full", load)` or
`("err", mro_names, message, extra)`, and the client raises the same class with the same message and fields. No Ray
import here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlf_envs.sandbox.sessions.images import ImageError
from rlf_envs.sandbox.sessions.types import (
    SessionClosed,
    SessionDiffTooLarge,
    SessionError,
    SessionExpired,
    SessionFileNotFound,
    SessionInfraError,
    SessionLimitExceeded,
)

#: the exception classes a host's reply may name, most specific first (a class's MRO is searched in order)
KNOWN: dict[str, type[Exception]] = {c.__name__: c for c in (
    SessionDiffTooLarge, SessionExpired, SessionLimitExceeded, SessionFileNotFound, SessionClosed, SessionInfraError,
    SessionError, ImageError, ValueError, TypeError)}

Reply = tuple[Any, ...]


def encode_error(e: BaseException) -> Reply:
    extra: dict[str, Any] = {}
    if isinstance(e, SessionLimitExceeded):
        extra["limit"] = e.limit
    return ("err", [c.__name__ for c in type(e).__mro__], str(e), extra)


def decode_error(names: list[str], message: str, extra: dict[str, Any], where: str) -> Exception:
    """The exception a host's ("err", ...) reply stands for: the same class (the first of its MRO known here) with
    the same message; anything else the host raised is its own failure, a SessionInfraError naming it."""
    for n in names:
        cls = KNOWN.get(n)
        if cls is None:
            continue
        if cls is SessionDiffTooLarge:
            return SessionDiffTooLarge(message)
        if cls is SessionLimitExceeded:
            return SessionLimitExceeded(message, str(extra.get("limit") or "resources"))
        return cls(message)
    return SessionInfraError(f"the session host on {where} failed: {names[0] if names else '?'}: {message}")


@dataclass(frozen=True)
class HostConfig:
    """One host actor's settings (the same for every host of a backend; `cap` is the node's own)."""

    group: str
    run_id: str
    inner: str  # "local" | "docker"
    inner_kwargs: dict[str, Any]
    cap: int
    creates_per_s: float
    lease_s: float
    #: environment variables set in the host actor's process before its backend starts (RLF_SESSIONS_DIR...)
    env: dict[str, str] = field(default_factory=dict)
    #: the node-local seed cache's bound (unused seeds beyond it are removed, oldest first)
    seed_cache_mb: int = 4096
