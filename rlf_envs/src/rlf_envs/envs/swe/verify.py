"""The hidden-test run: the episode's patch on a FRESH session of the task's repository, then F2P + P2P.

Nothing of the agent's workspace reaches the verdict but its diff, and only the part of it that may change the
library (`filter_patch`). Dropped from the patch, whatever the file is called:

- the task's tests: every file an F2P/P2P id names, every file `test_patch` touches, `conftest.py` anywhere,
  `test_*.py`, `*_test.py`, anything under `tests/`, `test/`, `testing/` (the task's versions are what runs);
- test and packaging configuration (`pytest.ini`, `tox.ini`, `setup.cfg`, `pyproject.toml`), interpreter start-up
  hooks (`sitecustomize.py`, `usercustomize.py`, `*.pth`, `__pycache__/`, `*.pyc`), symlinks, binary patches,
  paths outside the repository and `.git/`;
- new modules that would shadow one the run imports: a new file or package at an import root (the repository
  root, its `pythonpath`, every directory above a test file) named like a module of the verifier image (its
  standard library, site-packages and builtins, listed by the image's own interpreter before the patch applies).

The run (`pytest_command`): `python3 -I` (no PYTHONPATH, no user site, no cwd on `sys.path`) runs rlf's bootstrap,
which imports pytest from the image first, then appends the repository's import roots at the END of `sys.path`
(the library cannot stand ahead of the standard library or pytest), turns plugin autoloading off and runs
`pytest.main` on exactly the F2P + P2P ids with rlf's report plugin passed as an object (no module to shadow).
The report's key comes on stdin (read, then stdin is replaced by /dev/null: it is never in a file); the report is
HMAC-signed, written with O_EXCL|O_NOFOLLOW, read back only as a regular file after every process of the run is
killed. Two canary tests with random names are appended to an F2P test file: one must fail, one must pass; a
must-fail canary reported as passed is tampering (reward 0, `swe/tampering`). In-process forgery (library code
that rewrites pytest's objects while the tests run) cannot be ruled out in one process: the canary is its
detector (docs/security.md).

Who failed: a host or engine failure (`SessionInfraError`), an image without python3/pytest, a task whose
test_patch does not apply is `Verdict.infra_failed` (no reward). Everything after the patch is applied (its code
crashing, hanging, exhausting the session's limits) is the episode's: reward 0 with `Verdict.failure` naming why.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import posixpath
import re
import secrets
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from rlf_envs.envs.swe.pytest_report import PytestOutcome, parse_report
from rlf_envs.envs.swe.tasks import SweTask
from rlf_envs.sandbox.sessions import SessionError, SessionFileNotFound, SessionInfraError

PROTECTED_NAMES = frozenset({"conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml",
                             "sitecustomize.py", "usercustomize.py", ".pytest_cache", "__pycache__", ".git"})
TEST_DIRS = frozenset({"tests", "test", "testing"})
#: a cheap extra layer, not the defence: added library lines naming the test machinery
FORBIDDEN = re.compile(r"pytest|rlf_|RLF_|os\._exit|atexit|sys\.modules|builtins|settrace|setprofile|"
                       r"get_objects|PYTEST_")
_HEADER = re.compile(r"^diff --git a/(.+?) b/(.+?)$")
#: file suffixes Python imports a module from (a directory imports as a package)
_IMPORTABLE = frozenset({".py", ".pyc", ".pyw", ".so", ".pyd"})
#: the largest patch the hidden run takes (larger: the episode's failure, `patch_too_large`)
MAX_PATCH_BYTES = 2 << 20


def test_file_of(test_id: str) -> str | None:
    """The file part of a pytest node id (`tests/test_x.py::T::test_y[1]` -> `tests/test_x.py`), None for ids of
    other runners."""
    path = test_id.split("::", 1)[0]
    ok = path.endswith(".py") and not path.startswith("/") and ".." not in path.split("/")
    return posixpath.normpath(path) if ok else None


def task_test_files(t: SweTask) -> frozenset[str]:
    """What the hidden run owns, whatever the names: the files the F2P/P2P ids name, what `test_patch` touches, and
    the conftest.py files that configure those tests (their directory and every one above)."""
    files = set(patched_paths(t.test_patch))
    for tid in (*t.FAIL_TO_PASS, *t.PASS_TO_PASS):
        f = test_file_of(tid)
        if f is None:
            continue
        files.add(f)
        parts = PurePosixPath(f).parts[:-1]
        for k in range(len(parts) + 1):
            files.add("/".join((*parts[:k], "conftest.py")))
    return frozenset(files)


def import_roots(t: SweTask) -> frozenset[str]:
    """Directories of the repository (relative; "" is its root) that can stand on `sys.path` during the run: the
    root, `pythonpath`, and every directory above a test file (pytest's rootdir/basedir insertion)."""
    pp = posixpath.normpath(t.pythonpath).strip("/")
    roots = {"", "" if pp == "." else pp}
    for tid in (*t.FAIL_TO_PASS, *t.PASS_TO_PASS):
        f = test_file_of(tid)
        if f is not None:
            parts = PurePosixPath(f).parts[:-1]
            roots.update("/".join(parts[:k]) for k in range(len(parts) + 1))
    return frozenset(roots)


def shadowed_module(path: str, roots: Iterable[str], modules: frozenset[str]) -> str | None:
    """The module of `modules` that a new file at `path` would shadow from one of `roots`, else None: a module file
    (`json.py`) or a regular package (`json/__init__.py`) there. (A directory without `__init__.py` is a namespace
    package, which never wins over a module of the same name.)"""
    p = PurePosixPath(path).parts
    for root in roots:
        rp = PurePosixPath(root).parts if root else ()
        if p[:len(rp)] != rp:
            continue
        rel = p[len(rp):]
        if len(rel) == 2 and rel[1].partition(".")[0] == "__init__":
            name = rel[0]
        elif len(rel) == 1:
            stem, dot, rest = rel[0].partition(".")
            if not dot or "." + rest.rsplit(".", 1)[-1] not in _IMPORTABLE:
                continue
            name = stem
        else:
            continue
        if name in modules:
            return name
    return None


def is_protected(path: str, test_files: frozenset[str] = frozenset()) -> bool:
    """True for a path the hidden run owns or that changes how Python/pytest start (see the module doc)."""
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        return True
    name = p.parts[-1]
    if posixpath.normpath(path) in test_files or any(part in PROTECTED_NAMES for part in p.parts):
        return True
    if name.startswith("test_") or name.endswith(("_test.py", ".pth", ".pyc")):
        return True
    return any(part in TEST_DIRS for part in p.parts[:-1])


@dataclass
class FilteredPatch:
    text: str
    kept: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    forbidden: list[str] = field(default_factory=list)
    shadowing: list[str] = field(default_factory=list)


def split_patch(patch: str) -> list[tuple[str, str, str]]:
    """(old path, new path, text) of each file diff of a git-format patch (text outside any file diff dropped)."""
    out: list[tuple[str, str, str]] = []
    cur: list[str] = []
    paths: tuple[str, str] | None = None
    for line in patch.splitlines(keepends=True):
        m = _HEADER.match(line.rstrip("\n"))
        if m:
            if paths is not None:
                out.append((*paths, "".join(cur)))
            paths, cur = (m.group(1), m.group(2)), [line]
        elif paths is not None:
            cur.append(line)
    if paths is not None:
        out.append((*paths, "".join(cur)))
    return out


def patched_paths(patch: str) -> set[str]:
    return {p for a, b, _ in split_patch(patch) for p in (a, b)}


_NEW = re.compile(r"^(new file mode |rename to |copy to |--- /dev/null)", re.M)
_BINARY = re.compile(r"^(GIT binary patch|Binary files )", re.M)
_LINK = re.compile(r"^(new|old|deleted) file mode 120000|^new mode 120000", re.M)


def creates_file(text: str) -> bool:
    """A file diff that makes a path exist that did not (a new file, the target of a rename or copy)."""
    return _NEW.search(text) is not None


def filter_patch(patch: str, test_files: frozenset[str] = frozenset(), *, roots: Iterable[str] = ("",),
                 modules: frozenset[str] = frozenset()) -> FilteredPatch:
    """The library part of the agent's patch (see the module doc). `modules`: the verifier image's module names;
    a new file at one of `roots` named like one is dropped (and listed in `shadowing`)."""
    out = FilteredPatch("")
    parts = []
    roots = tuple(roots)
    for old, new, text in split_patch(patch):
        bad = (is_protected(old, test_files) or is_protected(new, test_files) or _BINARY.search(text) is not None
               or _LINK.search(text) is not None)
        if not bad and modules and creates_file(text) and shadowed_module(new, roots, modules) is not None:
            out.shadowing.append(new)
            bad = True
        if bad:
            out.dropped.append(new)
            continue
        added = "".join(line[1:] for line in text.splitlines(keepends=True)
                        if line.startswith("+") and not line.startswith("+++"))
        if FORBIDDEN.search(added):
            out.forbidden.append(new)
        out.kept.append(new)
        parts.append(text)
    out.text = "".join(parts)
    return out


@dataclass
class Verdict:
    """The hidden run's result. `value` is the reward (1.0 all pass; with partial credit the F2P fraction when every
    P2P passes); `infra_failed`: the host failed, there is no verdict. `failure`: why an episode scored 0 for a reason
    of its own other than failing tests (`patch_too_large`, `apply_failed`, `forbidden`, `tampering`, `no_report`,
    `timeout`, `hidden_run_error`...), logged per kind in the metrics (`failure/<kind>`). `unknown_tests`: asked-for
    ids the run never reported (a task whose ids are wrong shows here)."""

    value: float = 0.0
    f2p_passed: int = 0
    f2p_total: int = 0
    p2p_passed: int = 0
    p2p_total: int = 0
    infra_failed: bool = False
    apply_failed: bool = False
    forbidden: bool = False
    tampering: bool = False
    dropped_files: int = 0
    shadowing_files: int = 0
    failure: str = ""
    error: str = ""
    outcomes: dict[str, str] = field(default_factory=dict)
    unknown_tests: list[str] = field(default_factory=list)

    def fail(self, kind: str, error: str) -> Verdict:
        self.value, self.failure, self.error = 0.0, kind, error
        return self

    def info(self) -> dict[str, float]:
        out = {"swe/f2p_passed": float(self.f2p_passed), "swe/f2p_total": float(self.f2p_total),
               "swe/p2p_passed": float(self.p2p_passed), "swe/p2p_total": float(self.p2p_total),
               "swe/apply_failed": float(self.apply_failed), "swe/forbidden": float(self.forbidden),
               "swe/tampering": float(self.tampering), "swe/dropped_files": float(self.dropped_files),
               "swe/shadowing_files": float(self.shadowing_files),
               "swe/unknown_tests": float(len(self.unknown_tests)), "infra_failed": float(self.infra_failed)}
        if self.failure and not self.infra_failed:
            out[f"failure/{self.failure}"] = 1.0
        return out


VERIFY_DIR = "/tmp/.rlf_verify"

#: run by the image's own interpreter on the pristine tree (`python3 -I`: nothing of the repository on sys.path)
PROBE = r"""
import json, pkgutil, sys
names = set(sys.stdlib_module_names) | set(sys.builtin_module_names)
names.update(m.name for m in pkgutil.iter_modules())
try:
    import pytest  # noqa: F401
    ok = True
except Exception:
    ok = False
sys.stdout.write(json.dumps({"modules": sorted(names), "pytest": ok}))
"""

#: rlf's runner: `python3 -I run.py CONFIG` with the report key on stdin (see the module doc)
BOOTSTRAP = r'''
import os, sys
sys.dont_write_bytecode = True
_key = os.read(0, 256).strip()
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)
os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
os.environ.pop("PYTEST_ADDOPTS", None)
os.environ.pop("PYTEST_PLUGINS", None)
import hashlib, hmac, json
import pytest
_cfg = json.loads(sys.argv[1])
for _p in _cfg["roots"]:
    if _p not in sys.path:
        sys.path.append(_p)
os.environ["PYTHONPATH"] = os.pathsep.join(_cfg["roots"])


def _message(report):
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None:
        return str(crash.message)[:2000]
    text = str(getattr(report, "longrepr", "") or "")
    return text.strip().splitlines()[-1][:2000] if text.strip() else ""


class _Report:
    def __init__(self):
        self.out = {}

    def pytest_runtest_logreport(self, report):
        entry = self.out.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
        if report.failed:
            if entry["outcome"] != "failed":
                entry["outcome"] = "failed" if report.when == "call" else "error"
                entry["message"] = _message(report)
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"

    def pytest_collectreport(self, report):
        if report.failed:
            self.out[report.nodeid or "<collection>"] = {"outcome": "error", "message": _message(report)}


def _signer(key):
    def sign(body):
        return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
    return sign


_sign = _signer(_key)
del _key
_r = _Report()
try:
    _rc = int(pytest.main(_cfg["args"], plugins=[_r]))
except BaseException:
    _rc = 3
try:  # the report, then out at once: no thread, atexit hook or finaliser of the code under test runs after
    _body = json.dumps(_r.out, sort_keys=True)
    _fd = os.open(_cfg["report"], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    _data = json.dumps({"outcomes": _body, "mac": _sign(_body)}).encode()
    while _data:
        _data = _data[os.write(_fd, _data):]
    os.close(_fd)
finally:
    os._exit(_rc & 0xFF)
'''

#: ends every process the run left (the session user's: `kill -1` spares only the caller and pid 1)
KILL_LEFTOVERS = ["sh", "-c", "kill -9 -1 2>/dev/null; exit 0"]


def pytest_argv(t: SweTask) -> tuple[str, list[str]] | None:
    """(interpreter, pytest options) of a `<python> -m pytest [options]` test command, None for another runner."""
    try:
        words = shlex.split(t.test_cmd)
    except ValueError:
        return None
    if len(words) >= 3 and words[1:3] == ["-m", "pytest"] and "=" not in words[0]:
        return words[0], words[3:]
    return None


def pytest_command(t: SweTask, runner: tuple[str, list[str]], tests: list[str], vdir: str) -> list[str]:
    """The hidden run's argv (see the module doc): `runner` is `pytest_argv(t)`'s (interpreter, options)."""
    python, opts = runner
    roots = [posixpath.normpath(posixpath.join(t.workdir, t.pythonpath))]
    if posixpath.normpath(t.workdir) not in roots:
        roots.append(posixpath.normpath(t.workdir))
    cfg = {"roots": roots, "report": f"{vdir}/report.json", "args": ["-p", "no:cacheprovider", *opts, "--", *tests]}
    return [python, "-I", f"{vdir}/run.py", json.dumps(cfg)]


@dataclass(frozen=True)
class Canaries:
    """Two tests rlf appends to an F2P test file of the hidden run: `fail` must fail, `ok` must pass."""

    file: str
    fail: str
    ok: str

    @classmethod
    def make(cls, file: str) -> Canaries:
        a, b = (f"test_{secrets.token_hex(5)}" for _ in range(2))
        return cls(file, f"{file}::{a}", f"{file}::{b}")

    def source(self) -> str:
        x, y = secrets.randbelow(1 << 30), secrets.randbelow(1 << 30) + (1 << 30)
        z = secrets.randbelow(1 << 30)
        fa, fb = self.fail.rsplit("::", 1)[1], self.ok.rsplit("::", 1)[1]
        return (f"\n\n\ndef {fa}():\n    left, right = {x}, {y}\n    assert left == right\n\n\n"
                f"def {fb}():\n    value = {z}\n    assert value == {z}\n")


async def _checked(session: Any, cmd: Any, what: str, **kw: Any) -> Any:
    """An exec of rlf's own on the pristine tree: any failure is the host's."""
    r = await session.exec(cmd, **kw)
    if not r.ok:
        raise SessionInfraError(f"{what} failed in the verifier session (exit {r.exit_code}): "
                                f"{(r.stderr or r.stdout).strip()[-300:]}")
    return r


async def run_probe(session: Any, python: str, cwd: str) -> tuple[Any, dict[str, Any] | None]:
    """PROBE run by the image's own interpreter (`python -I`): the exec's result and its report, None when it did
    not give one."""
    r = await session.exec([python, "-I", "-c", PROBE], timeout_s=60, cwd=cwd)
    try:
        data = json.loads(r.stdout) if r.ok and not r.truncated else None
    except ValueError:
        data = None
    return r, data if isinstance(data, dict) else None


def module_names(data: dict[str, Any] | None) -> frozenset[str]:
    return frozenset(m for m in (data or {}).get("modules", ()) if isinstance(m, str))


async def probe_image(session: Any, python: str, workdir: str) -> frozenset[str]:
    """The verifier image's module names (stdlib, site-packages, builtins), by its own interpreter on the pristine
    tree; SessionInfraError without python or pytest (a misconfigured image, not the episode's failure)."""
    r, data = await run_probe(session, python, workdir)
    if data is None:
        raise SessionInfraError(f"the session image has no working {python!r} (exit {r.exit_code}: "
                                f"{r.stderr.strip()[-200:]}): give image= one with python3, git and pytest")
    if not data.get("pytest"):
        raise SessionInfraError("the session image has no pytest: build the Debian test image (`python -m "
                                "rlf_envs.sandbox.sessions.images build-debian`) or give image= one with python3, "
                                "git and pytest")
    return module_names(data)


async def run_hidden_tests(session: Any, t: SweTask, patch: str, *, partial_credit: bool = False,
                           timeout_s: float = 300.0, max_patch_bytes: int = MAX_PATCH_BYTES) -> Verdict:
    """Filter `patch`, apply it to `session` (a fresh session of the task's starting repository) and run the hidden
    tests. SessionInfraError (the host's failure) propagates to the caller; what the patch's own code causes is a
    Verdict with `failure` set."""
    v = Verdict(f2p_total=len(t.FAIL_TO_PASS), p2p_total=len(t.PASS_TO_PASS))
    if len(patch) > max_patch_bytes or len(patch.encode("utf-8", "surrogatepass")) > max_patch_bytes:
        return v.fail("patch_too_large", f"the patch is larger than {max_patch_bytes} bytes")
    argv = pytest_argv(t)
    if argv is None:
        raise SessionInfraError(f"task {t.instance_id}: test_cmd must be `<python> -m pytest [options]`, got "
                                f"{t.test_cmd!r}")
    vdir = f"{VERIFY_DIR}-{secrets.token_hex(8)}"
    wd = t.workdir
    # -- the pristine tree: everything here is rlf's own, so any failure is the host's
    await _checked(session, ["mkdir", "-p", "-m", "700", vdir], "mkdir", timeout_s=30)
    modules = await probe_image(session, argv[0], wd)
    fp = filter_patch(patch, task_test_files(t), roots=import_roots(t), modules=modules)
    v.dropped_files, v.shadowing_files = len(fp.dropped), len(fp.shadowing)
    if fp.forbidden:
        v.forbidden = True
        return v.fail("forbidden", f"the patch reaches into the test run ({', '.join(fp.forbidden[:3])})")
    if t.test_patch.strip():
        await session.write_file(f"{vdir}/test.patch", t.test_patch)
        r = await session.exec(["git", "apply", "--whitespace=nowarn", f"{vdir}/test.patch"], cwd=wd, timeout_s=60)
        if not r.ok:
            raise SessionInfraError(f"task {t.instance_id}: its test_patch does not apply to its repository: "
                                    f"{r.stderr.strip()[:300]}")
    tests = list(dict.fromkeys([*t.FAIL_TO_PASS, *t.PASS_TO_PASS]))
    canary_file = next((f for f in map(test_file_of, t.FAIL_TO_PASS) if f is not None), None)
    canaries = Canaries.make(canary_file) if canary_file is not None else None
    if canaries is not None:
        try:
            src = (await session.read_file(f"{wd}/{canaries.file}")).decode("utf-8")
        except (SessionFileNotFound, UnicodeDecodeError):
            canaries = None  # an F2P file the task does not hold: its ids show as unknown below
        else:
            await session.write_file(f"{wd}/{canaries.file}", src + canaries.source())
            tests += [canaries.fail, canaries.ok]
    key = secrets.token_hex(32)
    await session.write_file(f"{vdir}/run.py", BOOTSTRAP)
    # -- the patch: from here on, what happens is the episode's own doing
    if fp.text.strip():
        await session.write_file(f"{vdir}/agent.patch", fp.text)
        r = await session.exec(["git", "apply", "--whitespace=nowarn", f"{vdir}/agent.patch"], cwd=wd, timeout_s=60)
        if not r.ok:
            v.apply_failed = True
            return v.fail("apply_failed", f"the patch does not apply: {r.stderr.strip()[:300]}")
    run = None
    try:
        run = await session.exec(pytest_command(t, argv, tests, vdir), stdin=key + "\n", cwd=wd, timeout_s=timeout_s)
        await session.exec(KILL_LEFTOVERS, timeout_s=30)
        raw = await session.read_file(f"{vdir}/report.json")
    except SessionInfraError:
        raise
    except SessionFileNotFound:
        raw = b""
    except SessionError as e:  # the patch's code exhausted the session (memory, disk, pids) or broke the report
        return v.fail("hidden_run_error", f"the hidden run failed: {str(e)[:300]}")
    outcomes = verified_report(raw, key)
    if outcomes is None:
        if run is not None and run.timed_out:
            return v.fail("timeout", f"the hidden tests ran past {timeout_s:.0f} s")
        return v.fail("no_report", "the hidden run left no valid report (its code ended the run early or "
                                   f"tampered with the report; exit {run.exit_code if run else '?'})")
    if canaries is not None and canaries.fail in outcomes and outcomes[canaries.fail].passed:
        v.tampering = True
        return v.fail("tampering", "a test that must fail was reported as passed: the patch rewrote test outcomes")
    asked = list(dict.fromkeys([*t.FAIL_TO_PASS, *t.PASS_TO_PASS]))
    v.outcomes = {k: o.outcome for k, o in outcomes.items() if k in asked}
    v.unknown_tests = [k for k in asked if k not in outcomes]
    v.f2p_passed = sum(1 for k in t.FAIL_TO_PASS if k in outcomes and outcomes[k].passed)
    v.p2p_passed = sum(1 for k in t.PASS_TO_PASS if k in outcomes and outcomes[k].passed)
    all_p2p = v.p2p_passed == v.p2p_total
    if v.f2p_passed == v.f2p_total and all_p2p:
        v.value = 1.0
    elif partial_credit and all_p2p and v.f2p_total:
        v.value = v.f2p_passed / v.f2p_total
    return v


def verified_report(raw: bytes, key: str) -> dict[str, PytestOutcome] | None:
    """The report's outcomes when its signature is the run's key's, else None."""
    if not raw or len(raw) > (1 << 24):
        return None
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("outcomes"), str) or not isinstance(data.get("mac"), str):
        return None
    want = hmac.new(key.encode(), data["outcomes"].encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(want, data["mac"]):
        return None
    return parse_report(data["outcomes"], limit=1 << 24)


__all__ = ["MAX_PATCH_BYTES", "FilteredPatch", "Verdict", "filter_patch", "import_roots", "is_protected",
           "run_hidden_tests", "shadowed_module", "split_patch", "task_test_files", "verified_report"]
