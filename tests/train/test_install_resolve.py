"""The install lines of rlf_train resolved by pip itself, as on a fresh machine (a dry run against the package index,
nothing installed): the trainer needs its local rlf-envs on the same line, and the TRL extra keeps the CPU torch this
install has (tests/envs/test_install_lines.py checks every line a user sees without pip)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from repo_paths import REPO as ROOT


def _pip(*args: str, constraint: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if not constraint:
        env.pop("PIP_CONSTRAINT", None)
    return subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_pip_resolves_the_smallest_installs_as_on_a_fresh_machine(tmp_path: Path) -> None:
    """`--ignore-installed`: pip resolves as if nothing were installed (a fresh machine), against the index."""
    lone = _pip("--ignore-installed", "-e", "./rlf_train")
    assert lone.returncode != 0 and "rlf-envs" in lone.stderr  # the bug: the trainer alone cannot find rlf-envs
    for line in (["-e", "./rlf_envs", "-e", "./rlf_train"], ["-e", "./rlf_envs", "./servers"]):
        report = tmp_path / "report.json"
        proc = _pip("--ignore-installed", "--report", str(report), *line)
        assert proc.returncode == 0, f"pip install {' '.join(line)}:\n{proc.stderr[-3000:]}"
        names = {i["metadata"]["name"] for i in json.loads(report.read_text())["install"]}
        assert "rlf-envs" in names


def test_the_trl_extra_keeps_an_installed_cpu_torch(tmp_path: Path) -> None:
    """docs/integrations/trl.md: with the CPU torch in place (this env's 2.13.0+cpu), the extra's line installs no
    torch and no nvidia-* package (resolved by pip without our constraints file, as a user would run it)."""
    import torch

    assert torch.__version__.startswith("2.13.0")
    report = tmp_path / "report.json"
    proc = _pip("--report", str(report), "-e", "./rlf_envs[trl]", constraint=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}
    assert "trl" in names
    assert "torch" not in names and not any(n.startswith("nvidia") for n in names), sorted(names)
