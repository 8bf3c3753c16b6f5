"""The local backend on one CUDA GPU: the quickstart recipe, shortened, trains end to end on the GPU (SFT, then
GRPO with in-process search), in float32 and in bfloat16; its checkpoint resumes on the GPU and continues
exactly where an uninterrupted GPU run goes; a Qwen3-0.6B-shaped model (built from config, no download) runs
GRPO steps in bfloat16. Skipped without a GPU, with the reason shown."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO

ROOT = REPO
pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(1500)]

SHORT = ["sft.steps=600", "algorithm.steps=4", "eval.every=2", "eval.num_tasks=16", "eval.sampled=false",
         "logging.save_every=2", "model.device=cuda"]


def _train(run: Path, extra: list[str], resume: bool = False) -> list[dict]:
    if resume:
        cmd = [sys.executable, "-m", "rlf_train", "--resume", str(run)]
    else:
        sets = [f"logging.run_dir={run}", *SHORT, *extra]
        cmd = [sys.executable, "-m", "rlf_train", "--config", str(ROOT / "configs" / "quickstart.yaml")]
        cmd += [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    log = proc.stdout + proc.stderr
    (run.parent / f"{run.name}{'-resume' if resume else ''}.log").write_text(log)
    assert proc.returncode == 0, log[-5000:]
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _rl_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("stage") == "rl" and "loss" in r]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quickstart_trains_on_the_gpu(tmp_path: Path, dtype: str) -> None:
    run = tmp_path / f"run-{dtype}"
    rows = _rl_rows(_train(run, [f"model.dtype={dtype}"]))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["reward_mean"]) for r in rows)
    assert (run / "checkpoints" / "step_4" / "model.safetensors").is_file()
    assert (run / "reward_curve.png").is_file()


def test_gpu_checkpoint_resumes_on_the_gpu(tmp_path: Path) -> None:
    """Roll a finished GPU run back to its step-2 checkpoint (as a crash after step 2 leaves it) and resume:
    steps 3-4 run again from that checkpoint (weights, optimizer state and RNG loaded onto the GPU)."""
    run = tmp_path / "run"
    full = _rl_rows(_train(run, []))
    ckpts = run / "checkpoints"
    shutil.copytree(run, tmp_path / "before-resume")
    shutil.rmtree(ckpts / "step_4")
    (ckpts / "latest").write_text("step_2")
    resumed = _rl_rows(_train(run, [], resume=True))
    log = (tmp_path / "run-resume.log").read_text()
    assert "resumed from the rl checkpoint at step 2" in log, log[-3000:]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in resumed)
    # CUDA kernels are deterministic for these shapes on one GPU; print the comparison for the record
    for a, b in zip(full[2:], resumed[2:], strict=True):
        print(f"step {a['step']}: reward {a['reward_mean']} vs resumed {b['reward_mean']}, "
              f"loss {a['loss']:.6f} vs {b['loss']:.6f}")
        assert a["reward_mean"] == b["reward_mean"]


def test_qwen3_06b_shape_runs_grpo_steps_in_bf16(tmp_path: Path) -> None:
    run = tmp_path / "big"
    big = ["model.tiny.hidden_size=1024", "model.tiny.num_layers=28", "model.tiny.num_heads=16",
           "model.tiny.num_kv_heads=8", "model.tiny.intermediate_size=3072", "model.dtype=bfloat16",
           "sft.enabled=false", "algorithm.steps=2", "rollout.batch_size=64", "algorithm.micro_batch_size=16"]
    rows = _rl_rows(_train(run, big))
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows)
