"""OpenEnv environments trained through rlf's trainer unchanged (`rollout.environment: openenv:<server>`,
rlf_train.rollout.foreign.openenv): rlf starts the environment's server as OpenEnv's docs say (uvicorn on its app),
steps it over OpenEnv's WebSocket client with the policy's replies, and trains on its per-step rewards. Two real
environments: the echo environment `openenv init` scaffolds (text actions, the real tiny policy) and an
`MCPEnvironment` with FastMCP tools (tests/support/foreign_openenv_lookup.py). Run by `tox -e adapters-rl`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openenv.core.env_server", reason="needs openenv-core (tox -e adapters-rl)")
pytest.importorskip("fastmcp")
pytest.importorskip("rlf_train")

from foreign_support import (
    G,
    P,
    foreign_cfg,
    foreign_process_env,
    keep_updates,
    leftover_children,
    metrics,
    records,
    script_policy,
)

from rlf_train.config import ConfigError
from rlf_train.rollout.agent_runner import NO_TOOL_MESSAGE
from rlf_train.rollout.foreign import forget_backends
from rlf_train.rollout.foreign.source import ForeignInfraFailed, ForeignStartFailed
from rlf_train.trainer import Trainer

LOOKUP = "openenv:foreign_openenv_lookup:app"
PETS = {f"Person{i:02d}": ["dog", "cat", "fish", "owl", "frog"][i % 5] for i in range(40)}


@pytest.fixture(autouse=True)
def process_env() -> Any:
    with foreign_process_env():
        yield
    forget_backends()


def call(name: str, **args: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call><|im_end|>"


def lookup_policy(right: Any) -> Any:
    """Searches the person, then answers (right for some people only)."""

    def script(ctx: str) -> str:
        person = re.findall(r"pet of (Person\d\d)", ctx)[-1]
        if "<tool_response>" not in ctx:
            return call("search", query=person)
        return call("answer", text=PETS[person] if right(person) else "nothing")

    return script


ASYNC = ("rollout.mode=async", "rollout.async_worker=thread")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_mcp_env_trains_with_its_tools_and_step_rewards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        mode: str) -> None:
    """Sync, and `rollout.mode: async` (the agent worker runs the foreign episodes ahead of the learner, group by
    group, on a copy of the policy): the same rows, rewards, records."""
    run = tmp_path / "run"
    tr = Trainer(foreign_cfg(run, LOOKUP, "rollout.max_new_tokens_per_turn=64", *(ASYNC if mode == "async" else ())))
    assert tr.train_tasks[0].id == "train-seed0" and tr.eval_envs().envs[0].tasks[0].id == "test-seed1000000"
    right = lambda person: int(person[-1]) % 2 == 0  # noqa: E731
    script_policy(tr, monkeypatch, lookup_policy(right))
    seen = keep_updates(tr, monkeypatch)
    tr.run()
    assert tr.source.backends["train"].mode == "tools", "detected: the server answers list_tools"
    assert (type(tr.async_worker).__name__ if tr.async_worker else None) == ("AgentWorker" if mode == "async"
                                                                             else None)
    assert len(seen) == 2
    for s in seen:
        eps = s["episodes"]
        assert eps.episode_of_row == list(range(P * G)), "one segment per episode"
        group_seeds = [tr.train_tasks[s["tasks"][e]].meta["seed"] for e in range(P * G)]
        assert group_seeds[0::G] == group_seeds[1::G]
        for row, e in zip(s["trajs"], eps.episode_of_row, strict=True):
            person = re.findall(r"pet of (Person\d\d)", row.prompt)[-1]
            assert row.reward == eps.rewards[e] == float(right(person)), "the env's reward of the answer step"
            assert row.score_info == {"foreign/reward_last": row.reward, "foreign/reward_sum": row.reward}
            names = [c.name for t in row.turns for c in t.action.calls]
            assert names == ["search", "answer"]
            assert row.turns[0].results[0].content == f"{person}: pet {PETS[person]}.", "the env's tool answered"
            # the answer step ended the episode: its observation never went back to the policy, and says so
            assert row.turns[1].results[0].content == NO_TOOL_MESSAGE
            assert sum(row.loss_mask) == sum(len(t.behaviour_logprobs) for t in row.turns)
    rl = [m for m in metrics(run) if m["stage"] == "rl"]
    assert len(rl) == 2 and all(m["foreign/steps_mean"] == 2.0 and m["foreign/done_mean"] == 1.0 for m in rl)
    assert all(m["foreign_infra_failed"] == 0.0 and m["agent_errors"] == 0.0 for m in rl), rl
    rec = records(run, 1)[0]
    assert [c["name"] for c in rec["turns"][0]["tool_calls"]] == ["search"]
    assert "pet" in rec["turns"][0]["results"][0]["content"]
    assert leftover_children() == [], "the env server rlf started is stopped with the run"


def test_openenv_init_template_trains_the_tiny_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The echo environment OpenEnv's CLI scaffolds (`openenv init`), served from its directory by its openenv.yaml,
    one session at a time as the template allows (max_concurrent_envs=1: rlf waits for a slot); text actions from
    the real tiny policy; the reward is the env's (0.1 per character of the last message)."""
    r = subprocess.run([str(Path(sys.executable).parent / "openenv"), "init", "echo_env", "-o", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    run = tmp_path / "run"
    tr = Trainer(foreign_cfg(run, f"openenv:{tmp_path / 'echo_env'}", "rollout.max_turns=2",
                             "rollout.max_new_tokens_per_turn=8"))
    seen = keep_updates(tr, monkeypatch)
    tr.run()
    assert tr.source.backends["train"].mode == "text"
    for s in seen:
        eps = s["episodes"]
        for row, e in zip(s["trajs"], eps.episode_of_row, strict=True):
            assert len(row.turns) == 2, "two steps (the echo env never ends an episode)"
            last = row.turns[-1].action.text
            assert row.reward == pytest.approx(0.1 * len(last)) and eps.rewards[e] == row.reward
            # the env's observation (its echo) is the next user turn the policy saw
            assert row.turns[0].action.text in row.turns[0].observation
    assert leftover_children() == []


def test_the_eval_command_runs_the_foreign_environment(tmp_path: Path) -> None:
    """`python -m rlf_train.eval` on a `rollout.environment` config: the foreign env's own episodes on its eval split
    (OpenEnv: reset seeds from 1,000,000), scored by it, greedy and sampled, episodes recorded for the viewer, its
    server stopped afterwards."""
    from rlf_train.eval import main as eval_main

    run = tmp_path / "run"
    cfg_file = tmp_path / "cfg.yaml"
    cfg = foreign_cfg(run, LOOKUP, "rollout.max_new_tokens_per_turn=16", "eval.sampled=true", "eval.num_tasks=3")
    cfg_file.write_text(json.dumps(cfg.model_dump(mode="json", exclude_unset=True)))
    out = tmp_path / "eval.json"
    assert eval_main(["--config", str(cfg_file), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["environment"] == LOOKUP and res["num_tasks"] == 3
    for mode in ("greedy", "sampled"):
        st = res[mode]
        assert 0.0 <= st["reward_mean"] <= 1.0 and st["turns_mean"] >= 1, st
        assert st["foreign_infra_failed"] == 0 and "foreign/steps_mean" in st, st
    recs = [json.loads(line) for line in (run / "trajectories" / "step_0.jsonl").read_text().splitlines()]
    assert sorted(r["source"] for r in recs) == ["offline_eval_greedy"] * 3 + ["offline_eval_sampled"] * 3
    assert all(r["task"]["id"].startswith("test-seed100000") for r in recs), [r["task"]["id"] for r in recs]
    assert leftover_children() == []


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_server_that_dies_mid_episode_is_an_infrastructure_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     mode: str) -> None:
    tr = Trainer(foreign_cfg(tmp_path / "run", LOOKUP, "rollout.max_new_tokens_per_turn=64", "eval.before_rl=false",
                             *(ASYNC if mode == "async" else ()), steps=1))
    policy = lookup_policy(lambda p: True)

    def dying(ctx: str) -> str:
        backend = tr.source.backends["train"]
        if backend.proc is not None and "<tool_response>" in ctx:
            backend._kill()  # the server goes away while the episodes are in their second turn
        return policy(ctx)

    script_policy(tr, monkeypatch, dying)
    with pytest.raises(ForeignInfraFailed, match="every GRPO group") as e:
        tr.run()
    assert "openenv" in str(e.value)
    assert tr.source.foreign_totals["train"].infra_failed == P * G
    assert leftover_children() == []


def test_bad_input(tmp_path: Path) -> None:
    from rlf_train.rollout.env_factory import make_env

    with pytest.raises(ConfigError, match="no openenv.yaml"):
        make_env(foreign_cfg(tmp_path / "r", f"openenv:{tmp_path}"), None, "train")
    with pytest.raises(ConfigError, match="not options of the openenv ecosystem"):
        make_env(foreign_cfg(tmp_path / "r", LOOKUP, "env.kwargs.options={nope: 1}"), None, "train")
    tr = Trainer(foreign_cfg(tmp_path / "run", "openenv:no_such_module_xyz:app", "eval.before_rl=false", steps=1))
    with pytest.raises(ForeignStartFailed, match="exited with status .*no_such_module_xyz"):
        tr.run()
    assert leftover_children() == []
