"""Every file of a run directory gets the same mode as the run's plain writes (0644 under the usual umask):
eval.json and summary.json were written 0600 (atomic writes through mkstemp)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from rlf_train.cli import main
from rlf_train.config import dump_config
from tests.train.test_learning_signal import parity_cfg


def test_run_files_share_one_mode(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(dump_config(parity_cfg(run, 1)))
    old = os.umask(0o022)
    try:
        assert main(["--config", str(cfg)]) == 0
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in run.iterdir() if p.is_file()}
    assert {"eval.json", "summary.json", "config.yaml", "metrics.jsonl"} <= set(modes)
    assert set(modes.values()) == {0o644}, modes
    steps = [p for p in (run / "trajectories").iterdir()] if (run / "trajectories").is_dir() else []
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in steps)
