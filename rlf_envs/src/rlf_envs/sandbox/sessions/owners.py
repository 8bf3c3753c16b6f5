"""Owner labels and the reaper of the local backend: zero leaked sessions after a crash.

Every local session is written down (`<label dir>/<id>.json`) with its owner — the run id and the pid + start time of
the process that created it — before anything waits on it, and gets the pids (+ start times) of its agent processes
as soon as they exist. `reap()` removes every session whose owner is gone: it SIGKILLs its agent (pid 1 of the
session's pid namespace, so the kernel kills every process of the session, and its mount namespace, which holds all
its mounts, goes with the last of them), removes its cgroups (`sandbox._cgroup.remove_cgroups`) and the label. Run at
backend start-up and on a timer.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import tempfile
import uuid
from dataclasses import asdict, dataclass, field

from rlf_envs.sandbox._cgroup import remove_cgroups

#: this process's run id (RLF_RUN_ID, else a fresh one): written on every session it owns
RUN_ID = os.environ.get("RLF_RUN_ID") or uuid.uuid4().hex[:12]


#: the label directories checked so far (`label_dir`), by the RLF_SESSIONS_DIR they were found for
_checked: dict[str | None, str] = {}


def label_dir() -> str:
    """Where the labels live: RLF_SESSIONS_DIR, else rlf-sessions-<euid> in /dev/shm (a tmpfs on Linux: a label is
    written three times per session, and on a disk's filesystem each atomic replace costs a journal flush, ~0.5-1 ms
    on the event loop), or in the temp dir where there is none; made 0700 on first use. The reaper SIGKILLs what the
    labels name, so the directory must be ours: PermissionError, saying what to do, when it is another user's, a
    link, or writable by others (made by someone else before us in a world-writable parent)."""
    env = os.environ.get("RLF_SESSIONS_DIR")
    got = _checked.get(env)
    if got is not None:
        return got
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK) \
        else tempfile.gettempdir()
    d = env or os.path.join(base, f"rlf-sessions-{os.geteuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PermissionError(f"the session label directory {d} is not this user's own (a link, owned by uid "
                              f"{st.st_uid}, or writable by others, mode {stat.S_IMODE(st.st_mode):o}); the reaper "
                              "kills what its labels name, so it is not used: remove it, or set RLF_SESSIONS_DIR to "
                              "a directory of your own")
    _checked[env] = d
    return d


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22), None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def alive(pid: int, started: int | None) -> bool:
    """Whether the process `pid` still is the one that started at `started` (pids are reused)."""
    st = start_time(pid)
    return st is not None and (started is None or st == started)


@dataclass
class Label:
    id: str
    backend: str
    run_id: str
    owner_pid: int
    owner_start: int | None
    procs: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, start time) of the agent processes
    cgroups: list[str] = field(default_factory=list)  # cgroup directories to remove

    @classmethod
    def new(cls, sid: str, backend: str = "local") -> Label:
        pid = os.getpid()
        return cls(sid, backend, RUN_ID, pid, start_time(pid))

    def path(self) -> str:
        return os.path.join(label_dir(), f"{self.id}.json")

    def save(self) -> None:
        """Atomically (a rename), so a reaper never reads half a label."""
        p = self.path()
        tmp = f"{p}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(self), f)
        os.replace(tmp, p)

    def rename(self, new_id: str) -> str:
        """The label now names the session `new_id` (a recycled agent's next session): saved under its new name
        before the old file goes, so a reaper always finds at least one of them. Returns `new_id`."""
        old = self.path()
        self.id = new_id
        self.save()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(old)
        return new_id

    def remove(self) -> None:
        try:
            os.unlink(self.path())
        except FileNotFoundError:
            pass

    def owner_alive(self) -> bool:
        return alive(self.owner_pid, self.owner_start)


def kill_label(label: Label) -> None:
    """SIGKILL the session's processes (those still the same processes)."""
    for pid, started in label.procs:
        if alive(pid, started):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def labels() -> list[Label]:
    out = []
    d = label_dir()
    for name in os.listdir(d):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(d, name)) as f:
                raw = json.load(f)
            raw["procs"] = [tuple(p) for p in raw.get("procs", [])]
            out.append(Label(**raw))
        except (OSError, ValueError, TypeError):
            continue
    return out


def reap(backend: str = "local") -> int:
    """Remove every `backend` session whose owner is gone. Returns how many."""
    n = 0
    for lab in labels():
        if lab.backend != backend or lab.owner_alive():
            continue
        kill_label(lab)
        if remove_cgroups(lab.cgroups, 2.0, kill=True):  # else: still busy, the next reap finishes it
            lab.remove()
            n += 1
    return n
