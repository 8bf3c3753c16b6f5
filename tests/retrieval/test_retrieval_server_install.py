"""The retrieval server installed as a distribution (`pip install ./servers`): the `rlf-retrieval` console
script works from any directory, without the repo on the path; logs are quiet unless `--verbose`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ROOT, SEARCH_CORPUS, stop_process


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip install ./servers` into a private target dir (offline: hatchling comes from the test env)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(ROOT / "servers")],
        check=True, timeout=240, capture_output=True,
    )
    return target


def _run(installed: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(installed)}  # the installed copy only: no repo root on the path
    return subprocess.run([str(installed / "bin" / "rlf-retrieval"), *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=180)


def test_console_script_builds_quietly_from_anywhere(installed: Path, tmp_path: Path) -> None:
    assert not (installed / "servers").exists() and (installed / "rlf_servers" / "retrieval" / "app.py").is_file()
    out = _run(installed, tmp_path, "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: rlf-retrieval"), out.stderr
    built = _run(installed, tmp_path, "build", "--corpus", str(SEARCH_CORPUS), "--out", "idx", "--kind", "bm25")
    assert built.returncode == 0, built.stderr
    assert built.stdout.strip() == "built bm25 index of 450 documents in idx"
    assert built.stderr == ""  # no bm25s DEBUG lines, no progress bars
    loud = _run(installed, tmp_path, "build", "--corpus", str(SEARCH_CORPUS), "--out", "idx2", "--kind", "bm25", "-v")
    assert loud.returncode == 0 and "bm25 tokenise" in loud.stderr.lower()  # --verbose shows progress bars


def test_console_script_serves(installed: Path, tmp_path: Path) -> None:
    assert _run(installed, tmp_path, "build", "--corpus", str(SEARCH_CORPUS), "--out", "idx", "--kind",
                "bm25").returncode == 0
    env = {**os.environ, "PYTHONPATH": str(installed)}
    proc = subprocess.Popen([str(installed / "bin" / "rlf-retrieval"), "serve", "--index", "idx", "--port", "0"],
                            cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the server's first line: "... listening on http://..."
        url = line.split("listening on ")[1].split()[0]
        body = json.dumps({"queries": ["Who founded the Ostrava Guild?"], "topk": 2}).encode()
        req = urllib.request.Request(f"{url}/retrieve", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert len(json.load(resp)["result"][0]) == 2
    finally:
        stop_process(proc)
