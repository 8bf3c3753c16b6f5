"""Which child processes of the test process are leftovers: every live child except the sandbox's warm pool
(`rlf_envs.sandbox.pool`: a trusted zygote and its idle supervisors live as long as the process that started
them, by design, so a test that ran Code-v0 earlier in the session leaves them behind legitimately)."""

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


def leftover_children() -> list[psutil.Process]:
    pool = sandbox_pool_pids()
    return [p for p in psutil.Process().children(recursive=True)
            if p.pid not in pool and p.is_running() and p.status() != "zombie"]
