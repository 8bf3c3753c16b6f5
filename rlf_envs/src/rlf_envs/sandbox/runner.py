"""Scoring-process side of the sandbox: prepare a work dir, start the supervisor, read its one result line."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlf_envs.sandbox.limits import SandboxLimits, SandboxResult

log = logging.getLogger(__name__)

SUPERVISOR = str(Path(__file__).with_name("_supervisor.py"))
#: per-run uids are drawn from [UID_BASE, UID_BASE + UID_SPAN): far above any real or container user range
UID_BASE, UID_SPAN = 1_600_000_000, 1 << 24
GRACE_S = 10.0  # the supervisor's own start-up and clean-up, on top of the run's deadline
_warned: set[str] = set()
# consecutive uids in this process (never shared by two live dirs of ours), from a random start (so that two
# trainers on one machine are unlikely to overlap)
_uid_sequence = itertools.count(secrets.randbelow(UID_SPAN))


def _is_root() -> bool:
    return os.geteuid() == 0


class SandboxDir:
    """A fresh work directory for sandboxed runs (the code's cwd, HOME and TMPDIR), with the unprivileged uid
    its runs use when we are root. Several runs may share one (e.g. an episode of the interpreter tool);
    `remove()` deletes it."""

    def __init__(self, drop_privileges: bool = True) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="rlf_sbx_"))
        os.chmod(self.root, 0o711)  # others may traverse to `work` (the run's uid), not list it
        self.path = self.root / "work"
        self.path.mkdir(mode=0o700)
        self.uid: int | None = None
        if _is_root() and drop_privileges:
            self.uid = UID_BASE + next(_uid_sequence) % UID_SPAN
            os.chown(self.path, self.uid, self.uid)

    def write(self, name: str, text: str) -> None:
        """Write a file the run can read but not replace before we read it back (owned by us, 0644)."""
        p = self.path / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.is_symlink() or p.exists():
            p.unlink()  # the code may have left a symlink here: never write through it
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SandboxDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _python_dirs(python: str) -> list[str]:
    """The directories the interpreter needs: its installation (symlinks resolved) and, for a virtualenv,
    the env's own root (where its `bin/python` link and `pyvenv.cfg` live)."""
    dirs = {os.path.dirname(os.path.dirname(os.path.realpath(python))),
            os.path.dirname(os.path.dirname(os.path.abspath(python)))}
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        dirs |= {sys.prefix, sys.base_prefix}
    return sorted(d for d in dirs if os.path.isdir(d))


def _supervisor_env(workdir: Path) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir), "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1"}


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> bytes:
    buf = bytearray()
    while chunk := await stream.read(1 << 16):
        buf += chunk[: max(0, cap - len(buf))]
    return bytes(buf)


async def _exited(proc: asyncio.subprocess.Process) -> int:
    """Wait for the process itself (not its pipes, which an escaped grandchild could hold open)."""
    delay = 0.001
    while proc.returncode is None:
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.005)
    return proc.returncode


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def _supervise(job: dict[str, Any], workdir: SandboxDir, limits: SandboxLimits) -> SandboxResult:
    """Start the supervisor on `job`, wait (bounded) and return its verdict; kill its session in `finally`."""
    nonce = secrets.token_hex(16)
    job = {**job, "nonce": nonce, "limits": limits.model_dump(), "drop_uid": workdir.uid,
           "drop_uid_reason": "SandboxLimits.drop_privileges=False" if not limits.drop_privileges else "",
           "python_dirs": _python_dirs(job["python"])}
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", SUPERVISOR, cwd=workdir.path, env=_supervisor_env(workdir.path),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    cap = 12 * limits.max_output_bytes + (1 << 20)  # stdout+stderr, JSON-escaped (<= 6x), plus the verdict
    readers: list[asyncio.Future[bytes]] = []
    out = err = b""
    try:
        assert proc.stdin and proc.stdout and proc.stderr
        readers = [asyncio.ensure_future(_read_capped(proc.stdout, cap)),
                   asyncio.ensure_future(_read_capped(proc.stderr, 16_384))]
        proc.stdin.write(json.dumps(job).encode())
        try:
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            async with asyncio.timeout(limits.timeout_s + GRACE_S):
                await _exited(proc)
        except TimeoutError:
            pass
    finally:
        _kill_session(proc.pid)
        try:
            async with asyncio.timeout(2):
                await _exited(proc)
                if readers:
                    out, err = await asyncio.gather(*readers)
        except TimeoutError:
            pass
        finally:
            for r in readers:
                r.cancel()
    wall = time.monotonic() - t0
    return _parse(out, err, nonce, wall)


def _parse(out: bytes, err: bytes, nonce: str, wall: float) -> SandboxResult:
    for line in reversed(out.splitlines()):
        try:
            res = json.loads(line)
        except ValueError:
            continue
        if not isinstance(res, dict) or res.get("nonce") != nonce:
            continue
        result = SandboxResult(
            stdout=res.get("stdout", ""), stderr=res.get("stderr", ""), exit_code=res.get("exit_code"),
            timed_out=bool(res.get("timed_out")), output_truncated=bool(res.get("output_truncated")), wall_s=wall,
            guards=res.get("guards", {}), missing_guards=res.get("missing_guards", {}), error=res.get("error"),
            test_results=tuple(bool(r) for r in res.get("results", ())), test_errors=tuple(res.get("errors", ())),
        )
        _warn_missing(result.missing_guards)
        return result
    tail = err[-2000:].decode(errors="replace")
    return SandboxResult(wall_s=wall, timed_out=True, error=f"the sandbox supervisor gave no result: {tail}")


def _warn_missing(missing: dict[str, str]) -> None:
    for name, why in missing.items():
        if name not in _warned:
            _warned.add(name)
            log.warning("sandbox: guard %r is not in force: %s", name, why)


async def run_python(
    code: str,
    stdin: str = "",
    limits: SandboxLimits | None = None,
    workdir: SandboxDir | None = None,
    *,
    python: str | None = None,
) -> SandboxResult:
    """Run `code` as a Python script (`python -I main.py`) in the sandbox, with `stdin`, under `limits`.

    `workdir`: a `SandboxDir` to run in (it is kept; files persist between runs), else a fresh one that is
    removed afterwards. stdout and stderr are captured (capped); the whole process tree is killed at the
    end, whatever the code did."""
    limits = limits or SandboxLimits()
    own = workdir is None
    wd = workdir or SandboxDir(limits.drop_privileges)
    try:
        script = ".rlf_main.py"
        wd.write(script, code)
        job = {"mode": "run", "script": script, "stdin": stdin, "python": python or sys.executable}
        return await _supervise(job, wd, limits)
    finally:
        if own:
            wd.remove()


async def run_tests(
    solution: str,
    tests: list[str],
    limits: SandboxLimits | None = None,
    *,
    python: str | None = None,
) -> SandboxResult:
    """Judge `solution` against `tests` (Python test code, e.g. asserts). The solution runs in the sandboxed
    worker; each test runs in the trusted supervisor, against proxies of the solution's names, so the
    verdict in `test_results` is decided where the solution cannot reach (see the package docstring)."""
    limits = limits or SandboxLimits()
    with SandboxDir(limits.drop_privileges) as wd:
        wd.write("solution.py", solution)
        job = {"mode": "tests", "script": "solution.py", "tests": tests, "python": python or sys.executable}
        result = await _supervise(job, wd, limits)
    if len(result.test_results) != len(tests):
        result = dataclasses.replace(result, test_results=(False,) * len(tests))
    return result

