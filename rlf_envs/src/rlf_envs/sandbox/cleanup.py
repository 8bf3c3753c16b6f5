"""Removal of whatever a sandboxed run left behind, which can neither fail nor recurse, and is kept off the step path.

A run owns its work dir and may leave anything in it: a tree thousands of directories deep (deeper than PATH_MAX,
deeper than Python's recursion limit), directories of mode 000, hundreds of thousands of files, fifos and sockets,
hard links to files elsewhere, huge sparse files, symlinks to anywhere. `shutil.rmtree` recursed per level (a
`RecursionError` that `ignore_errors` does not cover, raised out of `step`), stopped at directories it could not
enter (uid 65534: mode 000 kept the tree on disk) and spent seconds inside `step` for 75k files.

API (stdlib only: the zygote, a bare interpreter, loads this file by path):

* `remove_tree(path, budget_s)`: iterative (constant stack), descends by directory descriptors (no path ever
  longer than one name, so no ENAMETOOLONG), never follows a symlink, makes every directory it enters 0700 first
  (as the owner or root: mode 000 stops nothing), unmounts what is mounted inside, unlinks fifos, sockets and
  device nodes without opening them, and stops at `budget_s` seconds. Never raises; returns whether it is all gone.
* `discard(path)`: renames `path` at once to a hidden name beside it (`.rlf_trash_<pid>_<random>`; so nothing that
  reuses the name ever sees it) and queues it for a background reaper thread, which calls `remove_tree`. Never
  raises and never blocks on the tree's size: this is what the step path calls.
* `sweep(base)`: removes the trash entries under `base` whose owner process is gone (what a killed trainer, or an
  interpreter exit that came before the reaper finished, left). Called when a pool starts.
* `sweep_once(base)`: the same, in the background, once per process.
* `flush(timeout_s)`: wait for the reaper to empty its queue (tests; interpreter exit waits a bounded time too).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import queue
import secrets
import stat
import threading
import time

#: the prefix of a discarded tree, renamed away from its place: `<prefix><owner pid>_<random>`
TRASH_PREFIX = ".rlf_trash_"
#: how long the reaper spends on one tree before it leaves the rest to the next sweep
REAP_BUDGET_S = 120.0
#: how long interpreter exit waits for the reaper to finish what is queued
EXIT_WAIT_S = 10.0
_MNT_DETACH = 2
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_PATH = getattr(os, "O_PATH", 0o10000000) | os.O_NOFOLLOW | os.O_CLOEXEC

_libc: ctypes.CDLL | None
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _libc = None


def _umount(path: str) -> bool:
    """Detach a mount at `path` (as root; an unprivileged caller cannot have mounts we made here)."""
    return _libc is not None and _libc.umount2(path.encode(), _MNT_DETACH) == 0


def _open_dir(parent_fd: int, name: str) -> int | None:
    """Open the directory `name` in `parent_fd` for listing, never through a symlink, after making it 0700 (as its
    owner or as root we may): a mode of 000 or 0500 left by the run stops neither the listing nor the unlinks."""
    try:
        pfd = os.open(name, _O_PATH, dir_fd=parent_fd)
    except OSError:
        return None
    try:
        st = os.fstat(pfd)
        if not stat.S_ISDIR(st.st_mode):
            return None
        if st.st_mode & 0o700 != 0o700:
            with contextlib.suppress(OSError):
                os.chmod(f"/proc/self/fd/{pfd}", 0o700)  # (an O_PATH descriptor: chmod through its /proc link)
        try:
            return os.open(".", _O_DIR, dir_fd=pfd)
        except OSError:
            return None
    finally:
        os.close(pfd)


class _Level:
    __slots__ = ("dev_ino", "name", "subdirs")

    def __init__(self, name: str, dev_ino: tuple[int, int]) -> None:
        self.name, self.dev_ino = name, dev_ino
        self.subdirs: list[str] | None = None  # None: not listed yet


def _clear_level(fd: int, level: _Level, deadline: float) -> None:
    """Unlink every non-directory in `fd` and remember its subdirectories (the caller descends into them)."""
    subdirs: list[str] = []
    with os.scandir(fd) as it:
        for entry in it:
            if time.monotonic() > deadline:
                break
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            if is_dir:
                subdirs.append(entry.name)
                continue
            try:
                os.unlink(entry.name, dir_fd=fd)
            except IsADirectoryError:  # (d_type lied: a filesystem without it)
                subdirs.append(entry.name)
            except OSError:
                pass
    level.subdirs = subdirs


def _remove_children(top_fd: int, deadline: float) -> None:
    """Empty the directory open as `top_fd`: depth first with one open descriptor at a time (a parent is reached
    again through "..", checked to be the directory we came from), so neither the stack nor the descriptor table
    grows with the depth."""
    fd = top_fd
    st = os.fstat(fd)
    stack = [_Level("", (st.st_dev, st.st_ino))]
    try:
        while stack and time.monotonic() <= deadline:
            level = stack[-1]
            if level.subdirs is None:
                _clear_level(fd, level, deadline)
            assert level.subdirs is not None
            if level.subdirs:
                name = level.subdirs.pop()
                child = _open_dir(fd, name)
                if child is None:
                    with contextlib.suppress(OSError):
                        os.rmdir(name, dir_fd=fd)
                    continue
                cst = os.fstat(child)
                if cst.st_dev != st.st_dev:  # something is mounted here (as root): detach it, then remove the dir
                    os.close(child)
                    if _umount(f"/proc/self/fd/{fd}/{name}"):
                        level.subdirs.append(name)
                    continue
                if fd != top_fd:
                    os.close(fd)
                fd = child
                stack.append(_Level(name, (cst.st_dev, cst.st_ino)))
                continue
            if len(stack) == 1:
                return
            parent = os.open("..", _O_DIR, dir_fd=fd)
            pst = os.fstat(parent)
            if (pst.st_dev, pst.st_ino) != stack[-2].dev_ino:  # moved under us: stop, the sweep retries later
                os.close(parent)
                return
            os.close(fd)
            fd = parent
            done = stack.pop()
            with contextlib.suppress(OSError):
                os.rmdir(done.name, dir_fd=fd)
    finally:
        if fd != top_fd:
            os.close(fd)


def remove_tree(path: str | os.PathLike[str], budget_s: float = REAP_BUDGET_S) -> bool:
    """Remove `path` (a directory tree, a file or a link; a mount point on it is detached first) whatever is in
    it; at most `budget_s` seconds. Never raises. True if nothing is left."""
    p = os.fspath(path)
    deadline = time.monotonic() + budget_s
    try:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return True
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(p)
            return True
        parent, name = os.path.split(os.path.abspath(p))
        pfd = os.open(parent, _O_DIR)
        try:
            fd = _open_dir(pfd, name)
            if fd is None:
                return False
            if os.fstat(fd).st_dev != os.fstat(pfd).st_dev:  # the tree is a mount point: its content goes with it
                os.close(fd)
                if _umount(p):
                    return remove_tree(p, max(0.0, deadline - time.monotonic()))
                fd = _open_dir(pfd, name)
                if fd is None:
                    return False
            try:
                _remove_children(fd, deadline)
            finally:
                os.close(fd)
            try:
                os.rmdir(name, dir_fd=pfd)
            except FileNotFoundError:
                pass
            except OSError:
                return False
        finally:
            os.close(pfd)
        return not os.path.lexists(p)
    except Exception:
        return False


# ------------------------------------------------------------------------------------------- the reaper

_queue: queue.Queue[tuple[str, str] | None] = queue.Queue()  # ("tree" | "sweep", path)
_lock = threading.Lock()
_thread: threading.Thread | None = None
_owner = 0  # the pid whose reaper thread `_thread` is (a fork has none until it discards something)


def _reap_loop() -> None:
    while True:
        item = _queue.get()
        try:
            if item is None:
                return
            kind, path = item
            if kind == "sweep":
                sweep(path)
            else:
                remove_tree(path)
        finally:
            _queue.task_done()


def _ensure_reaper() -> None:
    global _thread, _owner
    with _lock:
        if _thread is not None and _thread.is_alive() and _owner == os.getpid():
            return
        _owner = os.getpid()
        _thread = threading.Thread(target=_reap_loop, name="rlf-sandbox-reaper", daemon=True)
        _thread.start()


def trash_name(path: str | os.PathLike[str], into: str | os.PathLike[str] | None = None) -> str:
    """Where `discard` moves `path`: a hidden name in `into` (default: the directory holding `path`; it must be on
    the same filesystem, a rename never crosses one)."""
    parent = os.fspath(into) if into is not None else os.path.dirname(os.path.abspath(os.fspath(path)))
    return os.path.join(parent, f"{TRASH_PREFIX}{os.getpid()}_{secrets.token_hex(6)}")


def discard(path: str | os.PathLike[str], into: str | os.PathLike[str] | None = None) -> None:
    """Move `path` out of the way now (one rename, into `into` or beside it) and remove it in the background.
    Never raises, never blocks on what the tree holds; where the rename fails (a mount point, another filesystem)
    the reaper takes it where it is."""
    p = os.fspath(path)
    try:
        if not os.path.lexists(p):
            return
        target = trash_name(p, into)
        try:
            os.rename(p, target)
        except OSError:
            target = p
        _ensure_reaper()
        _queue.put(("tree", target))
    except Exception:
        pass


_swept: set[tuple[int, str]] = set()


def sweep_once(base: str | os.PathLike[str]) -> None:
    """Queue `sweep(base)` for the reaper, once per process and directory (a pool does this when it starts)."""
    key = (os.getpid(), os.path.abspath(os.fspath(base)))
    try:
        with _lock:
            if key in _swept:
                return
            _swept.add(key)
        _ensure_reaper()
        _queue.put(("sweep", key[1]))
    except Exception:
        pass


def flush(timeout_s: float = 60.0) -> bool:
    """Wait until the reaper has removed everything queued so far; False if `timeout_s` passed first."""
    end = time.monotonic() + timeout_s
    while _queue.unfinished_tasks:
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def _owner_alive(name: str) -> bool:
    try:
        pid = int(name[len(TRASH_PREFIX):].split("_", 1)[0])
    except ValueError:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(base: str | os.PathLike[str], budget_s: float = REAP_BUDGET_S) -> int:
    """Remove the trash under `base` whose owner is gone; returns how many entries went. Never raises."""
    removed = 0
    deadline = time.monotonic() + budget_s
    try:
        with os.scandir(base) as it:
            names = [e.name for e in it if e.name.startswith(TRASH_PREFIX)]
    except OSError:
        return 0
    for name in names:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if not _owner_alive(name) and remove_tree(os.path.join(os.fspath(base), name), left):
            removed += 1
    return removed


def _at_exit() -> None:
    """Let the reaper finish what is queued (bounded); what it could not is the next sweep's."""
    if _thread is not None and _thread.is_alive() and _owner == os.getpid():
        flush(EXIT_WAIT_S)


atexit.register(_at_exit)
