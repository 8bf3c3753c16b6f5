"""Offline eval of an agent run (issue 42, item 2): `python -m rlf_train.eval --config <agent run>/config.yaml`
evaluates through the agent (its code against the policy endpoint, as the training's evals do), not the
env-driven policy, and the result carries the agent's counters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from repo_paths import SUPPORT

from rlf_train.config import dump_config
from rlf_train.eval import main
from tests.train.rollout.agents.test_agent_train import agent_cfg

HERE = SUPPORT


def test_offline_eval_of_an_agent_run_goes_through_the_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    cfg = tmp_path / "config.yaml"
    cfg.write_text(dump_config(agent_cfg(tmp_path / "run", ["eval.sampled=true", "eval.num_tasks=3"])))
    out = tmp_path / "eval.json"
    assert main(["--config", str(cfg), "--json", str(out), "--trajectories", "3"]) == 0
    res = json.loads(out.read_text())
    assert res["agent"].endswith("agent_train_envs.py:two_calls")
    for mode in ("greedy", "sampled"):
        st = res[mode]
        # two_calls asks twice per episode; odd tasks break their history (a second segment): 3 tasks -> 4 rows
        assert st["agent_calls_mean"] == 2.0 and st["agent_breaks"] == 1.0 and st["agent_errors"] == 0.0
        assert st["agent_segments_mean"] == pytest.approx(4 / 3)
    rows = [json.loads(x) for x in (tmp_path / "run" / "trajectories" / "step_0.jsonl").read_text().splitlines()]
    assert {r["source"] for r in rows} == {"offline_eval_greedy", "offline_eval_sampled"}
    assert rows and all("<|im_start|>user\nName item" in r["prompt"] for r in rows)  # the agent's messages
