"""Ending a tool server's whole process tree: its process group, its session, and whatever still holds its
pipes.

A server started with `start_new_session=True` leads a new session and process group. Its children stay in
both unless they leave on purpose; `killpg` reaches them even after the leader is gone. On Linux, members
that moved to another group of the same session, and anything that still holds one of the server's pipes
(e.g. a daemon started with `setsid` that inherited stdout, which would keep the pipe open for ever),
are found through /proc and killed too. A process that leaves the session *and* closes the inherited
pipes escapes; only a container or cgroup confines that (see docs/security.md, "Threat model: hostile policies").
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterable

_PROC = "/proc"


def _stat_session(pid: str) -> int | None:
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # fields after the command name (which may hold spaces and parentheses): state ppid pgrp session ...
    rest = data[data.rfind(b")") + 2 :].split()
    try:
        return int(rest[3])
    except (IndexError, ValueError):
        return None


def _holds_pipe(pid: str, links: set[str]) -> bool:
    try:
        fds = os.listdir(f"{_PROC}/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"{_PROC}/{pid}/fd/{fd}") in links:
                return True
        except OSError:
            continue
    return False


def tree_members(sid: int, pipe_inodes: Iterable[int] = ()) -> list[int]:
    """Pids (not ours) in session `sid` or holding one of the pipes `pipe_inodes`. Linux only: [] elsewhere."""
    if not sys.platform.startswith("linux") or not os.path.isdir(_PROC):
        return []
    links = {f"pipe:[{ino}]" for ino in pipe_inodes}
    me = os.getpid()
    found: list[int] = []
    for name in os.listdir(_PROC):
        if not name.isdigit() or int(name) == me:
            continue
        if _stat_session(name) == sid or (links and _holds_pipe(name, links)):
            found.append(int(name))
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie is not)."""
    if sys.platform.startswith("linux"):
        try:
            with open(f"{_PROC}/{pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
        except (OSError, IndexError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _running(leader: int, targets: list[int]) -> bool:
    """Is any of `targets` or of the leader's group / session still running (zombies do not count)?"""
    if any(_alive(p) for p in targets):
        return True
    if sys.platform.startswith("linux"):
        return any(_alive(p) for p in tree_members(leader))
    try:
        os.killpg(leader, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def kill_tree(leader: int, pipe_inodes: Iterable[int] = (), grace_s: float = 0.5, wait_s: float = 2.0) -> list[int]:
    """SIGTERM the server's group, session and pipe holders, SIGKILL what is left after `grace_s`, and wait up
    to `wait_s` for them to be gone. Blocking (run it in a thread from a loop). Returns the pids still
    running (normally none)."""
    inodes = tuple(pipe_inodes)
    for sig, pause in ((signal.SIGTERM, grace_s), (signal.SIGKILL, wait_s)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(leader, sig)
        targets = tree_members(leader, inodes)
        for pid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + pause
        while _running(leader, targets):
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        else:
            return []
    return [p for p in tree_members(leader, inodes) if _alive(p)]
