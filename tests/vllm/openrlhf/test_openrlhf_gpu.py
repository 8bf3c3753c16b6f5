"""backend openrlhf end to end on a GPU (Ray + vLLM + DeepSpeed): configs/openrlhf_tiny_1gpu.yaml for a few
steps. Needs a CUDA GPU and `pip install -e ./rlf_envs -e './rlf_train[openrlhf]'`; skipped otherwise, with the
reason shown."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO

ROOT = REPO

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None or importlib.util.find_spec("deepspeed") is None,
                    reason="needs vLLM and DeepSpeed: pip install -e ./rlf_envs -e './rlf_train[openrlhf]' "
                           "on a GPU machine")
def test_tiny_recipe_trains_on_one_gpu(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rlf_train", "--config", str(ROOT / "configs" / "openrlhf_tiny_1gpu.yaml"),
         "--set", f"logging.run_dir={run}"], capture_output=True, text=True, timeout=1800)
    log = proc.stdout + proc.stderr
    (tmp_path / "log.txt").write_text(log)
    assert proc.returncode == 0, log[-5000:]
    assert "Global step 3" in log and "rlf_tool_calls" in log
    assert (run / "model" / "config.json").is_file()
    assert json.loads((run / "model" / "config.json").read_text())["model_type"] == "qwen3"
