"""NeMo-Gym environments trained through rlf's trainer unchanged (`rollout.environment: nemo_gym:<config>`,
rlf_train.rollout.foreign.nemo_gym): rlf starts NeMo-Gym's own servers (its RunHelper: head server, the config's
resources and agent servers, NeMo-Gym's vllm_model as the policy's model server) in the NeMo-Gym interpreter
($RLF_NEMO_GYM_PYTHON, Python 3.12), posts each episode's dataset row to the agent's `/run`, and trains on `/verify`'s
reward. Environments: two NeMo-Gym ships (example_tool_call_multireward, example_single_tool_call) with their own
example data, and a multi-turn one written in NeMo-Gym's API (tests/support/nemo_gym_project: rlf_lookup). Run by
`tox -e foreign-nemo`, which builds that interpreter (tests/support/nemo_gym_venv.py)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("rlf_train")

from foreign_support import G, P, foreign_cfg, keep_updates, leftover_children, metrics, records, script_policy
from repo_paths import SUPPORT

from rlf_train.config import ConfigError
from rlf_train.rollout.foreign import forget_backends
from rlf_train.rollout.foreign.source import ForeignInfraFailed, ForeignStartFailed
from rlf_train.trainer import Trainer

NEMO_PY = os.environ.get("RLF_NEMO_GYM_PYTHON", "")


def _skip_reason() -> str | None:
    if NEMO_PY and os.path.isfile(NEMO_PY):
        return None
    why = Path(str(Path(NEMO_PY).parents[1]) + ".skip") if NEMO_PY else None
    said = why.read_text().strip() if why is not None and why.is_file() else "RLF_NEMO_GYM_PYTHON names no interpreter"
    return f"needs a NeMo-Gym interpreter (Python >= 3.12 with nemo-gym; tox -e foreign-nemo builds it): {said}"


if (_reason := _skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

PROJECT = SUPPORT / "nemo_gym_project" / "resources_servers"
LOOKUP = f"nemo_gym:{PROJECT / 'rlf_lookup' / 'configs' / 'rlf_lookup.yaml'}"
BROKEN = f"nemo_gym:{PROJECT / 'rlf_broken' / 'configs' / 'rlf_broken.yaml'}"
PETS = ["dog", "cat", "fish", "owl", "frog"]


@pytest.fixture(autouse=True)
def _forget() -> Any:
    yield
    forget_backends()


def call(name: str, **args: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call><|im_end|>"


def nothing_left(leftovers: Any) -> None:
    """No child of this process, and no process of the NeMo-Gym venv (its servers, Ray's gcs_server and raylet)."""
    assert leftover_children() == []
    assert leftovers(str(Path(NEMO_PY).parents[1])) == []


def test_lookup_env_multi_turn_tools_verify_rewards_and_splits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              qwen3_template_tokenizer: Any, leftovers: Any) -> None:
    """The multi-turn env in NeMo-Gym's API, run by NeMo-Gym's simple_agent: the policy searches (a tool call the agent
    sends to the resources server), reads the result, answers; `/verify` rewards a right answer after a search. Train
    and eval are the config's train / validation datasets; the eval's rows whose `/verify` raises, returns NaN or a
    reward that is not a number are infrastructure failures (dropped, counted), one that loops on its tool runs into
    rlf's agent_max_calls (the policy's: counted, unscored)."""
    right = lambda person: int(person[6:]) % 2 == 0  # noqa: E731

    def policy(ctx: str) -> str:
        person = re.findall(r"pet of (Person\d\d)", ctx)[-1]
        if person == "Person25" or "<tool_response>" not in ctx:  # Person25: searches again and again
            return call("search", query=person)
        return (PETS[int(person[6:]) % 5] if right(person) else "nothing") + "<|im_end|>"

    run = tmp_path / "run"
    tr = Trainer(foreign_cfg(run, LOOKUP, "rollout.max_new_tokens_per_turn=48", "rollout.agent_max_calls=3",
                             "eval.num_tasks=6"))
    assert [t.id for t in tr.train_tasks] == [f"train-{i}" for i in range(8)]
    assert [t.id for t in tr.eval_envs().envs[0].tasks] == [f"test-{i}" for i in range(20, 26)], \
        "env.eval_split 'test' is the config's validation dataset"
    script_policy(tr, monkeypatch, policy)
    seen = keep_updates(tr, monkeypatch)
    tr.run()
    assert len(seen) == 2
    for s in seen:
        eps = s["episodes"]
        assert eps.episode_of_row == list(range(P * G)), "one segment per episode: the history was extended exactly"
        for row, e in zip(s["trajs"], eps.episode_of_row, strict=True):
            person = re.findall(r"pet of (Person\d\d)", row.prompt)[-1]
            assert row.reward == eps.rewards[e] == float(right(person)), "/verify's reward"
            assert row.score_info == {"foreign/searches": 1.0, "foreign/answered_right": float(right(person))}
            assert [c.name for t in row.turns for c in t.action.calls] == ["search"]
            pet = PETS[int(person[6:]) % 5]
            assert json.loads(row.turns[0].results[0].content) == {"result": f"{person}: pet {pet}."}, \
                "the resources server's answer, as NeMo-Gym's agent sent it back"
            assert sum(row.loss_mask) == sum(len(t.behaviour_logprobs) for t in row.turns) > 0
            # the prompt is the chat template's: the row's developer message (as system), its tool, its question
            prompt = tr.tokenizer.decode(row.token_ids[:row.loss_mask.index(1)])
            # the row's tool as NeMo-Gym's vllm_model sends it (its chat-completions tool type: `function` first)
            tool = {"function": {"name": "search", "description": "Look a person up: their pet.",
                                 "parameters": {"type": "object", "properties": {"query": {
                                     "type": "string", "description": "the person"}},
                                     "required": ["query"], "additionalProperties": False}}, "type": "function"}
            want = qwen3_template_tokenizer.apply_chat_template(
                [{"role": "system", "content": "Use the search tool, then answer with one word."},
                 {"role": "user", "content": f"What is the pet of {person}?"}], tools=[tool], tokenize=False,
                add_generation_prompt=True)
            assert prompt == want
    rl = [m for m in metrics(run) if m["stage"] == "rl"]
    assert all(m["foreign_infra_failed"] == 0 and m["foreign/tool_calls_mean"] == 1.0 for m in rl)
    evals = json.loads((run / "eval.json").read_text())["evals"]
    assert len(evals) == 2
    for ev in evals:  # the raise / nan / string rows; the looping one ran into agent_max_calls (its 4th call)
        m = ev["greedy"]
        assert m["foreign_infra_failed"] == 3 and m["foreign_budget_exceeded"] == 1
        assert m["foreign/searches_mean"] == (1 + 1 + 3) / 3, "the looping episode was still scored: 3 searches"
    kinds = tr.source.foreign_totals["eval"].kinds
    said = " ".join(kinds)
    assert "the lookup verifier's table is unreachable" in said, "/verify raised: its error, as the agent said it"
    assert "reward" in said and sum(kinds.values()) == 6
    rec = records(run, 1)[0]
    assert [c["name"] for c in rec["turns"][0]["tool_calls"]] == ["search"]
    assert "pet" in rec["turns"][0]["results"][0]["content"]
    nothing_left(leftovers)


def test_shipped_multireward_env_scores_every_component(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        leftovers: Any) -> None:
    """NeMo-Gym's example_tool_call_multireward, named by its resources server, on its own example data (its only
    dataset: train and eval both): the reward is `/verify`'s sum of correctness, schema_valid and format, each kept
    as a score. The agent sends the call to the resources server (which has no such endpoint: its answer is the
    404, as in NeMo-Gym's own example rollouts), the policy then writes text, so format is 0."""
    cities = {"San Francisco", "New York", "Seattle", "London", "Paris", "Tokyo", "Chicago", "Boston", "Austin"}

    def policy(ctx: str) -> str:
        if "<tool_response>" in ctx:
            return "Done.<|im_end|>"
        q = ctx.rsplit("<|im_start|>user\n", 1)[-1]
        city = next((c for c in cities if c in q), "Nowhere")
        if "London" in q:  # no call at all: nothing to score
            return "I cannot tell.<|im_end|>"
        return call("get_weather", city=city if "New York" not in q else "Newark")

    run = tmp_path / "run"
    tr = Trainer(foreign_cfg(run, "nemo_gym:example_tool_call_multireward", "rollout.max_new_tokens_per_turn=96",
                             "eval.num_tasks=5"))
    assert len(tr.train_tasks) == 5
    engine = script_policy(tr, monkeypatch, policy)
    seen = keep_updates(tr, monkeypatch)
    tr.run()
    for s in seen:
        for row in s["trajs"]:
            q = row.task.question
            sc = {k.removeprefix("foreign/"): v for k, v in row.score_info.items()}
            assert set(sc) == {"correctness", "schema_valid", "format"}
            assert row.reward == sc["correctness"] + sc["schema_valid"] + sc["format"]
            if "London" in q:
                assert row.reward == 0.0 and not row.turns[0].action.calls
            elif "New York" in q:
                assert sc == {"correctness": 0.0, "schema_valid": 1.0, "format": 0.0}
            else:
                assert sc == {"correctness": 1.0, "schema_valid": 1.0, "format": 0.0}
                assert json.loads(row.turns[0].results[0].content) == {"detail": "Not Found"}
    for ev in json.loads((run / "eval.json").read_text())["evals"]:  # the 5 rows: SF, New York, Seattle, London, Tokyo
        m = ev["greedy"]
        assert m["foreign_infra_failed"] == 0 and m["reward_mean"] == pytest.approx((2 + 1 + 2 + 0 + 2) / 5)
        assert (m["foreign/correctness_mean"], m["foreign/schema_valid_mean"], m["foreign/format_mean"]) == \
            pytest.approx((3 / 5, 4 / 5, 0.0))
    assert engine.calls, "the scripted policy answered the model server's requests"
    nothing_left(leftovers)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_shipped_single_tool_call_env_trains_the_tiny_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             leftovers: Any, mode: str) -> None:
    """NeMo-Gym's example_single_tool_call with the real tiny policy generating: its `/verify` gives 1.0 to every
    rollout, and every row carries it (an unscored episode would be 0); the rows are the engine's exact tokens.
    `rollout.mode: async` too: the agent worker's copy of the policy generates, group by group, ahead of the
    learner."""
    run = tmp_path / "run"
    tr = Trainer(foreign_cfg(run, "nemo_gym:example_single_tool_call", "rollout.max_new_tokens_per_turn=16",
                             *(("rollout.mode=async", "rollout.async_worker=thread") if mode == "async" else ())))
    seen = keep_updates(tr, monkeypatch)
    tr.run()
    assert len(seen) == 2
    for s in seen:
        eps = s["episodes"]
        assert eps.rewards == [1.0] * (P * G)
        for row in s["trajs"]:
            assert row.reward == 1.0 and row.infra_error is None
            assert sum(row.loss_mask) == sum(len(t.behaviour_logprobs) for t in row.turns) > 0
            prompt = tr.tokenizer.decode(row.token_ids[:row.loss_mask.index(1)])
            assert prompt.startswith("<|im_start|>system\nYou are a helpful personal assistant")
            assert "get_weather" in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert all(m["grad_norm"] >= 0 for m in metrics(run) if m["stage"] == "rl")
    nothing_left(leftovers)


def test_a_server_that_dies_mid_episode_is_an_infrastructure_failure(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     leftovers: Any) -> None:
    """The policy calls the lookup server's `crash` tool: the server exits mid-episode, NeMo-Gym's servers stop (as
    ng_run stops them), every episode is the host's failure: the run stops saying so, nothing left running."""
    tr = Trainer(foreign_cfg(tmp_path / "run", LOOKUP, "rollout.max_new_tokens_per_turn=48", "eval.before_rl=false",
                             steps=1))
    script_policy(tr, monkeypatch, lambda ctx: call("crash") if "<tool_response>" not in ctx else "x<|im_end|>")
    with pytest.raises(ForeignInfraFailed, match="every GRPO group") as e:
        tr.run()
    assert "the server rlf_lookup stopped, so NeMo-Gym's servers stopped" in str(e.value)
    assert tr.source.foreign_totals["train"].infra_failed == P * G
    nothing_left(leftovers)


def test_a_server_that_does_not_start_is_an_error_with_its_log(tmp_path: Path, leftovers: Any) -> None:
    tr = Trainer(foreign_cfg(tmp_path / "run", BROKEN, "eval.before_rl=false", steps=1))
    with pytest.raises(ForeignStartFailed, match="did not start") as e:
        tr.run()
    assert "rlf_broken fails at start on purpose" in str(e.value), "the server's own error, from its log"
    nothing_left(leftovers)


def test_bad_input_is_a_config_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlf_train.rollout.env_factory import make_env

    def make(spec: str, *extra: str) -> Any:
        forget_backends()
        return make_env(foreign_cfg(tmp_path / "run", spec, *extra), None, "train")

    with pytest.raises(ConfigError, match="no resources server named 'example_single_tool_cal'.*did you mean "
                                          "example_single_tool_call"):
        make("nemo_gym:example_single_tool_cal")
    with pytest.raises(ConfigError, match="no_such_dir/x.yaml' was not found"):
        make("nemo_gym:no_such_dir/x.yaml")
    with pytest.raises(ConfigError, match="not options of the nemo_gym ecosystem"):
        make(LOOKUP, "env.kwargs.options={nope: 1}")
    with pytest.raises(ConfigError, match="options.agent 'nobody'.*rlf_lookup_simple_agent"):
        make(LOOKUP, "env.kwargs.options={agent: nobody}")
    with pytest.raises(ConfigError, match="dataset .*missing.jsonl is not there"):
        make(LOOKUP, f"env.kwargs.options={{datasets: {{train: {tmp_path / 'missing.jsonl'}}}}}")
    # the interpreter: none named, not there, too old, without nemo-gym: each says how to get one
    monkeypatch.delenv("RLF_NEMO_GYM_PYTHON")
    with pytest.raises(ConfigError, match=r"none is named.*pip install --no-deps nemo-gym==0\.4\.0"):
        make(LOOKUP)
    with pytest.raises(ConfigError, match="is not an executable file"):
        make(LOOKUP, f"env.kwargs.options={{python: {tmp_path / 'python9'}}}")
    with pytest.raises(ConfigError, match=r"is Python 3\.11.*needs >= 3\.12"):
        make(LOOKUP, f"env.kwargs.options={{python: {sys.executable}}}")
    cfg = (Path(NEMO_PY).parents[1] / "pyvenv.cfg").read_text()
    base = next(line.split("=", 1)[1].strip() for line in cfg.splitlines() if line.startswith("home"))
    bare = next((str(p) for p in sorted(Path(base).glob("python3.1[2-9]"))), None)
    if bare is not None and "nemo" not in os.popen(f"{bare} -m pip list 2>/dev/null").read():
        with pytest.raises(ConfigError, match="has no nemo-gym installed"):
            make(LOOKUP, f"env.kwargs.options={{python: {bare}}}")
