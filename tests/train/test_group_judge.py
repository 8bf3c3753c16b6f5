"""The trainer's group_reward: a group judge on loopback scores each GRPO group; its scores are the training
reward, its cost is in metrics.jsonl and the stored episodes; a dead judge never aborts the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from repo_paths import REPO

from examples.group_judge.hidden_key_judge import HiddenKeyJudge, judge_server
from rlf_train.config import ConfigError, load_config
from rlf_train.trainer import Trainer
from tests.train.test_end_to_end import _cfg
from tests.train.test_end_to_end import tasks as tiny_tasks

SHORT = ["algorithm.kl_coef=0", "eval.before_rl=false", "logging.trajectories_every=1", "logging.trajectories=-1",
         "logging.save_every=0"]


def _rows(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["stage"] == "rl"]


def _train_records(run: Path) -> list[dict]:
    out = []
    for f in sorted((run / "trajectories").glob("step_*.jsonl")):
        out += [r for r in map(json.loads, f.read_text().splitlines()) if r["source"] == "train"]
    return out


def test_group_judge_gives_the_training_reward(tmp_path: Path) -> None:
    key = {t["question"]: t["answers"] for t in tiny_tasks("train")}
    judge = HiddenKeyJudge(key)
    with judge_server(judge) as url:
        cfg = _cfg(tmp_path / "r", 2, [*SHORT, f"group_reward={{type: group_judge, base_url: '{url}', model: j}}"])
        tr = Trainer(cfg)
        tr.run()
    rows = _rows(tmp_path / "r")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # two groups per step; a group of identical episodes needs no call
        assert r["group_judge/groups"] == 2 and r["group_judge/calls"] + r["group_judge/no_call_groups"] == 2
        assert r["group_judge/fallbacks"] == 0 and r["group_judge/violations"] == 0
        if r["group_judge/calls"]:
            assert r["group_judge/tokens_in"] > 0 and r["group_judge/tokens_out"] > 0
            assert r["group_judge/seconds_per_call"] > 0
            assert 0.0 <= r["group_judge/judged_reward_mean"] <= 1.0
        assert 0.0 <= r["group_judge/env_reward_mean"] <= 1.0
    assert judge.requests == sum(r["group_judge/calls"] for r in rows) and judge.unknown == 0
    recs = _train_records(tmp_path / "r")
    assert len(recs) == 16
    for rec in recs:
        info = rec["score_info"]
        assert "env_reward" in info and "group_judge/tokens_in" in info and "group_judge/seconds" in info
        assert rec["reward"] == info["group_judge"]
        if "group_judge/no_call" not in info:  # the hidden criterion's scores
            ok = rec["answer"] is not None and rec["answer"].strip() in key[rec["task"]["question"]]
            assert rec["reward"] == (1.0 if ok else 0.1 if rec["answer"] is not None else 0.0)


def test_a_dead_judge_skips_groups_and_training_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dead = "http://127.0.0.1:9/v1"  # discard port: connection refused
    cfg = _cfg(tmp_path / "d", 2, [*SHORT, f"group_reward={{type: group_judge, base_url: '{dead}', model: j, "
                                           "max_retries: 0, timeout_s: 5, fallback: 0.5}"])
    with pytest.raises(ConfigError, match="no OpenAI-compatible endpoint answers"):  # dead at the start: refused
        Trainer(cfg)
    # a judge that answered at the start and died later: its groups are skipped (2 steps, under the stop at 3)
    from rlf_train.group_reward import GroupReward

    monkeypatch.setattr(GroupReward, "check_endpoint", lambda self, timeout_s=10.0: None)
    Trainer(cfg).run()
    rows = _rows(tmp_path / "d")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["group_judge/fallbacks"] + r["group_judge/no_call_groups"] == 2
        assert r["groups_with_signal"] == 0.0 and r["reward_mean"] == 0.5  # skipped: zero advantage, no silent 0
    recs = _train_records(tmp_path / "d")
    assert recs and all(r["reward"] == 0.5 for r in recs)
    assert any(r["score_info"].get("group_judge/skipped") == 1.0 for r in recs)


def test_group_reward_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="group_reward"):
        Trainer(_cfg(tmp_path / "e", 1, [*SHORT, "group_reward={type: group_judge, model: j}"]))
    with pytest.raises(ConfigError, match="rollout.agent"):
        load_config(None, ["group_reward={type: group_judge, base_url: 'http://x/v1', model: j}",
                           "rollout.agent=examples/search_agent/agent.py:agent"])


def test_the_demo_config_is_the_quickstart_plus_a_group_reward() -> None:
    root = REPO
    base = load_config(root / "configs" / "quickstart.yaml").model_dump()
    demo = load_config(root / "configs" / "quickstart_group_judge.yaml").model_dump()
    assert demo.pop("group_reward")["type"] == "group_judge"
    assert demo.pop("name") == "quickstart_group_judge"
    base.pop("group_reward"), base.pop("name")
    assert demo == base  # a fair comparison with the verifier-trained quickstart


def test_group_judge_in_async_rl(tmp_path: Path) -> None:
    key = {t["question"]: t["answers"] for t in tiny_tasks("train")}
    judge = HiddenKeyJudge(key)
    with judge_server(judge) as url:
        cfg = _cfg(tmp_path / "a", 2, [*SHORT, "rollout.mode=async", "rollout.async_worker=thread",
                                       f"group_reward={{type: group_judge, base_url: '{url}', model: j}}"])
        Trainer(cfg).run()
    rows = _rows(tmp_path / "a")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["group_judge/groups"] == 2 and r["group_judge/fallbacks"] == 0 for r in rows)
    assert judge.requests == sum(r["group_judge/calls"] for r in rows)
    assert all("group_judge" in rec["score_info"] for rec in _train_records(tmp_path / "a"))
