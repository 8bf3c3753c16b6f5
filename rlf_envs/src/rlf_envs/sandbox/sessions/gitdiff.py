"""A git-format patch (what `git diff --no-index --binary a b` prints, with `a/` and `b/` paths relative to the two
roots) between two directory trees, in pure stdlib Python so that it runs inside a session's agent whatever the
image holds (no git needed). `git apply` takes it: text hunks (unified, 3 lines of context, `\\ No newline at end of
file`), new and deleted files, mode changes (100644/100755), symlinks (120000), and binary files as `GIT binary
patch` literals with full blob ids (which `git apply` needs to accept a binary patch).

The trees are hostile in a session: only regular files and symlinks are read (opened with O_NOFOLLOW | O_NONBLOCK, so
a FIFO or device never blocks), directories are never followed through links, `max_bytes` bounds what is read and
`max_patch_bytes` the patch (checked as it grows: a patch past it is never built in full). With `one_filesystem`
nothing of the new tree on another filesystem than its root is read (a directory swapped for a link into /proc
mid-walk reads nothing).
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import os
import stat
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext

#: directory names never descended into (a repository's own git data is not part of its diff)
EXCLUDE = frozenset({".git"})
ZERO = "0" * 40


class DiffTooLarge(Exception):
    """The trees hold more than `max_bytes` of candidate file content, or the patch is longer than
    `max_patch_bytes` (the backends raise `SessionDiffTooLarge` for it)."""


def _entries(root: str, exclude: frozenset[str], dev: int | None = None) -> dict[str, tuple[int, str]]:
    """path (relative, '/'-separated) -> (mode, absolute path) for every regular file and symlink under root (only
    those on the filesystem `dev`, where given)."""
    out: dict[str, tuple[int, str]] = {}
    if not root or not os.path.isdir(root):
        return out
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            it = list(os.scandir(os.path.join(root, rel) if rel else root))
        except OSError:
            continue
        for e in it:
            name = f"{rel}/{e.name}" if rel else e.name
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if dev is not None and st.st_dev != dev:
                continue
            if stat.S_ISDIR(st.st_mode):
                if e.name not in exclude:
                    stack.append(name)
            elif stat.S_ISLNK(st.st_mode):
                out[name] = (0o120000, e.path)
            elif stat.S_ISREG(st.st_mode):
                out[name] = (0o100755 if st.st_mode & 0o111 else 0o100644, e.path)
    return out


def _read(mode: int, path: str, budget: list[int], dev: int | None = None) -> bytes:
    if mode == 0o120000:
        data = os.fsencode(os.readlink(path))
    else:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (dev is not None and st.st_dev != dev):
                return b""
            chunks, n = [], 0
            while True:
                b = os.read(fd, 1 << 20)
                if not b:
                    break
                n += len(b)
                if n > budget[0]:
                    raise DiffTooLarge("the workspace holds too much changed data to diff")
                chunks.append(b)
            data = b"".join(chunks)
        finally:
            os.close(fd)
    budget[0] -= len(data)
    if budget[0] < 0:
        raise DiffTooLarge("the workspace holds too much changed data to diff")
    return data


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_binary(data: bytes) -> bool:
    if b"\0" in data[:8000]:
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _quote(path: str) -> str:
    if any(c in path for c in '"\\\t\n') or not path.isprintable():
        esc = path.encode("utf-8", "surrogateescape")
        body = "".join(chr(b) if 32 <= b < 127 and b not in (34, 92) else
                       {9: "\\t", 10: "\\n", 34: '\\"', 92: "\\\\"}.get(b, f"\\{b:03o}") for b in esc)
        return f'"{body}"'
    return path


def _b85_lines(data: bytes) -> Iterator[str]:
    z = zlib.compress(data, 9)
    for i in range(0, len(z), 52):
        chunk = z[i:i + 52]
        n = len(chunk)
        prefix = chr(ord("A") + n - 1) if n <= 26 else chr(ord("a") + n - 27)
        yield prefix + base64.b85encode(chunk + b"\0" * (-n % 4)).decode()[: (n + 3) // 4 * 5]


def _iter_binary(old: bytes, new: bytes) -> Iterator[str]:
    yield from ("GIT binary patch", f"literal {len(new)}")
    yield from _b85_lines(new)
    yield from ("", f"literal {len(old)}")
    yield from _b85_lines(old)
    yield ""


def _iter_text_hunks(old: bytes, new: bytes) -> Iterator[str]:
    a = old.decode("utf-8").splitlines(keepends=True)
    b = new.decode("utf-8").splitlines(keepends=True)
    lines = difflib.unified_diff(a, b, n=3, lineterm="\n")
    for _ in range(2):  # its own ---/+++ header
        next(lines, None)
    for line in lines:
        if line.endswith("\n"):
            yield line[:-1]
        else:
            yield line
            yield "\\ No newline at end of file"


def _binary(old: bytes, new: bytes) -> list[str]:
    return list(_iter_binary(old, new))


def _text_hunks(old: bytes, new: bytes) -> list[str]:
    return list(_iter_text_hunks(old, new))


def _diff_file(path: str, old: tuple[int, bytes] | None, new: tuple[int, bytes] | None) -> list[str]:
    """One file's part of the patch (its lines)."""
    return list(_iter_diff_file(path, old, new))


def _iter_diff_file(path: str, old: tuple[int, bytes] | None, new: tuple[int, bytes] | None) -> Iterator[str]:
    """The lines of one file's part of the patch, as they are made (a patch past its limit stops being built)."""
    q_a, q_b = _quote("a/" + path), _quote("b/" + path)
    old_mode, old_data = old if old else (0, b"")
    new_mode, new_data = new if new else (0, b"")
    if old_mode and new_mode and (old_mode == 0o120000) != (new_mode == 0o120000) and old_data != new_data:
        # a file became a link (or back): git shows a deletion and an addition
        yield from _iter_diff_file(path, old, None)
        yield from _iter_diff_file(path, None, new)
        return
    yield f"diff --git {q_a} {q_b}"
    if old is None:
        yield f"new file mode {new_mode:o}"
    elif new is None:
        yield f"deleted file mode {old_mode:o}"
    elif old_mode != new_mode:
        yield from (f"old mode {old_mode:o}", f"new mode {new_mode:o}")
    if old_data == new_data and old is not None and new is not None:
        return  # a mode change only
    oid = blob_id(old_data) if old is not None else ZERO
    nid = blob_id(new_data) if new is not None else ZERO
    same_mode = old is not None and new is not None and old_mode == new_mode
    yield f"index {oid}..{nid}" + (f" {new_mode:o}" if same_mode else "")
    if _is_binary(old_data) or _is_binary(new_data):
        yield from _iter_binary(old_data, new_data)
        return
    yield "--- " + (q_a if old is not None else "/dev/null")
    yield "+++ " + (q_b if new is not None else "/dev/null")
    yield from _iter_text_hunks(old_data, new_data)


class _Patch:
    """The patch's lines as they are made, with its length in UTF-8 bytes bounded."""

    def __init__(self, limit: int | None) -> None:
        self.lines: list[str] = []
        self.size = 0
        self.limit = limit

    def add(self, lines: Iterator[str]) -> None:
        limit = self.limit
        for line in lines:
            if limit is not None:
                self.size += (len(line) if line.isascii() else len(line.encode("utf-8", "surrogateescape"))) + 1
                if self.size > limit:
                    raise DiffTooLarge(f"the workspace's patch is longer than {limit} bytes")
            self.lines.append(line)


def diff_trees(old_root: str | None, new_root: str, *, max_bytes: int = 256 << 20,
               max_patch_bytes: int | None = None, exclude: frozenset[str] = EXCLUDE,
               old_access: Callable[[], AbstractContextManager[object]] = nullcontext,
               one_filesystem: bool = False) -> str:
    """The git-format patch turning `old_root` (None or missing: empty) into `new_root`. Raises DiffTooLarge when the
    files compared hold more than `max_bytes`, or the patch is longer than `max_patch_bytes` (UTF-8 bytes).
    `old_access`: a context entered around every read of the old (trusted) tree, e.g. to regain the rights the
    caller dropped to read the new (hostile) one. `one_filesystem`: read only what lies on `new_root`'s own
    filesystem of the new tree."""
    with old_access():
        old = _entries(old_root or "", exclude)
    dev: int | None = None
    if one_filesystem:
        try:
            dev = os.stat(new_root).st_dev
        except OSError:
            dev = -1
    new = _entries(new_root, exclude, dev)
    budget = [max_bytes]
    out = _Patch(max_patch_bytes)
    for path in sorted(set(old) | set(new)):
        o, n = old.get(path), new.get(path)
        if o and n and o[0] == n[0] and o[0] != 0o120000:
            try:
                with old_access():
                    so = os.lstat(o[1])
                    same_size = so.st_size == os.lstat(n[1]).st_size
                    old_data = _read(o[0], o[1], budget) if same_size else None
                if old_data is not None and old_data == _read(n[0], n[1], budget, dev):
                    continue
            except OSError:
                pass
        try:
            with old_access():
                od = (o[0], _read(o[0], o[1], budget)) if o else None
            nd = (n[0], _read(n[0], n[1], budget, dev)) if n else None
        except FileNotFoundError:
            continue
        if od == nd:
            continue
        out.add(_iter_diff_file(path, od, nd))
    return "\n".join(out.lines) + "\n" if out.lines else ""
