"""The one cgroup helper of the sandbox: a memory (+ pids) cgroup per stateless run and per session (as root).

Stdlib only, like every module the supervisor loads: it runs with a bare interpreter (see `_supervisor`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

from rlf_envs.sandbox._base import Guards

# ------------------------------------------------------------------------------------------- memory cgroup
#
# RLIMIT_AS bounds each process of a run, not the run: a run of N processes could hold N x memory_mb. As root, every
# process of a run is put in a memory cgroup of its own (v2 where the memory controller is there, else v1) limited to
# memory_mb in all (resident memory, page cache and the tmpfs pages it writes; swap included where the kernel
# accounts it); the kernel's OOM killer acts inside it. Named `rlf-sbx-<owner pid>-<n>`: the owner (the supervisor, or
# the zygote for a direct worker) removes it once the run's processes are gone; a dead owner's are swept when a
# zygote starts. Without root (or a memory controller) the bound is RLIMIT_AS per process x RLIMIT_NPROC processes.
#
# A session (`sessions/local.py`) gets the same, plus the pids controller where there is one (`make_cgroup`:
# `rlf-ses-<session id>`, beside the runs' cgroups; v1 puts it in the pids hierarchy's copy of our cgroup); its owner
# label lists the directories, and the sessions' reaper removes a dead owner's (`remove_cgroups`).

CGROUP_PREFIX = "rlf-sbx-"
SESSION_PREFIX = "rlf-ses-"
#: where run cgroups are made: (directory, "v2" | "v1"), or the reason there is none; probed once per process
_CGROUP_PARENT: tuple[str, str] | str | None = None
#: where pids cgroups are made (the memory parent on v2, the pids hierarchy on v1), or None: probed once per process
_PIDS_PARENT: str | bool | None = False
#: the name of the cgroup of the next run forked here (set by the zygote before each fork; the cold path makes one)
_CGROUP_NAME: str | None = None


def _hierarchies() -> tuple[list[list[str]], str | None, dict[str, str]] | str:
    """(our /proc/self/cgroup lines as [hierarchy id, controllers, path], the cgroup2 mount point, {v1 controller:
    its mount point}), or why they cannot be read."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [ln.rstrip("\n").split(":", 2) for ln in f if ln.count(":") >= 2]
        with open("/proc/self/mountinfo") as f:
            mounts = [ln.split() for ln in f]
    except OSError as e:
        return f"cannot read /proc/self/cgroup or mountinfo ({e})"
    v2_mount: str | None = None
    v1: dict[str, str] = {}
    for m in mounts:
        sep = m.index("-")
        fstype, opts = m[sep + 1], m[sep + 3].split(",") if len(m) > sep + 3 else []
        if fstype == "cgroup2" and v2_mount is None:
            v2_mount = m[4]
        elif fstype == "cgroup":
            for c in ("memory", "pids"):
                if c in opts:
                    v1.setdefault(c, m[4])
    return lines, v2_mount, v1


def _probe_cgroup_parent() -> tuple[str, str] | str:
    """Where this process may make memory cgroups, or why it may not."""
    if os.geteuid() != 0:
        return "not root: cgroups are not delegated to this uid"
    h = _hierarchies()
    if isinstance(h, str):
        return h
    lines, v2_mount, v1 = h
    for hier, controllers, path in lines:
        if hier == "0" and controllers == "" and v2_mount is not None:
            here = os.path.normpath(v2_mount + "/" + path)
            try:
                with open(os.path.join(here, "cgroup.controllers")) as f:
                    available = f.read().split()
            except OSError:
                continue
            if "memory" not in available:
                continue
            # (no internal processes: our own cgroup holds us, so runs go beside it, in its parent)
            parent = here if os.path.normpath(path) == "/" else os.path.dirname(here)
            if parent == here:
                try:
                    _write(os.path.join(here, "cgroup.subtree_control"), "+memory")
                except OSError:
                    continue
            if os.access(parent, os.W_OK):
                return parent, "v2"
        if "memory" in controllers.split(",") and "memory" in v1:
            here = os.path.normpath(v1["memory"] + "/" + path)
            if os.access(here, os.W_OK):
                return here, "v1"
    return "no writable memory cgroup (v2 memory controller or v1 memory hierarchy) for this process"


def _probe_pids_parent() -> str | None:
    """Where pids cgroups go beside the memory cgroups of `_cgroup_parent`: the same directory on v2 (the pids
    controller enabled for its children where it can be), the pids hierarchy's copy of our cgroup on v1; else None."""
    where = _cgroup_parent()
    h = _hierarchies()
    if isinstance(where, str) or isinstance(h, str):
        return None
    parent, version = where
    lines, _v2, v1 = h
    if version == "v2":
        with contextlib.suppress(OSError):
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                if "pids" in f.read().split():
                    return parent
            _write(os.path.join(parent, "cgroup.subtree_control"), "+pids")
            return parent
        return None
    for _hier, controllers, path in lines:
        if "pids" in controllers.split(",") and "pids" in v1:
            here = os.path.normpath(v1["pids"] + "/" + path)
            if os.access(here, os.W_OK):
                return here
    return None


def _cgroup_parent() -> tuple[str, str] | str:
    global _CGROUP_PARENT
    if _CGROUP_PARENT is None:
        _CGROUP_PARENT = _probe_cgroup_parent()
    return _CGROUP_PARENT


def _pids_parent() -> str | None:
    global _PIDS_PARENT
    if _PIDS_PARENT is False:
        _PIDS_PARENT = _probe_pids_parent()
    return _PIDS_PARENT  # type: ignore[return-value]


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def limit_cgroup(dirs: list[str], memory_bytes: int, pids: int | None = None) -> None:
    """Limit a cgroup made here (its directories: v2's one, v1's memory and pids ones) to `memory_bytes` in all
    (swap none, or counted in, where the kernel accounts it) and `pids` processes where there is a pids directory.
    Raises OSError if a limit cannot be written."""
    for d in dirs:
        if os.path.exists(os.path.join(d, "memory.max")):
            _write(os.path.join(d, "memory.max"), str(memory_bytes))
            if os.path.exists(os.path.join(d, "memory.swap.max")):
                with contextlib.suppress(OSError):
                    _write(os.path.join(d, "memory.swap.max"), "0")
        elif os.path.exists(os.path.join(d, "memory.limit_in_bytes")):
            _write(os.path.join(d, "memory.limit_in_bytes"), str(memory_bytes))
            if os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
                with contextlib.suppress(OSError):
                    _write(os.path.join(d, "memory.memsw.limit_in_bytes"), str(memory_bytes))
        if pids is not None and os.path.exists(os.path.join(d, "pids.max")):
            _write(os.path.join(d, "pids.max"), str(pids))


def make_cgroup(name: str, pids: bool = True) -> list[str] | str:
    """As root: make the cgroup `name` (no limits yet: `limit_cgroup`) beside the runs' ones -- memory, and pids where
    there is a pids controller (`pids`) -- and return its directories, or why there is none."""
    where = _cgroup_parent()
    if isinstance(where, str):
        return where
    parents = [where[0]]
    pids_parent = _pids_parent() if pids else None
    if pids_parent is not None and pids_parent not in parents:
        parents.append(pids_parent)
    made: list[str] = []
    try:
        for p in parents:
            d = os.path.join(p, name)
            with contextlib.suppress(FileExistsError):  # (a run's name reused after a busy removal: empty again)
                os.mkdir(d, 0o755)
            made.append(d)
    except OSError as e:
        remove_cgroups(made, 0)
        return f"cannot make {os.path.join(parents[len(made)], name)} ({e.strerror})"
    return made


def enter_cgroup(dirs: list[str], pid: int = 0) -> None:
    """Move `pid` (0: the caller) into the cgroup's directories; every process it starts stays in them."""
    for d in dirs:
        _write(os.path.join(d, "cgroup.procs"), str(pid))


def procs(dirs: list[str]) -> set[int]:
    """The pids in the cgroup's directories (`cgroup.procs`); OSError or ValueError when one cannot be read."""
    out: set[int] = set()
    for d in dirs:
        with open(os.path.join(d, "cgroup.procs")) as f:
            out.update(int(x) for x in f.read().split())
    return out


def remove_cgroups(paths: list[str], wait_s: float = 0.2, kill: bool = False) -> bool:
    """rmdir each cgroup once its processes are gone (the kernel refuses while any is left: retried for `wait_s`);
    with `kill`, SIGKILL what is still in them first (a session whose owner died). Whether all are gone."""
    end = time.monotonic() + wait_s
    left = [p for p in paths if p]
    while True:
        busy = []
        for path in left:
            if kill:
                with contextlib.suppress(OSError, ValueError):
                    for pid in procs([path]):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError:
                busy.append(path)
        if not busy or time.monotonic() > end:
            return not busy
        left = busy
        time.sleep(0.005 if not kill else 0.02)


def _memory_cgroup(job: dict[str, Any], g: Guards) -> None:
    """As root: make the run's memory cgroup (`job["_cgroup"]`, joined by the worker in its set-up, before it drops
    its uid) limited to memory_mb for all its processes together. Records the guard either way."""
    lim = job["limits"]
    fallback = (f"memory_mb is RLIMIT_AS per process: the run's total is bounded by {lim['memory_mb']} MB x "
                f"{lim['max_processes']} processes")
    dirs = make_cgroup(_CGROUP_NAME or f"{CGROUP_PREFIX}{os.getpid()}-0", pids=False)
    if isinstance(dirs, str):
        g.no("memory_cgroup", f"{dirs}; {fallback}")
        return
    path = dirs[0]
    try:
        limit_cgroup(dirs, lim["memory_mb"] << 20)
    except OSError as e:
        remove_cgroups(dirs)
        g.no("memory_cgroup", f"cannot limit {path} ({e.strerror}); {fallback}")
        return
    job["_cgroup"] = path
    g.ok("memory_cgroup", f"every process of the run is in one memory cgroup ({_cgroup_parent()[1]}, {path}): "
                          f"{lim['memory_mb']} MB in all (resident, page cache, tmpfs writes, swap)")


def _join_cgroup(job: dict[str, Any]) -> None:
    """In the worker, before it drops its uid: enter the run's cgroup (every process it starts stays in it)."""
    if job.get("_cgroup"):
        enter_cgroup([job["_cgroup"]])


def _remove_cgroup(path: str | None, wait_s: float = 0.2) -> bool:
    """rmdir the run's cgroup once its processes are gone (`remove_cgroups`)."""
    return remove_cgroups([path] if path else [], wait_s)


def _sweep_cgroups() -> None:
    """Remove the empty run cgroups whose owner process is gone (a supervisor or zygote that was killed)."""
    where = _cgroup_parent()
    if isinstance(where, str):
        return
    try:
        names = [n for n in os.listdir(where[0]) if n.startswith(CGROUP_PREFIX)]
    except OSError:
        return
    for name in names:
        try:
            owner = int(name[len(CGROUP_PREFIX):].split("-", 1)[0])
            os.kill(owner, 0)
        except ProcessLookupError:
            remove_cgroups([os.path.join(where[0], name)], 0)
        except (ValueError, PermissionError):
            pass
