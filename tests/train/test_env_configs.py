"""The trainer on the new envs' configs: configs/sql_quickstart.yaml (rlf/SQL-v0 with its own tokenizer),
configs/code_quickstart.yaml (rlf/Code-v0, likewise) and configs/mcp_example.yaml (rlf/Tools-v0 + a real PyPI
MCP server, from YAML alone)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO

from rlf_train.config import load_config
from rlf_train.policy.tokenizer import load_tokenizer
from rlf_train.rollout.env_factory import make_envs

ROOT = REPO


ENV_CONFIGS = ["sql_quickstart.yaml", "code_quickstart.yaml"]


@pytest.mark.parametrize("config", ENV_CONFIGS)
def test_env_tokenizer_covers_the_env_text(config: str) -> None:
    """The env's shipped tokenizer: protocol tags are single tokens, and a demo turn fits the turn budget."""
    cfg = load_config(ROOT / "configs" / config)
    tok = load_tokenizer(cfg.model)
    for tag in ("<tool_call>", "</tool_call>", "<answer>", "</answer>", "<|im_end|>"):
        assert len(tok.encode(tag, add_special_tokens=False)) == 1, tag
    demos = (ROOT / cfg.sft.demos_path).read_text().splitlines()  # type: ignore[operator]
    longest = max(len(tok.encode(a, add_special_tokens=False)) for line in demos for a in json.loads(line)["actions"])
    assert longest <= cfg.rollout.max_new_tokens_per_turn


@pytest.mark.parametrize("config", ENV_CONFIGS)
def test_env_config_builds_token_mode_envs_and_demos_replay(config: str) -> None:
    cfg = load_config(ROOT / "configs" / config)
    tok = load_tokenizer(cfg.model)
    venv = make_envs(cfg, tok, "train", 2)
    env = venv.envs[0]
    assert env.token_mode and len(env.tasks) >= 300
    from rlf_envs import runtime
    from rlf_train.sft import demo_trajectories, load_demos

    demos = [d for d in load_demos(ROOT / cfg.sft.demos_path) if len(d.actions) == 2][:5]  # type: ignore[operator]
    trajs = runtime.run(demo_trajectories(env, demos, tok))
    assert all(t.reward == 1.0 for t in trajs)  # the scripted run-the-gold-query/program demos are verified correct
    assert all(len(t.token_ids or []) <= cfg.rollout.max_total_tokens for t in trajs)
    venv.close()


def test_null_split_is_not_passed_to_the_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    cfg = load_config(ROOT / "configs" / "mcp_example.yaml")
    assert cfg.env.train_split is None
    cfg_split = load_config(ROOT / "configs" / "mcp_example.yaml", ["env.train_split=train"])
    tok = load_tokenizer(cfg.model)
    # Tools-v0 takes no split (its tasks come from kwargs.tasks): its parameters are known (through **kwargs to
    # ToolEnv), so a split, the default 'train' included, is not passed to it (make_env's documented rule)
    for c in (cfg, cfg_split):
        venv = make_envs(c, tok, "train", 2)
        assert [s.name for s in venv.envs[0].toolbox.specs] == ["convert_time"]


def _train(config: str, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    cmd = [sys.executable, "-m", "rlf_train", "--config", config, "--set", f"logging.run_dir={run_dir}",
           "--set", "logging.progress=false", *[a for o in overrides for a in ("--set", o)]]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


@pytest.mark.slow
def test_mcp_example_trains_from_yaml_alone(tmp_path: Path) -> None:
    """`python -m rlf_train --config configs/mcp_example.yaml`, shortened: SFT demos replayed through the real
    server score 1.0 (server + tasks + reward YAML all wired), GRPO steps run, no server process is left."""
    import psutil

    before = {p.pid for p in psutil.process_iter()}
    out = _train("configs/mcp_example.yaml", tmp_path / "run", "sft.steps=3", "algorithm.steps=1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "demo success 1.00" in out.stdout
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["stage"] == "rl"] == [1]
    assert (tmp_path / "run" / "eval.json").is_file()
    left = [p for p in psutil.process_iter(["pid", "cmdline"]) if p.pid not in before
            and "mcp-server-time" in " ".join(p.info["cmdline"] or [])]
    assert left == []


@pytest.mark.slow
@pytest.mark.parametrize("config", ENV_CONFIGS)
def test_env_quickstart_runs_a_few_steps(config: str, tmp_path: Path) -> None:
    out = _train(f"configs/{config}", tmp_path / "run", "sft.steps=5", "algorithm.steps=1",
                 "eval.num_tasks=8", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "demo success" in out.stdout
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["stage"] == "rl"] == [1]
