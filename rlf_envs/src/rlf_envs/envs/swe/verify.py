"""The hidden-test run: the episode's patch on a FRESH session of the task's repository, then F2P + P2P.

Nothing of the agent's workspace reaches the verdict but its diff, and only the part of it that may change the
library. `filter_patch` drops every file diff that touches what the hidden run owns or what changes how Python
or pytest start:

- test code: `test_*.py`, `*_test.py`, `conftest.py`, anything under a `tests/`, `test/` or `testing/` directory,
  and every file the task's `test_patch` touches (restored from the task, then `test_patch` is applied);
- test and packaging configuration: `pytest.ini`, `tox.ini`, `setup.cfg`, `pyproject.toml`, `.pytest_cache/`;
- interpreter start-up hooks: `sitecustomize.py`, `usercustomize.py`, `*.pth`, `__pycache__/`, `*.pyc`;
- symlinks, binary patches, paths outside the repository (`..`, absolute), and `.git/`.

A patch whose added lines name pytest, the report plugin, `os._exit`, `atexit`, `sys.modules`, `builtins`,
`sys.settrace`/`setprofile` or `gc.get_objects` is refused as a forgery attempt (reward 0, `info["forbidden"]`):
the library runs inside the test process, so such code could rewrite outcomes.

The run: `git apply` of the filtered patch (failure: reward 0, `apply_failed`), the task's `test_patch`, then
`pytest -p no:cacheprovider -o addopts=` on exactly the F2P + P2P ids with `PYTHONDONTWRITEBYTECODE=1`,
`PYTHONNOUSERSITE=1` and the report plugin, which reads a one-time nonce from a file it deletes at start-up and
writes it into the report; a report without the nonce is no report (every test counts as not passed). Host or
engine failures (`SessionInfraError`) are `Verdict.infra_failed`, never a reward of 0.
"""

from __future__ import annotations

import re
import secrets
import shlex
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from rlf_envs.envs.swe.pytest_report import PLUGIN_MODULE, PLUGIN_SOURCE, REPORT_ENV, parse_report
from rlf_envs.envs.swe.tasks import SweTask

PROTECTED_NAMES = frozenset({"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml",
                             "sitecustomize.py", "usercustomize.py", ".pytest_cache", "__pycache__", ".git"})
TEST_DIRS = frozenset({"tests", "test", "testing"})
FORBIDDEN = re.compile(r"pytest|rlf_|RLF_|os\._exit|atexit|sys\.modules|builtins|settrace|setprofile|"
                       r"get_objects|PYTEST_")
_HEADER = re.compile(r"^diff --git a/(.+?) b/(.+?)$")


def is_protected(path: str, test_files: frozenset[str] = frozenset()) -> bool:
    """True for a path the hidden run owns or that changes how Python/pytest start (see the module doc)."""
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        return True
    name = p.parts[-1]
    if path in test_files or any(part in PROTECTED_NAMES for part in p.parts):
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


def filter_patch(patch: str, test_files: frozenset[str] = frozenset()) -> FilteredPatch:
    """The library part of the agent's patch (see the module doc)."""
    out = FilteredPatch("")
    parts = []
    for old, new, text in split_patch(patch):
        bad = (is_protected(old, test_files) or is_protected(new, test_files) or "GIT binary patch" in text
               or "Binary files" in text or re.search(r"^(new|old|deleted) file mode 120000|^new mode 120000", text,
                                                     re.M) is not None)
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
    P2P passes); `infra_failed`: the host failed, there is no verdict."""

    value: float = 0.0
    f2p_passed: int = 0
    f2p_total: int = 0
    p2p_passed: int = 0
    p2p_total: int = 0
    infra_failed: bool = False
    apply_failed: bool = False
    forbidden: bool = False
    dropped_files: int = 0
    error: str = ""
    outcomes: dict[str, str] = field(default_factory=dict)

    def info(self) -> dict[str, float]:
        return {"swe/f2p_passed": float(self.f2p_passed), "swe/f2p_total": float(self.f2p_total),
                "swe/p2p_passed": float(self.p2p_passed), "swe/p2p_total": float(self.p2p_total),
                "swe/apply_failed": float(self.apply_failed), "swe/forbidden": float(self.forbidden),
                "swe/dropped_files": float(self.dropped_files), "infra_failed": float(self.infra_failed)}


VERIFY_DIR = "/tmp/.rlf_verify"


def pytest_command(t: SweTask, tests: list[str], vdir: str) -> str:
    pp = ":".join([shlex.quote(t.pythonpath), vdir])
    return (f"cd {shlex.quote(t.workdir)} && PYTHONPATH={pp} PYTHONDONTWRITEBYTECODE=1 PYTHONNOUSERSITE=1 "
            f"{REPORT_ENV}={vdir}/nonce {t.test_cmd} -p {PLUGIN_MODULE} -- "
            + " ".join(shlex.quote(x) for x in tests))


NONCE_PLUGIN = PLUGIN_SOURCE + '''

def _load_nonce():
    import os
    path = os.environ.pop("RLF_PYTEST_REPORT", "")
    if not path:
        return None, None
    with open(path, encoding="utf-8") as f:
        nonce, out = f.read().split("\\n", 1)
    os.unlink(path)
    return nonce, out.strip()


_NONCE, _PATH = _load_nonce()


def pytest_sessionfinish(session, exitstatus):
    if _PATH:
        with open(_PATH, "w", encoding="utf-8") as f:
            json.dump({"nonce": _NONCE, "outcomes": _OUT}, f)
'''


async def run_hidden_tests(session: Any, t: SweTask, patch: str, *, partial_credit: bool = False,
                           timeout_s: float = 300.0) -> Verdict:
    """Filter `patch`, apply it to `session` (a fresh session of the task's starting repository) and run the hidden
    tests. SessionInfraError propagates to the caller."""
    import json

    test_files = frozenset(patched_paths(t.test_patch))
    fp = filter_patch(patch, test_files)
    v = Verdict(f2p_total=len(t.FAIL_TO_PASS), p2p_total=len(t.PASS_TO_PASS), dropped_files=len(fp.dropped))
    if fp.forbidden:
        v.forbidden, v.error = True, f"the patch reaches into the test run ({', '.join(fp.forbidden[:3])})"
        return v
    vdir = f"{VERIFY_DIR}-{secrets.token_hex(8)}"
    await session.exec(["mkdir", "-p", "-m", "700", vdir], timeout_s=30)
    for name, text in (("agent.patch", fp.text), ("test.patch", t.test_patch)):
        if not text.strip():
            continue
        await session.write_file(f"{vdir}/{name}", text)
        r = await session.exec(f"cd {shlex.quote(t.workdir)} && git apply --whitespace=nowarn {vdir}/{name}",
                               timeout_s=60)
        if not r.ok:
            if name == "agent.patch":
                v.apply_failed, v.error = True, f"the patch does not apply: {r.stderr.strip()[:300]}"
                return v
            raise RuntimeError(f"task {t.instance_id}: test_patch does not apply: {r.stderr.strip()[:300]}")
    nonce = secrets.token_hex(16)
    await session.write_file(f"{vdir}/{PLUGIN_MODULE}.py", NONCE_PLUGIN)
    await session.write_file(f"{vdir}/nonce", f"{nonce}\n{vdir}/report.json")
    tests = list(dict.fromkeys([*t.FAIL_TO_PASS, *t.PASS_TO_PASS]))
    r = await session.exec(pytest_command(t, tests, vdir), timeout_s=timeout_s)
    outcomes = {}
    try:
        raw = await session.read_file(f"{vdir}/report.json")
        data = json.loads(raw) if len(raw) < (1 << 22) else None
        if isinstance(data, dict) and data.get("nonce") == nonce:
            outcomes = parse_report(json.dumps(data.get("outcomes")))
    except Exception:
        if getattr(r, "timed_out", False):
            v.error = f"the hidden tests ran past {timeout_s:.0f} s"
        elif "No module named pytest" in r.stderr:
            v.infra_failed = True
            v.error = ("the session image has no pytest: build the Debian test image (`python -m "
                       "rlf_envs.sandbox.sessions.images build-debian`) or give image= one with python3 and pytest")
    v.outcomes = {k: o.outcome for k, o in outcomes.items() if k in tests}
    v.f2p_passed = sum(1 for k in t.FAIL_TO_PASS if k in outcomes and outcomes[k].passed)
    v.p2p_passed = sum(1 for k in t.PASS_TO_PASS if k in outcomes and outcomes[k].passed)
    all_p2p = v.p2p_passed == v.p2p_total
    if v.f2p_passed == v.f2p_total and all_p2p:
        v.value = 1.0
    elif partial_credit and all_p2p and v.f2p_total:
        v.value = v.f2p_passed / v.f2p_total
    return v


__all__ = ["FilteredPatch", "Verdict", "filter_patch", "is_protected", "run_hidden_tests", "split_patch"]
