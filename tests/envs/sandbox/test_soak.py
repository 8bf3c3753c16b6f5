"""A few seconds of benchmarks/soak.py (the hostile soak) as a test: no exception out of step, no process left."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO

pytestmark = pytest.mark.timeout(240)

ROOT = REPO


def test_hostile_soak_smoke(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes", "0.1", "--envs", "8", "--json", str(out)],
        capture_output=True, text=True, timeout=200, cwd=ROOT,
    )
    assert out.exists(), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["steps"] > 0 and report["tool_calls"] > 0
    assert report["exceptions_out_of_step"] == 0, report["exception_samples"]
    assert report["leftover_processes"] == []
    assert proc.returncode == 0
