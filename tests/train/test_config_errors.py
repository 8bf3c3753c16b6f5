"""Bad input found at run time: exit code 2 and one line naming the key and the fix, before any training
work (no run dir, no checkpoint, no SFT)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlf_train.cli import main
from rlf_train.config import dump_config
from tests.train.test_learning_signal import parity_cfg


def _run(tmp_path: Path, overrides: list[str], capsys: pytest.CaptureFixture[str], run: Path | None = None) -> str:
    run = run or tmp_path / "run"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(dump_config(parity_cfg(run, 1, ["sft.enabled=true", "sft.steps=2", "sft.num_demos=4"])))
    capsys.readouterr()
    assert main(["--config", str(cfg), *(a for o in overrides for a in ("--set", o))]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and len(err) < 700, err
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    return err


def test_demos_path_missing_or_invalid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _run(tmp_path, [f"sft.demos_path={tmp_path / 'nope.jsonl'}"], capsys)
    assert "sft.demos_path: no such file" in err and "remove it to use scripted demos" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_index": 0, "actions": ["<answer> x</answer>"]}\nnot json\n')
    err = _run(tmp_path, [f"sft.demos_path={bad}"], capsys)
    assert f"sft.demos_path {bad}:2:" in err and "task_index (int) and actions" in err
    bad.write_text('{"task_index": 99, "actions": ["<answer> x</answer>"]}\n')
    err = _run(tmp_path, [f"sft.demos_path={bad}"], capsys)
    assert "task_index 99 is out of range" in err and "has 6 tasks" in err


def test_env_kwargs_typo_names_the_key_without_dumping_objects(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    err = _run(tmp_path, ["env.kwargs.fomat=qwen3"], capsys)
    assert "env.kwargs: 'fomat' is not an option of rlf_test/Parity-v0 (did you mean 'format'?)" in err
    # an entry point taking **kwargs (the built-in Search env): the env's own error, on one short line
    err = _run(tmp_path, ["env.id=rlf/Search-v0", "env.imports=[rlf_envs]", "env.kwargs={fomat: qwen3}"], capsys)
    assert "env.kwargs" in err and "fomat" in err and "Tokenizer" not in err
    err = _run(tmp_path, ["env.kwargs.format=qwne3"], capsys)
    assert "env.kwargs (format='qwne3')" in err and "qwne3" in err


def test_env_imports_and_env_id(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _run(tmp_path, ["env.imports=[train_envs, no_such_module_xyz]"], capsys)
    assert "env.imports: no module named 'no_such_module_xyz'" in err
    err = _run(tmp_path, ["env.id=rlf_test/Parity-v1"], capsys)
    assert "env.id 'rlf_test/Parity-v1' is not registered (did you mean rlf_test/Parity-v0" in err


def test_eval_split_typo_is_found_before_sft(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _run(tmp_path, ["env.eval_split=tset"], capsys)
    assert "env.eval_split='tset'" in err and "unknown split 'tset'" in err
    assert not (tmp_path / "run").exists()
    # nothing was left behind: the corrected run starts fresh in the same dir
    assert main(["--config", str(tmp_path / "c.yaml"), "--set", "env.eval_split=test"]) == 0


def test_bad_model_and_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _run(tmp_path, [f"model.name_or_path={tmp_path / 'no-model'}"], capsys)
    assert "model.name_or_path: cannot load a tokenizer" in err and "use `tiny`" in err
    if not torch.cuda.is_available():
        err = _run(tmp_path, ["model.device=cuda"], capsys)
        assert "model.device: 'cuda' but no CUDA GPU is visible here; use model.device=cpu" in err
    err = _run(tmp_path, ["model.device=gpu0"], capsys)
    assert "model.device: 'gpu0' is not a device" in err


def test_unwritable_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    err = _run(tmp_path, [], capsys, run=blocker / "run")  # a path under a file: not creatable, even as root
    assert f"logging.run_dir: cannot write to {blocker / 'run'}" in err and "writable directory" in err


def test_resume_of_a_missing_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--resume", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no run there" in err and "\n" not in err
