"""The work dir's disk quota: as root, a run's work dir is a tmpfs of its own, `SandboxLimits.disk_mb` in size (and
1024 inodes per MB), so a run cannot fill the host's disk with files (ENOSPC at the quota) nor its inode table with
empty ones. Its pages are memory (swappable), charged to whoever writes them: the trainer for the files it writes
there, the run's memory cgroup for the run's (so they count against `memory_mb` too while the run lives).

How the runs see it: the work dir is mounted in the trainer's mount namespace, after the pool's zygote (and the idle
supervisors and direct workers it forked) made their own. So the pool's `base_dir`, where work dirs live, is a
shared mount of its own (`share`), and the zygote keeps it a *slave* in its namespace (`_mounts._private_except`):
mounts made under it in the trainer's namespace appear in every namespace forked from the zygote (never the other
way round), and are gone from them when the trainer unmounts. Unmounting a work dir frees its content at once; the
reaper (`cleanup`) does it off the step path. A killed trainer leaves the mounts in its namespace: the zygote's
clean-up removes the directories they are mounted on, which detaches them (Linux >= 3.18).

Without root (no mount in the trainer's namespace) the work dir is a plain directory: bounded only by `file_mb` per
file and the deadline (the run's report says so: guard `disk_quota`).
"""

from __future__ import annotations

import ctypes
import os

MS_NOSUID, MS_NODEV, MS_BIND, MS_SHARED = 2, 4, 4096, 1 << 20
MNT_DETACH = 2
INODES_PER_MB = 1024

_libc: ctypes.CDLL | None
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    _libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _libc = None


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> str | None:
    """mount(2); None on success, else why not."""
    if _libc is None:
        return "no libc mount()"

    def enc(s: str | None) -> bytes | None:
        return s.encode() if s is not None else None

    if _libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) == 0:
        return None
    return os.strerror(ctypes.get_errno())


def mount_work_dir(path: str, size_mb: int) -> str | None:
    """Mount a tmpfs of `size_mb` MB (and INODES_PER_MB inodes per MB) on the empty directory `path` (mode 0711,
    ours; nosuid, nodev). Returns None, or why it could not (not root: the caller keeps a plain directory)."""
    if os.geteuid() != 0:
        return "not root: the work dir is a plain directory of the host's disk (no mount in our namespace)"
    opts = f"size={size_mb}m,nr_inodes={max(1024, size_mb * INODES_PER_MB)},mode=0711"
    why = _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    return None if why is None else f"mount tmpfs on {path}: {why}"


_shared: set[str] = set()


def is_shared_base(path: str) -> bool:
    """Whether `path` is a pool's base dir that `share` made shared (so a work dir mounted in it reaches the runs)."""
    return os.path.realpath(path) in _shared


def share(base_dir: str) -> bool:
    """As root: make `base_dir` a shared mount of its own (a bind on itself), so the work dirs mounted under it later
    reach the zygote's namespace (kept a slave there). False where it could not (each run then gets what it can)."""
    if os.geteuid() != 0:
        return False
    if _mount(base_dir, base_dir, None, MS_BIND) is not None:
        return False
    if _mount(None, base_dir, None, MS_SHARED) is not None:
        unmount(base_dir)
        return False
    _shared.add(os.path.realpath(base_dir))
    return True


def unshare(base_dir: str) -> None:
    """Undo `share` (the pool is closing): detach the base dir's bind and every work dir mounted below it."""
    real = os.path.realpath(base_dir)
    if real in _shared:
        _shared.discard(real)
        unmount(base_dir)


def unmount(path: str) -> bool:
    """Detach what is mounted at `path` (lazily: processes still inside keep it until they leave)."""
    return _libc is not None and _libc.umount2(path.encode(), MNT_DETACH) == 0
