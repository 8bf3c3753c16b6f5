"""What the session tests need from the host: the Debian test image and root for the local backend; each test skips
with the reason when they are missing."""

from __future__ import annotations

import os

import pytest


def session_image() -> str | None:
    """The built Debian test image (python3, git, pytest), or None."""
    try:
        from rlf_envs.sandbox.sessions.images import debian_test_image
    except ImportError:
        return None
    return debian_test_image()


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the local session backend needs root")


def need_sessions() -> None:
    """Skip unless the local session backend and the Debian test image are there."""
    need_root()
    if session_image() is None:
        pytest.skip("no session image with pytest: run `python -m rlf_envs.sandbox.sessions.images build-debian`")
