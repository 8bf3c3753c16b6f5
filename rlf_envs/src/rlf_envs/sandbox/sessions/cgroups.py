"""A memory + pids cgroup per local session, where the host lets us make one (as root: cgroup v2 with the memory and
pids controllers, else cgroup v1's memory and pids hierarchies). Without one the session falls back to rlimits
(RLIMIT_AS per process, RLIMIT_NPROC of the session's own uid): `SessionCgroup.create` returns None and says why once.

The session's directories are `<hierarchy>/rlf-sessions/<session id>`; the owner label lists them, so the reaper
removes them with the session. The memory limit is memory_mb + disk_mb + 64 MB: the workspace and /tmp are tmpfs,
whose pages the kernel charges to the cgroup of the process that wrote them, and the agent itself lives there too.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

ROOT = "/sys/fs/cgroup"
GROUP = "rlf-sessions"
_warned = False


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _v2_parent() -> str | None:
    if not os.path.exists(f"{ROOT}/cgroup.controllers"):
        return None
    with open(f"{ROOT}/cgroup.controllers") as f:
        have = f.read().split()
    if "memory" not in have or "pids" not in have:
        return None
    parent = f"{ROOT}/{GROUP}"
    os.makedirs(parent, exist_ok=True)
    _write(f"{ROOT}/cgroup.subtree_control", "+memory +pids")
    _write(f"{parent}/cgroup.subtree_control", "+memory +pids")
    return parent


def _v1_parents() -> tuple[str, str] | None:
    mem, pids = f"{ROOT}/memory", f"{ROOT}/pids"
    if not (os.path.exists(f"{mem}/cgroup.procs") and os.path.exists(f"{pids}/cgroup.procs")):
        return None
    os.makedirs(f"{mem}/{GROUP}", exist_ok=True)
    os.makedirs(f"{pids}/{GROUP}", exist_ok=True)
    return f"{mem}/{GROUP}", f"{pids}/{GROUP}"


@dataclass
class SessionCgroup:
    version: int
    dirs: list[str]

    @classmethod
    def create(cls, sid: str) -> SessionCgroup | None:
        """Make the session's cgroup directories (no limits yet: `limit`), or None where the host has none for us."""
        global _warned
        if os.geteuid() != 0 or os.environ.get("RLF_SESSION_CGROUPS", "1") == "0":
            return None
        try:
            v2 = _v2_parent()
            if v2 is not None:
                d = f"{v2}/{sid}"
                os.mkdir(d)
                return cls(2, [d])
            v1 = _v1_parents()
            if v1 is not None:
                dirs = []
                try:
                    for p in v1:
                        os.mkdir(f"{p}/{sid}")
                        dirs.append(f"{p}/{sid}")
                except OSError:
                    for d in dirs:
                        os.rmdir(d)
                    raise
                return cls(1, dirs)
            why = "no cgroup v2 memory+pids controllers and no cgroup v1 memory/pids hierarchies"
        except OSError as e:
            why = f"cannot make a session cgroup: {e}"
        if not _warned:
            _warned = True
            log.warning("sessions: %s; memory and pids are bounded by rlimits per process / per uid instead", why)
        return None

    def add(self, pid: int) -> None:
        for d in self.dirs:
            _write(f"{d}/cgroup.procs", str(pid))

    def limit(self, memory_mb: int, disk_mb: int, pids: int) -> None:
        mem = (memory_mb + disk_mb + 64) << 20
        if self.version == 2:
            d = self.dirs[0]
            _write(f"{d}/memory.max", str(mem))
            try:
                _write(f"{d}/memory.swap.max", "0")
            except OSError:
                pass
            _write(f"{d}/pids.max", str(pids + 8))
        else:
            mem_d, pids_d = self.dirs
            _write(f"{mem_d}/memory.limit_in_bytes", str(mem))
            try:
                _write(f"{mem_d}/memory.memsw.limit_in_bytes", str(mem))
            except OSError:
                pass
            _write(f"{pids_d}/pids.max", str(pids + 8))  # + the agent and the kill helpers
