"""Which child processes of the test process are leftovers: every live child except the warm pools that live as long
as the process that started them, by design: the sandbox's (`rlf_envs.sandbox.pool`: a trusted zygote and its idle
supervisors, after any test that ran Code-v0) and the agent forker and idle agents of open local session backends
(the SWE env's shared backend, closed when the process exits)."""

from __future__ import annotations

import psutil


def sandbox_pool_pids() -> set[int]:
    from rlf_envs.sandbox import pool

    default = pool._default
    zygote = default.zygote_pid if default is not None else None
    if zygote is None:
        return set()
    try:
        return {zygote, *(p.pid for p in psutil.Process(zygote).children(recursive=True))}
    except psutil.NoSuchProcess:
        return set()


def session_pool_pids() -> set[int]:
    """The agent forker (zygote) of this process's open local session backends, their idle (pooled, sessionless)
    agents, and those agents' children (an agent of an open session is a leftover)."""
    import sys

    local = sys.modules.get("rlf_envs.sandbox.sessions.local")
    out: set[int] = set()
    for backend in list(getattr(local, "_OPEN", ())):
        z = backend._zygote.proc
        if z is not None and z.returncode is None:
            out.add(z.pid)
        for agent in backend.pool.all_idle():
            try:
                proc = psutil.Process(agent.proc.pid)
                out |= {proc.pid, *(c.pid for c in proc.children(recursive=True))}
            except psutil.NoSuchProcess:
                continue
    return out


def leftover_children() -> list[psutil.Process]:
    pool = sandbox_pool_pids() | session_pool_pids()
    return [p for p in psutil.Process().children(recursive=True)
            if p.pid not in pool and p.is_running() and p.status() != "zombie"]
