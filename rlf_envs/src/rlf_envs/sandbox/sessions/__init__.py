"""Sandbox sessions for coding agents: one stateful, isolated workspace per episode (`exec`, files, `diff`, `close`)
on the local backend (namespaces + chroot, no daemon), the docker backend, or across a Ray cluster (the ray backend:
a host actor per node running one of the others there). See docs/sessions.md.

Importable without torch, the docker SDK and Ray (each backend imports what it needs when opened)."""

from __future__ import annotations

from typing import Any

from rlf_envs.sandbox.sessions.types import (
    ExecResult,
    Session,
    SessionBackend,
    SessionClosed,
    SessionDiffTooLarge,
    SessionError,
    SessionExpired,
    SessionFileNotFound,
    SessionInfraError,
    SessionLimitExceeded,
    SessionLimits,
    SessionSpec,
)

__all__ = ["ExecResult", "Session", "SessionBackend", "SessionClosed", "SessionDiffTooLarge", "SessionError",
           "SessionExpired", "SessionFileNotFound", "SessionInfraError", "SessionLimitExceeded", "SessionLimits",
           "SessionSpec", "open_backend"]


def open_backend(backend: str | SessionBackend = "local", **kwargs: Any) -> SessionBackend:
    """A session backend by name: "local" (`LocalBackend(**kwargs)`), "docker" (`DockerBackend(**kwargs)`,
    DOCKER_HOST honoured; needs the `docker` extra: `pip install -e './rlf_envs[docker]'`) or "ray"
    (`RayBackend(**kwargs)`: sessions across a Ray cluster, RLF_RAY_ADDRESS else address="auto"; needs the `ray`
    extra: `pip install -e './rlf_envs[ray]'`); a SessionBackend instance is returned as is."""
    if isinstance(backend, SessionBackend):
        return backend
    if backend == "local":
        from rlf_envs.sandbox.sessions.local import LocalBackend

        return LocalBackend(**kwargs)
    if backend == "docker":
        from rlf_envs.sandbox.sessions.docker import DockerBackend

        return DockerBackend(**kwargs)
    if backend == "ray":
        from rlf_envs.sandbox.sessions.ray import RayBackend

        return RayBackend(**kwargs)
    raise ValueError(f"unknown session backend {backend!r}: use 'local', 'docker', 'ray' or a SessionBackend "
                     "instance")
