"""verifiers (v1) environments trained through rlf's trainer unchanged (`rollout.environment: verifiers:<id>`,
rlf_train.rollout.foreign.verifiers): the environment's own harness and tool servers make the episodes against rlf's
policy endpoint, its rubric scores them. The envs are written in verifiers' own API (tests/support/foreign_vf_*.py:
the quickstart's search task with an MCP `Toolset` and an in-process harness; a single-turn taskset run by verifiers'
shipped `null` harness, its chat program). Run by `tox -e adapters`."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verifiers.v1")
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
    search_oracle,
)

from rlf_train.config import ConfigError
from rlf_train.rollout.foreign import forget_backends
from rlf_train.rollout.foreign.source import ForeignInfraFailed
from rlf_train.trainer import Trainer

SEARCH = "verifiers:foreign_vf_search"
PARITY = "verifiers:foreign_vf_parity"


@pytest.fixture(autouse=True)
def process_env() -> Any:
    with foreign_process_env():
        yield
    forget_backends()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_search_env_trains_with_its_mcp_tool_and_its_rubric(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            mode: str) -> None:
    """Multi-turn with tools: the env's harness asks rlf's endpoint, calls its own MCP `search` server (started by
    verifiers), and its `@vf.reward` functions score the answer. The policy is scripted (it searches, then answers
    right for some entities only): the rewards are the rubric's, the rows token-exact, the records show the tool
    calls and what the tool returned. Sync, and `rollout.mode: async` (the agent worker, group by group)."""
    run = tmp_path / "run"
    tr = Trainer(foreign_cfg(run, SEARCH, "env.kwargs.options={taskset: {num_tasks: 8}, agent: {harness: {id: "
                                          "foreign_vf_search, max_tokens: 96}}}", "rollout.max_new_tokens_per_turn=96",
                             *(("rollout.mode=async", "rollout.async_worker=thread") if mode == "async" else ())))
    assert len(tr.train_tasks) == 8 and tr.train_tasks[0].id == "train-00000"
    assert tr.eval_envs().envs[0].tasks[0].id == "test-00000", "eval is the taskset's test split"
    right = lambda entity: len(entity) % 2 == 0  # noqa: E731
    engine = script_policy(tr, monkeypatch, search_oracle(right))
    seen = keep_updates(tr, monkeypatch)
    counted: list[int] = []

    def count() -> None:  # the upstream clients the interception keeps for episodes still running
        counted.extend(len(s.clients) for e in tr.source.backends["train"].envs.values()
                       for s in e._interception.servers)

    # sync: between batches no episode runs. Async: the worker runs the next groups while the learner updates, so
    # the quiet point is the run's end, once the worker stopped (its episodes in flight are cancelled then)
    where, name = (tr, "update") if mode == "sync" else (tr.source, "close")
    kept = getattr(where, name)
    monkeypatch.setattr(where, name, lambda *a, **k: (count(), kept(*a, **k))[1])
    tr.run()
    assert len(seen) == 2 and counted and set(counted) == {0}
    for s in seen:
        eps = s["episodes"]
        assert eps is not None and len(eps.rewards) == P * G and eps.episode_of_row == list(range(P * G))
        for row, e in zip(s["trajs"], eps.episode_of_row, strict=True):
            entity = row.task.question.split(" of ")[-1].rstrip("?\n")
            assert row.reward == eps.rewards[e] == float(right(entity)), "the rubric's exact_match, weight 1"
            assert row.score_info == {"foreign/exact_match": float(right(entity)), "foreign/answered": 1.0}
            assert row.infra_error is None and len(row.turns) == 2
            call, answer = row.turns
            assert [c.name for c in call.action.calls] == ["search"] and call.action.calls[0].arguments == {
                "query": entity}
            assert call.results[0].content.startswith(f'Doc 1(Title: "{entity}")'), "the env's tool answered"
            # token-exact: the row is the engine's last context + its reply; the first reply is inside it
            ids, mask = row.token_ids, row.loss_mask
            distinct = {(tuple(c), tuple(out)) for c, _, out in engine.calls}  # (the G episodes are alike)
            gen = sorted(((list(c), list(out)) for c, out in distinct if ids[:len(c) + len(out)] == [*c, *out]),
                         key=lambda g: len(g[0]))
            assert len(gen) == 2 and ids == gen[-1][0] + gen[-1][1]
            assert [t for t, m in zip(ids, mask, strict=True) if m] == gen[0][1] + gen[1][1]
    rl = [m for m in metrics(run) if m["stage"] == "rl"]
    assert len(rl) == 2 and all(m["foreign/searches_mean"] == 1.0 and m["foreign_infra_failed"] == 0 for m in rl)
    assert all("foreign/exact_match_mean" in m and m["agent_breaks"] == 0 for m in rl)
    rec = records(run, 1)
    turn = rec[0]["turns"][0]
    assert turn["tool_calls"][0]["name"] == "search" and "Doc 1(Title:" in turn["results"][0]["content"]
    assert "<tool_response>" in turn["observation"] and "foreign/exact_match" in rec[0]["score_info"]
    assert leftover_children() == [], "the tool server and the interception server are closed with the run"


def chat_program_ready() -> bool:
    """verifiers' shipped harnesses run a chat program it builds with `uv sync --script` (packages from PyPI)."""
    if shutil.which("uv") is None:
        return False
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "chat.py"
        script.write_text(CHAT_PROGRAM_SOURCE)
        r = subprocess.run(["uv", "sync", "--script", str(script), "-q", "--no-config"], capture_output=True,
                           timeout=300, cwd=d)
    return r.returncode == 0


def test_shipped_null_harness_trains_the_tiny_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verifiers' own `null` harness (its chat program, a process per episode, streaming) against rlf's endpoint,
    generating with the real tiny policy: the reward is the rubric's weighted sum of its two functions, computed from
    what the policy wrote; the rows are the chat template's prompt + the generated tokens."""
    if not chat_program_ready():
        pytest.skip("verifiers' chat program needs uv (pip install uv) and PyPI to build its environment")
    run = tmp_path / "run"
    tr = Trainer(foreign_cfg(run, PARITY, "env.kwargs.options={agent: {harness: {id: 'null'}}}"))
    seen = keep_updates(tr, monkeypatch)
    tr.run()
    assert len(seen) == 2
    for s in seen:
        eps = s["episodes"]
        for row, e in zip(s["trajs"], eps.episode_of_row, strict=True):
            sc = row.score_info
            assert set(sc) == {"foreign/correct", "foreign/brevity"}
            assert math.isclose(row.reward, sc["foreign/correct"] + 0.1 * sc["foreign/brevity"], abs_tol=1e-9)
            assert eps.rewards[e] == row.reward
            words = len(row.turns[0].action.text.split())
            assert math.isclose(sc["foreign/brevity"], 1.0 / (1.0 + words)), "scored on what the policy wrote"
            n = row.task.question.split()[1]
            prompt = tr.tokenizer.decode(row.token_ids[:row.loss_mask.index(1)])
            assert prompt == f"<|im_start|>user\nIs {n} even or odd?<|im_end|>\n<|im_start|>assistant\n"
            assert sum(row.loss_mask) == len(row.turns[0].behaviour_logprobs) > 0
    assert leftover_children() == []


def test_shipped_null_harness_calls_the_envs_mcp_tool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The search env run by verifiers' `null` chat program instead of its own harness: the program discovers the
    env's MCP tool and calls it; one segment per episode, the reward the rubric's."""
    if not chat_program_ready():
        pytest.skip("verifiers' chat program needs uv (pip install uv) and PyPI to build its environment")
    run = tmp_path / "run"
    tr = Trainer(foreign_cfg(run, SEARCH, "env.kwargs.options={taskset: {num_tasks: 4}, agent: {harness: {id: "
                                          "'null'}}}", "rollout.max_new_tokens_per_turn=96", steps=1))
    script_policy(tr, monkeypatch, search_oracle(lambda entity: True))
    seen = keep_updates(tr, monkeypatch)
    tr.run()
    eps = seen[0]["episodes"]
    assert eps.rewards == [1.0] * (P * G) and eps.episode_of_row == list(range(P * G))
    for row in seen[0]["trajs"]:
        assert [c.name for t in row.turns for c in t.action.calls] == ["search"]
        assert row.turns[0].results[0].content.startswith("Doc 1(Title:")
    assert leftover_children() == []


def test_scorer_failures_are_infrastructure_failures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reward function that raises on some tasks: those episodes carry the error (`infra_error`), their GRPO groups
    leave the loss and are counted; the other groups train."""
    run = tmp_path / "run"
    tr = Trainer(foreign_cfg(run, PARITY, "env.kwargs.options={taskset: {task: {fail: odd}}}", "eval.before_rl=false"))
    seen = keep_updates(tr, monkeypatch)
    monkeypatch.setattr(tr, "_next_tasks", lambda k: [0, 1])  # one even task (scores), one odd (raises)
    tr.run()
    for s in seen:
        kept = {tr.train_tasks[s["tasks"][e]].id for e in s["episodes"].episode_of_row}
        assert kept == {"train-0"}, "the odd task's group is dropped"
        assert all(t.infra_error is None for t in s["trajs"])
    rl = [m for m in metrics(run) if m["stage"] == "rl"]
    assert all(m["foreign_infra_failed"] == G and m["foreign_dropped_groups"] == 1 for m in rl)
    ev = [m for m in metrics(run) if m["stage"] == "eval"]
    assert ev, "the run went on to its eval"


@pytest.mark.parametrize("fail, says", [("raise", "the scorer's judge is unreachable"), ("nan", "nan")])
def test_a_scorer_that_always_fails_stops_the_run(tmp_path: Path, fail: str, says: str) -> None:
    """Every group failed by the scorer: a clear error naming it, not a run trained on zeros."""
    tr = Trainer(foreign_cfg(tmp_path / "run", PARITY, f"env.kwargs.options={{taskset: {{task: {{fail: {fail}}}}}}}",
                             "eval.before_rl=false", steps=1))
    with pytest.raises(ForeignInfraFailed, match="every GRPO group") as e:
        tr.run()
    assert "infrastructure" in str(e.value) and says in str(e.value)
    assert tr.source.foreign_totals["train"].infra_failed == P * G
    assert leftover_children() == []


def test_bad_input_is_a_config_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlf_train.rollout.env_factory import make_env

    def make(spec: str, *extra: str) -> Any:
        cfg = foreign_cfg(tmp_path / "run", spec, *extra)
        return make_env(cfg, None, "train")

    with pytest.raises(ConfigError, match="taskset 'no_such_env_xyz' not found"):
        make("verifiers:no_such_env_xyz")
    (tmp_path / "needs_missing_pkg.py").write_text("import a_package_nobody_installed_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="a package it needs is missing.*a_package_nobody_installed_xyz"):
        make("verifiers:needs_missing_pkg")
    with pytest.raises(ConfigError, match="do not fit its config"):
        make(SEARCH, "env.kwargs.options={taskset: {no_such_option: 1}}")
    with pytest.raises(ConfigError, match="unknown ecosystem 'gymnasium'"):
        make("gymnasium:CartPole-v1")
    monkeypatch.delenv("RLF_NEMO_GYM_PYTHON", raising=False)  # (no NeMo-Gym interpreter named: said how to name one)
    with pytest.raises(ConfigError, match="NeMo-Gym runs in a Python >= 3.12 of its own and none is named"):
        make("nemo_gym:config.yaml")
    # verifiers itself missing: the error names the install line
    forget_backends()
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ConfigError, match=r"pip install --no-deps verifiers==0\.4\.0"):
        make(PARITY)
    with pytest.raises(ValueError, match="leave env.id unset"):
        foreign_cfg(tmp_path / "run", PARITY, "env.id=rlf/Search-v0")
    with pytest.raises(ValueError, match="give one of them"):
        foreign_cfg(tmp_path / "run", PARITY, "rollout.agent=x:y")
