"""No dead ends after a crash: a run SIGKILLed mid-RL or mid-SFT continues with `--resume` exactly as
the uninterrupted run (weights, optimizer, scheduler, RNG, data order; on a run with real gradients),
metrics hold each row once; progress prints plain lines when stdout is no terminal; TensorBoard puts
each stage on its own axis from 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from repo_paths import SUPPORT
from safetensors.torch import load_file

from rlf_train.config import dump_config
from rlf_train.logging_utils import Progress
from rlf_train.trainer import Trainer
from tests.train.test_learning_signal import parity_cfg

TESTS = SUPPORT
STEPS = 5
VOLATILE = {"time_rollout", "time_generate", "time_env", "time_train", "time_step", "seconds"}
COMMON = ["logging.save_every=1", "logging.keep_last=3", "optim.warmup_steps=3", "algorithm.kl_coef=0.1",
          "sft.enabled=true", "sft.steps=60", "sft.batch_size=2", "sft.num_demos=8", "eval.every=2",
          "eval.before_rl=true", "logging.tensorboard=true"]


def rows(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if k not in VOLATILE}
            for x in (run / "metrics.jsonl").read_text().splitlines()]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{STEPS}" / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("full") / "run"
    Trainer(parity_cfg(run, STEPS, COMMON)).run()
    return run


def _run_until_parked_then_kill(run: Path, tmp: Path, pause_at: str | None, extra: list[str]) -> str:
    """Start the run in a subprocess; SIGKILL it once it parks (see train_envs) after checkpoint `pause_at`
    (for None: as soon as an SFT checkpoint sft_N appears). Returns the latest checkpoint at the kill."""
    flag = tmp / "parked"
    if pause_at is not None:
        extra = [*extra, f"env.kwargs.pause_on={flag}", f"env.kwargs.pause_after={run / 'checkpoints' / 'latest'}",
                 f"env.kwargs.pause_at={pause_at}"]
    cfg_file = tmp / "config.yaml"
    cfg_file.write_text(dump_config(parity_cfg(run, STEPS, COMMON + extra)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), *(p for p in sys.path if p)]))
    proc = subprocess.Popen([sys.executable, "-m", "rlf_train", "--config", str(cfg_file)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    latest = run / "checkpoints" / "latest"
    try:
        deadline = time.monotonic() + 300  # a generous bound: the run parks after a few seconds
        while time.monotonic() < deadline and proc.poll() is None:
            if pause_at is not None and flag.exists():
                break
            if pause_at is None and latest.is_file() and latest.read_text().startswith("sft_"):
                break
            time.sleep(0.005)
        assert proc.poll() is None, f"the run ended before it was killed: {proc.stderr.read().decode()[-2000:]}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        assert proc.stderr is not None
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return latest.read_text().strip()


@pytest.mark.parametrize(("pause_at", "extra"), [
    # checkpoints every 2 steps; parked in step 4's rollout: step 3's row was logged after the checkpoint
    ("step_2", ["logging.save_every=2", "env.kwargs.pause_skip=12"]),
    (None, []),
], ids=["killed_mid_rl", "killed_mid_sft"])
def test_resume_after_sigkill_equals_the_uninterrupted_run(tmp_path: Path, uninterrupted: Path,
                                                           pause_at: str | None, extra: list[str]) -> None:
    run = tmp_path / "run"
    at_kill = _run_until_parked_then_kill(run, tmp_path, pause_at, extra)
    if pause_at is None:
        assert at_kill.startswith("sft_"), at_kill
        assert not (run / "checkpoints" / "sft").exists()
    else:
        assert at_kill == pause_at
        assert ("rl", 3) in [(r["stage"], r["step"]) for r in rows(run)]  # logged after the checkpoint
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["env"]["kwargs"] = {}  # the resumed run does not park
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    from rlf_train.cli import main

    assert main(["--resume", str(run)]) == 0
    got, want = rows(run), rows(uninterrupted)
    keys = [(r["stage"], r["step"]) for r in got]
    assert len(keys) == len(set(keys)), "duplicate metrics rows after resume"
    assert got == want
    wa, wb = final_weights(uninterrupted), final_weights(run)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [r for r in got if r["stage"] == "rl"][-1]["grad_norm"] > 0
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith("sft_")]


def test_resume_without_a_checkpoint_starts_over_and_a_fresh_start_says_what_to_do(tmp_path: Path) -> None:
    run = tmp_path / "r"
    cfg = parity_cfg(run, 1)
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(cfg))
    (run / "metrics.jsonl").write_text('{"stage": "sft", "step": 10, "loss": 1.0}\n')  # killed before a checkpoint
    with pytest.raises(FileExistsError, match=f"--resume {run}"):
        Trainer(cfg)
    Trainer(cfg, resume=True).run()
    assert [(r["stage"], r["step"]) for r in rows(run)] == [("rl", 1), ("eval", 1)]
    with pytest.raises(FileNotFoundError, match="no run there"):
        Trainer(parity_cfg(tmp_path / "nothing", 1), resume=True)


def test_plain_progress_lines_when_stdout_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress(True, interactive=False) as p:
        p.add("GRPO", total=40, completed=20)
        for i in range(20):
            p.update("GRPO", info=f"reward {i}")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 10 and lines[0].startswith("GRPO 22/40 (55%)") and lines[-1].startswith("GRPO 40/40 (100%)")
    assert lines[-1].endswith("| reward 19") and "elapsed" in lines[0] and "left" in lines[0]
    with Progress(False, interactive=False) as p:
        p.add("SFT", total=3)
        p.update("SFT")
        p.print("message")
    assert capsys.readouterr().out == "message\n"


def test_tensorboard_stage_axes_start_at_zero(uninterrupted: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = {}
    for stage, tag in (("sft", "sft/loss"), ("rl", "rl/reward_mean"), ("eval", "eval/success_greedy")):
        acc = EventAccumulator(str(uninterrupted / "tb" / stage))
        acc.Reload()
        steps[stage] = [e.step for e in acc.Scalars(tag)]
    assert steps == {"sft": [10, 20, 30, 40, 50, 60], "rl": [1, 2, 3, 4, 5], "eval": [0, 2, 4, 5]}
