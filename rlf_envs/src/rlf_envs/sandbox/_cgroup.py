"""The run's memory cgroup: `memory_mb` for every process of a run together (as root).

Stdlib only, like every module the supervisor loads: it runs with a bare interpreter (see `_supervisor`).
"""

from __future__ import annotations

import contextlib
import os
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

CGROUP_PREFIX = "rlf-sbx-"
#: where run cgroups are made: (directory, "v2" | "v1"), or the reason there is none; probed once per process
_CGROUP_PARENT: tuple[str, str] | str | None = None
#: the name of the cgroup of the next run forked here (set by the zygote before each fork; the cold path makes one)
_CGROUP_NAME: str | None = None


def _probe_cgroup_parent() -> tuple[str, str] | str:
    """Where this process may make memory cgroups, or why it may not."""
    if os.geteuid() != 0:
        return "not root: cgroups are not delegated to this uid"
    try:
        with open("/proc/self/cgroup") as f:
            lines = [ln.rstrip("\n").split(":", 2) for ln in f if ln.count(":") >= 2]
        with open("/proc/self/mountinfo") as f:
            mounts = [ln.split() for ln in f]
    except OSError as e:
        return f"cannot read /proc/self/cgroup or mountinfo ({e})"
    v2_mount = v1_mount = None
    for m in mounts:
        sep = m.index("-")
        fstype, opts = m[sep + 1], m[sep + 3].split(",") if len(m) > sep + 3 else []
        if fstype == "cgroup2" and v2_mount is None:
            v2_mount = m[4]
        elif fstype == "cgroup" and "memory" in opts and v1_mount is None:
            v1_mount = m[4]
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
                    with open(os.path.join(here, "cgroup.subtree_control"), "w") as f:
                        f.write("+memory")
                except OSError:
                    continue
            if os.access(parent, os.W_OK):
                return parent, "v2"
        if "memory" in controllers.split(",") and v1_mount is not None:
            here = os.path.normpath(v1_mount + "/" + path)
            if os.access(here, os.W_OK):
                return here, "v1"
    return "no writable memory cgroup (v2 memory controller or v1 memory hierarchy) for this process"


def _cgroup_parent() -> tuple[str, str] | str:
    global _CGROUP_PARENT
    if _CGROUP_PARENT is None:
        _CGROUP_PARENT = _probe_cgroup_parent()
    return _CGROUP_PARENT


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _memory_cgroup(job: dict[str, Any], g: Guards) -> None:
    """As root: make the run's memory cgroup (`job["_cgroup"]`, joined by the worker in its set-up, before it drops
    its uid) limited to memory_mb for all its processes together. Records the guard either way."""
    lim = job["limits"]
    where = _cgroup_parent()
    fallback = (f"memory_mb is RLIMIT_AS per process: the run's total is bounded by {lim['memory_mb']} MB x "
                f"{lim['max_processes']} processes")
    if isinstance(where, str):
        g.no("memory_cgroup", f"{where}; {fallback}")
        return
    parent, version = where
    path = os.path.join(parent, _CGROUP_NAME or f"{CGROUP_PREFIX}{os.getpid()}-0")
    limit = str(lim["memory_mb"] << 20)
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass
    except OSError as e:
        g.no("memory_cgroup", f"cannot make {path} ({e.strerror}); {fallback}")
        return
    try:
        if version == "v2":
            _write(os.path.join(path, "memory.max"), limit)
            if os.path.exists(os.path.join(path, "memory.swap.max")):
                _write(os.path.join(path, "memory.swap.max"), "0")
        else:
            _write(os.path.join(path, "memory.limit_in_bytes"), limit)
            if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
                with contextlib.suppress(OSError):
                    _write(os.path.join(path, "memory.memsw.limit_in_bytes"), limit)
    except OSError as e:
        _remove_cgroup(path)
        g.no("memory_cgroup", f"cannot limit {path} ({e.strerror}); {fallback}")
        return
    job["_cgroup"] = path
    g.ok("memory_cgroup", f"every process of the run is in one memory cgroup ({version}, {path}): "
                          f"{lim['memory_mb']} MB in all (resident, page cache, tmpfs writes, swap)")


def _join_cgroup(job: dict[str, Any]) -> None:
    """In the worker, before it drops its uid: enter the run's cgroup (every process it starts stays in it)."""
    if job.get("_cgroup"):
        _write(os.path.join(job["_cgroup"], "cgroup.procs"), "0")


def _remove_cgroup(path: str | None, wait_s: float = 0.2) -> bool:
    """rmdir the run's cgroup once its processes are gone (the kernel refuses while any is left: retried briefly)."""
    if not path:
        return True
    end = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > end:
                return False
            time.sleep(0.005)


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
            _remove_cgroup(os.path.join(where[0], name), 0)
        except (ValueError, PermissionError):
            pass
