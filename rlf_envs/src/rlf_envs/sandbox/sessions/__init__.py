"""Sandbox sessions for coding agents: one stateful, isolated workspace per episode (`exec`, files, `diff`, `close`)
on the local backend (namespaces + chroot, no daemon) or the docker backend. See docs/sessions.md.

Importable without torch and without the docker SDK (the docker backend imports it when opened)."""

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
    """A session backend by name: "local" (`LocalBackend(**kwargs)`) or "docker" (`DockerBackend(**kwargs)`,
    DOCKER_HOST honoured; needs the `docker` extra: `pip install -e './rlf_envs[docker]'`); a SessionBackend
    instance is returned as is."""
    if isinstance(backend, SessionBackend):
        return backend
    if backend == "local":
        from rlf_envs.sandbox.sessions.local import LocalBackend

        return LocalBackend(**kwargs)
    if backend == "docker":
        from rlf_envs.sandbox.sessions.docker import DockerBackend

        return DockerBackend(**kwargs)
    raise ValueError(f"unknown session backend {backend!r}: use 'local', 'docker' or a SessionBackend instance")
