"""Config/YAML building, validation errors, the registry, composition and presets."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Literal

import pytest
from repo_paths import REPO

from rlf_envs.rewards import (
    BuildContext,
    CallCount,
    Constant,
    ExactMatch,
    FormatCheck,
    Gate,
    GateConfig,
    Max,
    Min,
    ProcessReward,
    TokenF1,
    TurnRewardConfig,
    Verifier,
    VerifierConfig,
    VerifierConfigError,
    Weighted,
    WeightedConfig,
    build_verifier,
    load_verifier_yaml,
    parse_verifier_config,
    register_verifier,
    registered_types,
    rlfactory_search,
    search_r1_em,
)
from rlf_envs.types import Action, ActionKind, Score, Task, ToolCall, ToolResult, ToolStatus, Trajectory, Turn

ROOT = REPO


def call_turn(*statuses: ToolStatus) -> Turn:
    calls = tuple(ToolCall("search", {"query": "q"}) for _ in statuses)
    return Turn(Action(ActionKind.TOOL_CALLS, "<tool_call>{}</tool_call>", calls),
                [ToolResult(c, "r", s) for c, s in zip(calls, statuses, strict=True)], "obs")


def traj(
    answer: str | None, gold: object = ("Paris",), calls: int = 0, tid: str = "t", tags_ok: bool = True
) -> Trajectory:
    turns = [call_turn(ToolStatus.OK) for _ in range(calls)]
    if answer is not None:
        text = f"<answer>{answer}</answer>" if tags_ok else f"<answer>{answer}"
        turns.append(Turn(Action(ActionKind.ANSWER, text, answer=answer)))
    return Trajectory(Task(tid, "capital of France?", list(gold) if gold is not None else None), "P", turns, answer)


async def score(v: Verifier, t: Trajectory) -> Score:
    return await v.score(t, t.task)


YAML_EXAMPLE = """
reward:
  type: gate
  gate: {type: format, require_answer: true}
  inner:
    type: weighted
    terms:
      - {verifier: {type: exact_match}, weight: 1.0}
      - {verifier: {type: call_count, max_calls: 4, penalty: 0.1}, weight: 1.0}
"""


@pytest.mark.asyncio
async def test_yaml_example_from_the_design(tmp_path: Path) -> None:
    p = tmp_path / "reward.yaml"
    p.write_text(YAML_EXAMPLE)
    v = load_verifier_yaml(p)
    assert isinstance(v, Gate) and isinstance(v.inner, Weighted)
    assert (await score(v, traj("paris", calls=2))).value == 1.0
    assert (await score(v, traj("paris", calls=6))).value == pytest.approx(0.8)
    assert (await score(v, traj("london", calls=6))).value == pytest.approx(-0.2)
    s = await score(v, traj(None, calls=1))
    assert s.value == 0.0 and s.info["gate/passed"] == 0.0 and "exact_match" not in s.info  # inner not run
    s = await score(v, traj("Paris", calls=5))
    assert s.info["exact_match"] == 1.0 and s.info["call_count"] == pytest.approx(-0.1)
    assert s.info["call_count/calls"] == 5 and s.info["gate/passed"] == 1.0


def test_config_round_trip_and_python_equivalence() -> None:
    cfg = parse_verifier_config({"type": "weighted", "terms": [{"verifier": {"type": "token_f1", "metric": "recall"}}]})
    assert isinstance(cfg, WeightedConfig)
    dumped = cfg.model_dump()
    assert dumped["terms"][0]["verifier"] == {"type": "token_f1", "name": None, "fallback": 0.0, "metric": "recall"}
    assert parse_verifier_config(dumped) == cfg
    v = build_verifier(cfg)
    assert isinstance(v, Weighted) and isinstance(v.children[0], TokenF1) and v.children[0].cfg.metric == "recall"
    gate = build_verifier(GateConfig(gate={"type": "format"}, inner={"type": "exact_match"}, otherwise=-1))
    assert isinstance(gate, Gate) and gate.otherwise == -1


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"type": "exact_mach"},
         ["type: unknown verifier type 'exact_mach' (did you mean 'exact_match'?)", "token_f1"]),
        ({"name": "x"}, ["missing 'type'; allowed types:", "exact_match"]),
        ({"type": "gate", "gate": {"type": "format"}, "inner": {"type": "weighted", "terms": [
            {"verifier": {"type": "call_count", "max_calls": -1}}]}},
         ["inner.terms[0].verifier.max_calls: Input should be greater than or equal to 0 (got -1)"]),
        ({"type": "gate", "gate": {"type": "fromat"}, "inner": {"type": "exact_match"}},
         ["gate: unknown verifier type 'fromat' (did you mean 'format'?)"]),
        ({"type": "weighted", "terms": [{"verifier": {"type": "exact_match"}, "wieght": 2}]},
         ["terms[0].wieght: Extra inputs are not permitted"]),
        ({"type": "call_count", "max_call": 3},
         ["unknown field 'max_call' (did you mean 'max_calls'?) for verifier type 'call_count'; allowed fields:"]),
        ({"type": "token_f1", "metric": "bleu"},
         ["metric: Input should be 'f1', 'precision' or 'recall' (got 'bleu')"]),
        ({"type": "weighted", "terms": []}, ["terms: List should have at least 1 item"]),
        ({"type": "gate", "gate": {"type": "format"}}, ["inner: Field required"]),
        ({"type": "gate", "gate": {"type": "format"}, "inner": {"type": "exact_match"}, "otherwise": True},
         ["otherwise: expected a number or a verifier mapping, got a boolean"]),
        ({"type": "max", "verifiers": ["exact_match"]},
         ["verifiers[0]: expected a verifier mapping with a 'type' key, got str"]),
        ({"type": "process", "turn": {"tool_error_penalty": -1}},
         ["turn.tool_error_penalty: Input should be greater than or equal to 0 (got -1)"]),
        ({"type": "judge", "base_url": "localhost:8000", "model": "m"}, ["base_url: must be an http(s) URL"]),
        ({"type": "judge", "base_url": "http://127.0.0.1:1/v1", "model": "m", "api_key_env": "sk-abc123"},
         ["api_key_env: must be the NAME of an environment variable"]),
        ({"type": "judge", "base_url": "http://127.0.0.1:1/v1", "model": "m", "api_key": "sk-abc"},
         ["unknown field 'api_key'", "api_key_env"]),
        ({"type": "judge", "base_url": "http://127.0.0.1:1/v1", "model": "m", "prompt_template": "{questoin} {answer}"},
         ["prompt_template: unknown placeholder(s) ['questoin']"]),
        ({"type": "sql", "db_path": "/nonexistent/x.db"}, ["db_path: no SQLite file at '/nonexistent/x.db'"]),
        ({"type": "tool_check", "tool": "t", "expect": "regex"}, ["expect: regex needs a 'pattern'"]),
        ({"type": "tool_check", "tool": "t", "arguments": {"q": "{answr}"}}, ["arguments.q: unknown placeholder"]),
    ],
)
def test_config_errors_name_field_and_fix(config: dict, expected: list[str]) -> None:
    with pytest.raises(VerifierConfigError) as ei:
        build_verifier(config)
    msg = str(ei.value)
    for frag in expected:
        assert frag in msg, msg


def test_yaml_errors_carry_file_and_key(tmp_path: Path) -> None:
    p = tmp_path / "r.yaml"
    p.write_text("reward:\n  type: weighted\n  terms:\n    - verifier: {type: numeric, abs_tol: -1}\n")
    with pytest.raises(VerifierConfigError) as ei:
        load_verifier_yaml(p)
    assert str(p) in str(ei.value) and "reward.terms[0].verifier.abs_tol" in str(ei.value)
    p.write_text("reward: [1, 2\n")
    with pytest.raises(VerifierConfigError, match="not valid YAML"):
        load_verifier_yaml(p)
    with pytest.raises(VerifierConfigError, match="cannot read"):
        load_verifier_yaml(tmp_path / "missing.yaml")
    p.write_text("type: exact_match\n")  # a bare verifier document works too
    assert isinstance(load_verifier_yaml(p), ExactMatch)


def test_python_kwargs_get_the_same_validation() -> None:
    with pytest.raises(VerifierConfigError, match=r"metric: Input should be"):
        TokenF1(metric="bleu")
    with pytest.raises(VerifierConfigError, match="unknown field 'max_call'"):
        CallCount(max_call=3)
    with pytest.raises(TypeError, match="Weighted terms"):
        Weighted([(ExactMatch(), "heavy")])  # type: ignore[list-item]


class LengthCapConfig(VerifierConfig):
    type: Literal["test_length_cap"] = "test_length_cap"
    max_chars: int = 5

    def build(self, ctx: BuildContext) -> Verifier:
        return LengthCap(self.max_chars, name=self.name or "length_cap")


class LengthCap(Verifier):
    def __init__(self, max_chars: int, name: str) -> None:
        self.max_chars, self.name = max_chars, name

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        ok = len(trajectory.answer or "") <= self.max_chars
        return Score(1.0 if ok else 0.0, info={self.name: float(ok)})


@pytest.mark.asyncio
async def test_user_registered_type_nests_in_yaml() -> None:
    register_verifier(LengthCapConfig)
    register_verifier(LengthCapConfig)  # idempotent for the same class
    assert "test_length_cap" in registered_types()
    v = build_verifier({"type": "weighted", "terms": [
        {"verifier": {"type": "exact_match"}},
        {"verifier": {"type": "test_length_cap", "max_chars": 3}, "weight": 0.5}]})
    assert (await score(v, traj("Paris"))).value == 1.0
    assert (await score(v, traj("Rom"))).value == 0.5
    with pytest.raises(VerifierConfigError, match="max_chars: Input should be a valid integer"):
        build_verifier({"type": "test_length_cap", "max_chars": "many"})

    class Other(VerifierConfig):
        type: Literal["exact_match"] = "exact_match"

    with pytest.raises(ValueError, match="already registered"):
        register_verifier(Other)


class Boom(Verifier):
    name = "boom"
    fallback = -0.5

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        raise RuntimeError("verifier bug")


@pytest.mark.asyncio
async def test_composition_python_api() -> None:
    t = traj("Paris, France", calls=3)
    w = Weighted([(ExactMatch(), 1.0), (TokenF1(), 0.5), (CallCount(max_calls=2, penalty=0.1), 1.0)])
    s = await score(w, t)
    assert s.value == pytest.approx(0 + 0.5 * (2 / 3) - 0.1)
    assert set(s.info) >= {"exact_match", "token_f1", "call_count", "weighted"}
    clipped = Weighted([(Constant(value=3.0), 1.0), (Constant(value=-1.0), 1.0)], normalize=True, clip_max=0.4)
    assert (await score(clipped, t)).value == pytest.approx(0.4)  # (3-1)/2 = 1, clipped
    assert (await score(Max([ExactMatch(), Constant(value=0.1)]), t)).value == 0.1
    assert (await score(Min([TokenF1(), Constant(value=0.9)]), t)).value == pytest.approx(2 / 3)
    g = Gate(FormatCheck(tags=["answer"]), ExactMatch(), otherwise=Constant(value=-1.0))
    assert (await score(g, traj("Paris", tags_ok=False))).value == -1.0
    assert (await score(g, traj("Paris"))).value == 1.0
    # a raising child contributes its fallback and an error flag; the rest still counts
    s = await score(Weighted([(Boom(), 1.0), (ExactMatch(), 1.0)]), traj("Paris"))
    assert s.value == pytest.approx(0.5) and s.info["boom/error"] == 1.0
    # duplicate names do not overwrite each other
    s = await score(Weighted([(ExactMatch(), 1.0), (ExactMatch(normalize=False), 1.0)]), traj("paris"))
    assert s.info["exact_match"] == 1.0 and s.info["1.exact_match"] == 0.0


@pytest.mark.asyncio
async def test_per_turn_values_flow_through_composition() -> None:
    t = traj("Paris", calls=2)
    proc = ProcessReward(turn=TurnRewardConfig(valid_call_bonus=0.1, answer_bonus=0.2))
    w = Weighted([(ExactMatch(), 1.0), (proc, 0.5)])
    s = await score(w, t)
    assert s.per_turn == pytest.approx((0.05, 0.05, 0.1))
    assert s.value == pytest.approx(1.0 + 0.5 * 0.4)
    assert (await score(Gate(ExactMatch(), proc), t)).per_turn == pytest.approx((0.1, 0.1, 0.2))


@pytest.mark.asyncio
async def test_batch_goes_on_when_a_verifier_raises(caplog: pytest.LogCaptureFixture) -> None:
    trajs = [traj("Paris", tid="ok-1"), traj("Paris", gold=None, tid="broken-2"), traj("Lyon", tid="ok-3")]
    scores = await ExactMatch(fallback=-0.25).score_batch(trajs)
    assert [s.value for s in scores] == [1.0, -0.25, 0.0]
    assert "broken-2" in caplog.text and "exact_match" in caplog.text
    assert [s.value for s in await Boom().score_batch(trajs)] == [-0.5] * 3


@pytest.mark.asyncio
async def test_batch_scoring_runs_concurrently() -> None:
    inflight, peak = 0, 0

    class Slow(Verifier):
        async def score(self, trajectory: Trajectory, task: Task) -> Score:
            nonlocal inflight, peak
            inflight += 1
            peak = max(peak, inflight)
            await asyncio.sleep(0.2)
            inflight -= 1
            return Score(1.0)

    out = await Slow().score_batch([traj("x") for _ in range(50)])
    assert len(out) == 50 and peak == 50  # all 50 in flight at once


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("t", "expected"),
    [
        # search_r1_em(0.1): correct 1, wrong-but-answered 0.1, no answer 0
        (traj("paris"), 1.0),
        (traj("london"), 0.1),
        (traj(None), 0.0),
    ],
)
async def test_search_r1_preset(t: Trajectory, expected: float) -> None:
    assert (await score(build_verifier(search_r1_em(0.1)), t)).value == pytest.approx(expected)
    assert (await score(build_verifier(search_r1_em()), t)).value == pytest.approx(float(expected == 1.0))


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("t", "expected"),
    [
        # f = 0.1. F = answer_tags(+-f) + tool_call_format(-f..f, no calls -f) + call_count(-f/2 if > 2 calls)
        (traj("Paris", calls=1), 1 + 0.5 * (0.1 + 0.1)),  # correct: 1 + F/2, F = 0.2
        (traj("Paris", calls=0), 1 + 0.5 * (0.1 - 0.1)),  # no calls: tool term -f
        (traj("Lyon", calls=3), 0.1 + 0.1 - 0.05),  # wrong: F, too many calls
        (traj("Paris", calls=1, tags_ok=False), 1 + 0.5 * (-0.1 + 0.1)),  # broken answer tags
        (traj(None, calls=1), -0.1 + 0.5 * (0.1 + 0.1)),  # no answer: -f + F/2 (answer tags vacuously fine)
    ],
)
async def test_rlfactory_search_shaping_as_config(t: Trajectory, expected: float) -> None:
    v = build_verifier(rlfactory_search(0.1))
    assert (await score(v, t)).value == pytest.approx(expected)


def test_import_is_light() -> None:
    code = textwrap.dedent(
        """
        import sys
        import rlf_envs.rewards
        heavy = [m for m in ('torch', 'transformers') if m in sys.modules]
        assert not heavy, heavy
        """
    )
    env_path = f"{ROOT / 'rlf_envs' / 'src'}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
