"""Config loading, overrides, CLI help / dry-run, and the promised errors for bad configs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO

from rlf_train.cli import main
from rlf_train.config import ConfigError, TrainConfig, load_config

ROOT = REPO
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_and_overrides(tmp_path: Path) -> None:
    p = _write(tmp_path, "name: x\nrollout:\n  samples_per_prompt: 4\n")
    cfg = load_config(p, ["rollout.temperature=0.7", "algorithm.kl_coef=0.01", "env.kwargs.format=qwen3"])
    assert isinstance(cfg, TrainConfig)
    assert cfg.rollout.samples_per_prompt == 4 and cfg.rollout.temperature == 0.7
    assert cfg.algorithm.kl_coef == 0.01 and cfg.env.kwargs == {"format": "qwen3"}


def test_dr_grpo_defaults() -> None:
    cfg = load_config(None, ["algorithm.name=dr_grpo"])
    assert cfg.algorithm.std_normalize is False and cfg.algorithm.loss_agg == "seq_mean_token_sum_norm"
    cfg = load_config(None, ["algorithm.name=dr_grpo", "algorithm.std_normalize=true"])
    assert cfg.algorithm.std_normalize is True


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("rollout.temprature=1", "rollout.temprature: unknown key; allowed keys here:"),
        ("backend=ray", "backend: Input should be 'local' or 'openrlhf'"),
        ("rollout.samples_per_prompt=0", "rollout.samples_per_prompt: Input should be greater than or equal to 1"),
        ("algorithm.loss_agg=sum", "algorithm.loss_agg"),
        ("model.tiny.num_heads=3", "hidden_size (64) must be divisible by num_heads (3)"),
        ("optim.lr=fast", "optim.lr: Input should be a valid number"),
    ],
)
def test_bad_config_errors_name_the_key(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(None, [override])
    assert needle in str(ei.value)


def test_foreign_environments_say_what_they_run_with() -> None:
    """`rollout.environment` runs sync or async (the thread worker, as agents), on backend local, without
    group_reward; each refusal says why and what to set."""
    env = "rollout.environment=openenv:http://127.0.0.1:9"
    cfg = load_config(None, [env, "rollout.mode=async", "rollout.async_worker=thread"])
    assert cfg.rollout.mode == "async" and cfg.env.id == "rlf/Foreign-v0"
    for extra, needle in ((["rollout.mode=async"], "rollout.environment with rollout.mode: async runs its episodes "
                                                   "on a thread of the trainer"),
                          (["backend=openrlhf"], "set backend: local"),
                          (["group_reward={judge: {base_url: 'http://127.0.0.1:9/v1', model: m}}"],
                           "the foreign environment's own scorer gives the reward")):
        with pytest.raises(ConfigError, match=needle):
            load_config(None, [env, *extra])


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="--set expects key=value"):
        load_config(None, ["rollout.temperature"])
    with pytest.raises(ConfigError, match="is not a section"):
        load_config(_write(tmp_path, "name: a\n"), ["name.x=1"])
    with pytest.raises(ConfigError, match="name: Input should be a valid string"):
        load_config(None, ["name.x=1"])


def test_cli_errors_and_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    # what the working directory holds must not matter (issue 42: after the README's quickstart left
    # runs/quickstart-s0 there, this test failed): run from a directory holding that run
    (tmp_path / "runs" / "quickstart-s0").mkdir(parents=True)
    (tmp_path / "runs" / "quickstart-s0" / "metrics.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    bad = _write(tmp_path, "rollout:\n  max_turns: -1\n")
    assert main(["--config", str(bad)]) == 2
    assert "rollout.max_turns" in capsys.readouterr().err
    assert main(["--config", str(QUICKSTART), "--dry-run", "--set", "algorithm.steps=3"]) == 0
    out = capsys.readouterr().out
    assert "plan:" in out and "steps: 3" in out and "stage 1 SFT" in out
    # the quickstart's SFT stage has no OpenRLHF counterpart: refused by name before anything is written
    assert main(["--config", str(QUICKSTART), "--set", "backend=openrlhf", "--dry-run",
                 "--set", f"logging.run_dir={tmp_path}/q"]) == 2
    assert "sft.enabled: backend openrlhf has no SFT stage" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
    assert main([]) == 2


def test_openrlhf_dry_run_needs_neither_gpu_nor_openrlhf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--dry-run` of an openrlhf recipe on this CPU machine writes the run dir and prints the exact command;
    a real start says what is missing (exit 2)."""
    import importlib.util

    recipe = ROOT / "configs" / "openrlhf_tiny_1gpu.yaml"
    run = tmp_path / "run"
    assert main(["--config", str(recipe), "--dry-run", "--set", f"logging.run_dir={run}"]) == 0
    out = capsys.readouterr().out
    has_openrlhf = importlib.util.find_spec("openrlhf") is not None
    assert ("checked by OpenRLHF" if has_openrlhf else "not checked: openrlhf is not installed") in out
    assert "-m openrlhf.cli.train_ppo_ray" in out and "--train.agent_func_path" in out
    for f in ("config.yaml", "openrlhf_command.sh", "openrlhf_plan.txt", "data/train.jsonl", "data/eval.jsonl",
              "tiny_model/config.json", "tiny_model/tokenizer.json"):
        assert (run / f).is_file(), f
    assert len((run / "data" / "train.jsonl").read_text().splitlines()) == 3 * 8  # steps x prompts_per_step
    assert main(["--config", str(recipe), "--set", f"logging.run_dir={tmp_path}/run2"]) == 2
    err = capsys.readouterr().err
    assert ("needs NVIDIA GPUs" if has_openrlhf else "needs OpenRLHF here: pip install -e ") in err


def test_quickstart_config_is_valid() -> None:
    cfg = load_config(QUICKSTART)
    assert cfg.backend == "local" and cfg.sft.enabled and cfg.model.name_or_path == "tiny"


def test_module_help() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-m", "rlf_train", "--help"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0 and "--config" in r.stdout and "--resume" in r.stdout and "--dry-run" in r.stdout


def test_rl_starts_from_an_existing_sft_checkpoint(tmp_path: Path) -> None:
    """docs/guides/own-agent.md: `model.name_or_path: RUN/checkpoints/sft` with `sft.enabled: false` starts RL from
    exactly the SFT checkpoint's weights and tokenizer, without running the SFT stage again."""
    import torch

    from rlf_train.policy.tokenizer import load_tokenizer
    from rlf_train.trainer import Trainer
    from tests.train.test_learning_signal import parity_cfg

    sft_run = Trainer(parity_cfg(tmp_path / "sft", 0, ["sft.enabled=true", "sft.steps=3", "sft.num_demos=4",
                                                       "sft.lr=0.05", "eval.before_rl=false"]))
    sft_run.run()
    ckpt = tmp_path / "sft" / "checkpoints" / "sft"
    cfg = parity_cfg(tmp_path / "rl", 1, [f"model.name_or_path={ckpt}", "sft.enabled=false"])
    rl = Trainer(cfg)
    assert not rl.demos  # no SFT stage
    want = sft_run.model.state_dict()
    got = rl.model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k].to(got[k].device)) for k in want)
    text = "<|im_start|>user\nName item 3<|im_end|>"
    assert load_tokenizer(cfg.model).encode(text) == sft_run.tokenizer.encode(text)
    fresh = Trainer(parity_cfg(tmp_path / "fresh", 1, ["sft.enabled=false"]))
    assert any(not torch.equal(fresh.model.state_dict()[k], want[k]) for k in want)  # (SFT moved the weights)
    rl.run()
    assert (tmp_path / "rl" / "checkpoints" / "step_1").is_dir()
