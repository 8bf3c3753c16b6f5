"""`python -m rlf_train --dry-run` checks everything the real run checks before its work starts: each bad config
below fails the dry run with exit 2 and the same one-line error as the real run, and the dry run writes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from repo_paths import REPO

from rlf_train.cli import main
from rlf_train.config import dump_config
from tests.train.test_learning_signal import parity_cfg

QUICKSTART = REPO / "configs" / "quickstart.yaml"


def _both(tmp_path: Path, overrides: list[str], capsys: pytest.CaptureFixture[str],
          run: Path | None = None, same_to: str = "") -> str:
    """The error line of the dry run, checked equal to the real run's (up to `same_to`, when given: the OS's
    words for why a directory is not writable may differ)."""
    run = run or tmp_path / "run"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(dump_config(parity_cfg(run, 1, ["sft.enabled=true", "sft.steps=2", "sft.num_demos=4"])))
    sets = [a for o in overrides for a in ("--set", o)]
    capsys.readouterr()
    existed = run.exists()
    assert main(["--config", str(cfg), *sets, "--dry-run"]) == 2
    dry = capsys.readouterr()
    assert run.exists() == existed, "the dry run wrote the run dir"
    assert main(["--config", str(cfg), *sets]) == 2
    real = capsys.readouterr().err.strip()
    err = dry.err.strip()
    assert err.startswith("error: ") and "\n" not in err and "plan:" not in dry.out, err
    assert err.split(same_to)[0] == real.split(same_to)[0] if same_to else err == real
    return err


@pytest.mark.parametrize(("overrides", "expected"), [
    (["env.kwargs.fomat=qwen3"], "env.kwargs: 'fomat' is not an option of rlf_test/Parity-v0 (did you mean 'format'?)"),
    (["env.id=rlf/Search-v0", "env.imports=[rlf_envs]", "env.train_split=train", "env.eval_split=test",
      "env.kwargs.topkk=2"], "env.kwargs: 'topkk' is not an option of rlf/Search-v0 (did you mean 'topk'?)"),
    (["env.eval_split=tset"], "unknown split 'tset'"),
    (["env.id=rlf_test/Parity-v1"], "is not registered (did you mean rlf_test/Parity-v0"),
    (["model.device=gpu0"], "model.device: 'gpu0' is not a device"),
])
def test_dry_run_refuses_what_the_run_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              overrides: list[str], expected: str) -> None:
    assert expected in _both(tmp_path, overrides, capsys)


def test_dry_run_checks_demos_model_and_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_index": 99, "actions": ["<answer> x</answer>"]}\n')
    assert "task_index 99 is out of range" in _both(tmp_path, [f"sft.demos_path={bad}"], capsys)
    assert "model.name_or_path: cannot load a tokenizer" in _both(
        tmp_path, [f"model.name_or_path={tmp_path / 'no-model'}"], capsys)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert "logging.run_dir: cannot write to" in _both(tmp_path, [], capsys, run=blocker / "run", same_to=" (")


def test_dry_run_does_not_refuse_an_existing_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dry run checks a config anywhere (README): a run dir holding a run is a note there, and the real run
    refuses it (issue 42: `--dry-run` after the quickstart exited 2)."""
    run = tmp_path / "done"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(dump_config(parity_cfg(run, 1)))
    capsys.readouterr()
    assert main(["--config", str(cfg), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "plan:" in out and f"note: run dir {run} already holds a run" in out and "--resume" in out
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]  # nothing written
    assert main(["--config", str(cfg)]) == 2
    assert "already holds a run; continue it with --resume" in capsys.readouterr().err


def test_quickstart_misspelt_kwarg_fails_the_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's case: `--set env.kwargs.topkk=2 --dry-run` on the quickstart exited 0."""
    run = ["--set", f"logging.run_dir={tmp_path / 'q'}"]
    assert main(["--config", str(QUICKSTART), "--set", "env.kwargs.topkk=2", "--dry-run", *run]) == 2
    err = capsys.readouterr().err.strip()
    assert "'topkk' is not an option of rlf/Search-v0 (did you mean 'topk'?)" in err and "\n" not in err
    assert main(["--config", str(QUICKSTART), "--dry-run", *run]) == 0
    assert "plan:" in capsys.readouterr().out
    assert not (tmp_path / "q").exists()  # a dry run writes nothing
