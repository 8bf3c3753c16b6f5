"""Promises of the sessions and the SWE verifier that deliberate one-line breaks of the code once slipped past the
whole suite (issue 49, item 13): each test here fails when that one defence alone is removed.

- the reaper's owner check compares the owner's start time (a reused pid does not keep a dead run's sessions);
- the create-rate limit consumes a token per create;
- the patch filter drops binary patches and symlinks;
- the verdict needs every PASS_TO_PASS test (a fix that breaks another test scores 0);
- a report whose signature is not the run's is no report;
- the hidden run's deadline fires and is the episode's failure, not the host's;
- an image without the test runner is the host's failure, found before the patch applies;
- an exec's output one byte over the cap is flagged truncated."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from session_support import need_sessions, session_image

from rlf_envs import runtime
from rlf_envs.data.swe.generate import unified_diff
from rlf_envs.envs.swe.verify import filter_patch, verified_report
from rlf_envs.sandbox.sessions import owners
from rlf_envs.sandbox.sessions.types import CreateRate


def test_a_reused_pid_does_not_keep_a_dead_owners_sessions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLF_SESSIONS_DIR", str(tmp_path))
    me = os.getpid()
    assert owners.alive(me, owners.start_time(me))
    assert not owners.alive(me, (owners.start_time(me) or 0) + 12345)  # same pid, another process's start
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lab = owners.Label("loc-test-reused", "local", "run", me, (owners.start_time(me) or 0) + 12345,
                           procs=[(stray.pid, owners.start_time(stray.pid))])
        lab.save()
        assert not lab.owner_alive()
        assert owners.reap("local") == 1
        assert stray.wait(timeout=30) == -9 and not Path(lab.path()).exists()
    finally:
        if stray.poll() is None:
            stray.kill()


def test_the_create_rate_limit_consumes_a_token_per_create() -> None:
    async def go() -> float:
        rate = CreateRate(per_s=20.0, burst=1)
        t0 = time.monotonic()
        for _ in range(6):
            await rate.wait()
        return time.monotonic() - t0

    # 6 creates at 20/s with a burst of 1: at least 5 intervals of 50 ms (a slow machine only adds to it)
    assert asyncio.run(go()) >= 0.24
    async def unlimited() -> None:
        off = CreateRate(per_s=0.0, burst=1)
        await asyncio.wait_for(asyncio.gather(*(off.wait() for _ in range(100))), 30)

    asyncio.run(unlimited())  # per_s <= 0: no limit


def test_the_patch_filter_drops_binary_patches_and_links() -> None:
    binary = ("diff --git a/calc/blob.so b/calc/blob.so\nnew file mode 100644\nindex 0000000..1111111\n"
              "GIT binary patch\nliteral 4\nLcmZ?d00001\n\nliteral 0\nHcmV?d00001\n\n")
    link = ("diff --git a/calc/link.py b/calc/link.py\nnew file mode 120000\n--- /dev/null\n+++ b/calc/link.py\n"
            "@@ -0,0 +1 @@\n+/etc/passwd\n\\ No newline at end of file\n")
    lib = unified_diff("calc/__init__.py", "X = 1\n", "X = 2\n")
    fp = filter_patch(binary + link + lib)
    assert fp.dropped == ["calc/blob.so", "calc/link.py"] and fp.kept == ["calc/__init__.py"]


def test_a_report_not_signed_with_the_runs_key_is_no_report() -> None:
    body = json.dumps({"t.py::a": {"outcome": "passed", "message": ""}}, sort_keys=True)
    good = hmac.new(b"k" * 64, body.encode(), hashlib.sha256).hexdigest()
    assert verified_report(json.dumps({"outcomes": body, "mac": good}).encode(), "k" * 64) is not None
    assert verified_report(json.dumps({"outcomes": body, "mac": good}).encode(), "j" * 64) is None
    assert verified_report(json.dumps({"outcomes": body, "mac": "0" * 64}).encode(), "k" * 64) is None
    assert verified_report(json.dumps({"outcomes": json.loads(body)}).encode(), "k" * 64) is None
    assert verified_report(b"", "k" * 64) is None


SRC = "def clamp(x, lo, hi):\n    if x < lo:\n        return lo\n    if x > hi:\n        return hi\n    return x\n"
BUG = SRC.replace("if x > hi:", "if x < hi:")
TESTS = ("from calc import clamp\n\n\ndef test_low():\n    assert clamp(-5, 0, 10) == 0\n\n\n"
         "def test_high():\n    assert clamp(50, 0, 10) == 10\n")


def _row(tmp: Path, **over: Any) -> dict[str, Any]:
    repo = tmp / "repo"
    (repo / "calc").mkdir(parents=True)
    (repo / "calc" / "__init__.py").write_text(SRC)
    (repo / "test_calc.py").write_text(TESTS)
    r = {"instance_id": "promise-1", "problem_statement": "clamp", "repo_dir": str(repo),
         "bug_patch": unified_diff("calc/__init__.py", SRC, BUG), "patch": unified_diff("calc/__init__.py", BUG, SRC),
         "FAIL_TO_PASS": ["test_calc.py::test_high"], "PASS_TO_PASS": ["test_calc.py::test_low"]}
    r.update(over)
    return r


def _verdict(r: dict[str, Any], patch: str, **kw: Any) -> Any:
    from rlf_envs.envs.swe.env import SweVerifier
    from rlf_envs.envs.swe.tasks import load_swe_rows

    return runtime.run(SweVerifier(image=session_image(), **kw).verdict(patch, load_swe_rows([r])[0]))


def test_a_fix_that_breaks_a_pass_to_pass_test_scores_zero(tmp_path: Path) -> None:
    need_sessions()
    r = _row(tmp_path)
    assert _verdict(r, r["patch"]).value == 1.0
    breaks_low = unified_diff("calc/__init__.py", BUG, SRC.replace("return lo", "return hi"))
    v = _verdict(r, breaks_low)
    assert v.f2p_passed == 1 and v.p2p_passed == 0 and v.value == 0.0
    assert _verdict(r, breaks_low, partial_credit=True).value == 0.0


def test_the_hidden_runs_deadline_fires_and_is_the_episodes_failure(tmp_path: Path) -> None:
    from rlf_envs.envs.swe.env import SweLimits

    need_sessions()
    r = _row(tmp_path)
    hang = unified_diff("calc/__init__.py", BUG, "import time\ntime.sleep(600)\n" + SRC)
    t0 = time.monotonic()
    v = _verdict(r, hang, limits=SweLimits(test_timeout_s=3.0))
    assert v.value == 0.0 and v.failure == "timeout" and not v.infra_failed
    assert time.monotonic() - t0 < 300  # the deadline fired (generous: a loaded machine)


def test_an_image_without_the_test_runner_is_the_hosts_failure(tmp_path: Path) -> None:
    need_sessions()
    r = _row(tmp_path, test_cmd="python3-without-pytest -m pytest -q")
    v = _verdict(r, r["patch"])
    assert v.infra_failed and "python3-without-pytest" in v.error and v.value == 0.0


def test_output_one_byte_over_the_cap_is_flagged_truncated() -> None:
    from rlf_envs.sandbox.sessions import SessionLimits, SessionSpec
    from rlf_envs.sandbox.sessions.local import LocalBackend

    if os.geteuid() != 0:
        pytest.skip("the local session backend needs root")

    async def go() -> tuple[Any, Any]:
        async with LocalBackend(pool_size=0) as b:
            s = await b.create(SessionSpec(limits=SessionLimits(output_bytes=4096)))
            try:
                exact = await s.exec(["head", "-c", "4096", "/dev/zero"])
                over = await s.exec(["head", "-c", "4097", "/dev/zero"])
            finally:
                await s.aclose()
            return exact, over

    exact, over = asyncio.run(go())
    assert len(exact.stdout) == 4096 and not exact.truncated
    assert len(over.stdout) == 4096 and over.truncated
