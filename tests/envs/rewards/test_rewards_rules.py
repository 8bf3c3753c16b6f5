"""Rule-based verifiers and per-turn rewards on hand-checked cases."""

from __future__ import annotations

import pytest

from rlf_envs.rewards import (
    CallCount,
    Constant,
    ExactMatch,
    FormatCheck,
    NumericMatch,
    ProcessReward,
    RegexMatch,
    SubstringMatch,
    TokenF1,
    ToolCallFormat,
    TurnRewardConfig,
    TurnRewarder,
    VerifierConfigError,
    build_turn_rewarder,
    normalize_answer,
    parse_number,
    tags_well_formed,
)
from rlf_envs.types import (
    Action,
    ActionKind,
    Task,
    ToolCall,
    ToolResult,
    ToolStatus,
    Trajectory,
    Turn,
    TurnStats,
)


def call_turn(*statuses: ToolStatus, text: str = "<tool_call>{}</tool_call>") -> Turn:
    calls = tuple(ToolCall(name="search", arguments={"query": f"q{i}"}) for i in range(len(statuses)))
    results = [ToolResult(c, "out", s) for c, s in zip(calls, statuses, strict=True)]
    errors = sum(s is not ToolStatus.OK for s in statuses)
    return Turn(Action(ActionKind.TOOL_CALLS, text, calls), results, "obs", stats=TurnStats(len(calls), errors))


def answer_turn(answer: str, text: str | None = None) -> Turn:
    return Turn(Action(ActionKind.ANSWER, text if text is not None else f"<answer>{answer}</answer>", answer=answer))


def invalid_turn(text: str = "<tool_call>{bad json</tool_call>") -> Turn:
    return Turn(Action(ActionKind.INVALID, text, error="bad json"), stats=TurnStats(invalid=True))


def traj(answer: str | None, gold: object = None, turns: list[Turn] | None = None, tid: str = "t1") -> Trajectory:
    task = Task(id=tid, question="q?", ground_truth=gold)
    if turns is None:
        turns = [answer_turn(answer)] if answer is not None else []
    return Trajectory(task=task, prompt="P:", turns=turns, answer=answer)


async def value(v: object, t: Trajectory) -> float:
    s = await v.score(t, t.task)  # type: ignore[attr-defined]
    return s.value


# ------------------------------------------------------------------------------------------- normalisation


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        ("The Beatles", "beatles"),
        ("  the   BEATLES!! ", "beatles"),
        ("U.S.A.", "usa"),  # punctuation removed first, letters kept
        ("An apple a day", "apple day"),
        ("theater", "theater"),  # 'the' only as a whole word
        ("Anne", "anne"),
        ("the-end", "theend"),  # hyphen removed before article removal: no article left
        ("the, end", "end"),
        ("Paris\n\tFrance", "paris france"),
        ("Ünïcödé Café", "ünïcödé café"),  # non-ASCII letters are kept, only ASCII punctuation goes
        ("“quoted”", "“quoted”"),  # curly quotes are not in string.punctuation (Search-R1 behaviour)
        ("", ""),
        ("a an the", ""),
        ("1,000", "1000"),
    ],
)
def test_search_r1_normalisation(raw: str, norm: str) -> None:
    assert normalize_answer(raw) == norm


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("answer", "gold", "em", "sub"),
    [
        ("the Beatles", ["Beatles"], 1.0, 1.0),
        ("Beatles.", {"target": ["The Rolling Stones", "The Beatles"]}, 1.0, 1.0),  # Search-R1 gold shape
        ("Paul McCartney of the Beatles", ["The Beatles"], 0.0, 1.0),
        ("Beatle", ["Beatles"], 0.0, 0.0),
        ("42", 42, 1.0, 1.0),
        ("usa", ["U.S.A."], 1.0, 1.0),
        ("", ["x"], 0.0, 0.0),
        ("", [""], 1.0, 1.0),
    ],
)
async def test_exact_and_substring_match(answer: str, gold: object, em: float, sub: float) -> None:
    t = traj(answer, gold)
    assert await value(ExactMatch(), t) == em
    assert await value(SubstringMatch(), t) == sub


@pytest.mark.asyncio
async def test_exact_match_without_normalisation_and_no_answer() -> None:
    assert await value(ExactMatch(normalize=False), traj(" The Beatles ", ["The Beatles"])) == 1.0
    assert await value(ExactMatch(normalize=False), traj("the beatles", ["The Beatles"])) == 0.0
    s = await ExactMatch().score(traj(None, ["x"]), traj(None, ["x"]).task)
    assert s.value == 0.0 and s.info["exact_match/no_answer"] == 1.0


@pytest.mark.asyncio
async def test_missing_gold_is_a_logged_fallback(caplog: pytest.LogCaptureFixture) -> None:
    v = ExactMatch(fallback=-1.0)
    t = traj("x", None, tid="no-gold-7")
    s = await v.safe_score(t, t.task)
    assert s.value == -1.0 and s.info == {"exact_match/error": 1.0}
    assert "no-gold-7" in caplog.text


@pytest.mark.asyncio
async def test_token_f1_hand_checked() -> None:
    # pred tokens: [paul, mccartney, beatles]  gold: [beatles] -> p=1/3 r=1 f1=0.5
    t = traj("Paul McCartney, the Beatles", ["The Beatles"])
    s = await TokenF1().score(t, t.task)
    assert s.value == pytest.approx(0.5)
    assert s.info["token_f1/precision"] == pytest.approx(1 / 3) and s.info["token_f1/recall"] == 1.0
    assert await value(TokenF1(metric="recall"), t) == 1.0
    # best gold wins; duplicates counted with multiplicity: pred [new, york, new] gold [new, york] -> p=2/3 r=1
    t2 = traj("New York new", ["Boston", "New York"])
    assert await value(TokenF1(), t2) == pytest.approx(0.8)
    assert await value(TokenF1(), traj("the", ["a"])) == 1.0  # both normalise to empty
    assert await value(TokenF1(), traj("the", ["x"])) == 0.0


@pytest.mark.parametrize(
    ("text", "num"),
    [("42", 42.0), ("1,234.5", 1234.5), ("-3e2", -300.0), ("3/4", 0.75), ("50%", 50.0), ("$12", 12.0),
     ("The answer is 7 or maybe 8", 8.0), ("no number", None), ("nan", None), ("inf", None), ("1/0", None)],
)
def test_parse_number(text: str, num: float | None) -> None:
    assert parse_number(text) == num


@pytest.mark.asyncio
async def test_numeric_match_tolerance() -> None:
    assert await value(NumericMatch(), traj("3.14159", ["3.14159"])) == 1.0
    assert await value(NumericMatch(), traj("3.1416", ["3.14159"])) == 0.0
    assert await value(NumericMatch(abs_tol=1e-3), traj("3.1416", ["3.14159"])) == 1.0
    assert await value(NumericMatch(rel_tol=0.01), traj("101", ["100"])) == 1.0
    assert await value(NumericMatch(), traj("so it is 12 apples", ["12"])) == 1.0
    assert await value(NumericMatch(extract="first"), traj("12 then 13", ["12"])) == 1.0
    assert await value(NumericMatch(), traj("twelve", ["12"])) == 0.0
    bad = traj("1", ["not a number"])
    assert (await NumericMatch().safe_score(bad, bad.task)).info == {"numeric/error": 1.0}
    with pytest.raises(VerifierConfigError, match="abs_tol"):
        NumericMatch(abs_tol=-1)


# ------------------------------------------------------------------------------------------ regex / format


@pytest.mark.asyncio
async def test_regex_targets_and_modes() -> None:
    t = traj("2024-01-31", ["x"], turns=[call_turn(ToolStatus.OK, text="<think>hm</think>"), answer_turn("2024-01-31")])
    assert await value(RegexMatch(pattern=r"\d{4}-\d{2}-\d{2}", mode="fullmatch"), t) == 1.0
    assert await value(RegexMatch(pattern=r"\d{4}", mode="fullmatch"), t) == 0.0
    assert await value(RegexMatch(pattern="<think>", target="actions"), t) == 1.0
    assert await value(RegexMatch(pattern="<think>", target="last_action"), t) == 0.0
    assert await value(RegexMatch(pattern="obs", target="completion"), t) == 1.0  # observations included
    assert await value(RegexMatch(pattern="THINK", target="actions", flags=["ignorecase"]), t) == 1.0
    assert await value(RegexMatch(pattern="sorry", must_match=False, fail_value=-1), t) == 1.0
    assert await value(RegexMatch(pattern="x", fail_value=-0.5), traj(None, ["x"])) == -0.5
    with pytest.raises(VerifierConfigError, match=r"pattern.*regular expression"):
        RegexMatch(pattern="(unclosed")


@pytest.mark.parametrize(
    ("text", "ok"),
    [("<answer>x</answer>", True), ("no tags", True), ("<answer>x", False), ("</answer>x<answer>", False),
     ("<answer><answer>x</answer></answer>", False), ("<answer>a</answer><answer>b</answer>", True),
     ('<answer id="1">x</answer>', True), ("<answers>x</answers><answer>", False)],
)
def test_tags_well_formed(text: str, ok: bool) -> None:
    assert tags_well_formed(text, "answer") is ok


@pytest.mark.asyncio
async def test_format_check() -> None:
    good = traj("x", ["x"], turns=[call_turn(ToolStatus.OK, text="<think>a</think><tool_call>{}</tool_call>"),
                                   answer_turn("x", "<think>b</think><answer>x</answer>")])
    fmt = FormatCheck(tags=["think", "answer"])
    assert await value(fmt, good) == 1.0
    broken_tags = traj("x", ["x"], turns=[answer_turn("x", "<think>b<answer>x</answer>")])
    s = await fmt.score(broken_tags, broken_tags.task)
    assert s.value == 0.0 and s.info["format/bad_tag_think"] == 1.0
    no_answer = traj(None, ["x"], turns=[call_turn(ToolStatus.OK)])
    assert await value(fmt, no_answer) == 0.0
    assert await value(FormatCheck(require_answer=False), no_answer) == 1.0
    with_invalid = traj("x", ["x"], turns=[invalid_turn(), answer_turn("x")])
    assert await value(FormatCheck(), with_invalid) == 0.0
    assert await value(FormatCheck(forbid_invalid_turns=False), with_invalid) == 1.0
    failed_tool = traj("x", ["x"], turns=[call_turn(ToolStatus.TIMEOUT), answer_turn("x")])
    assert await value(FormatCheck(), failed_tool) == 1.0
    assert await value(FormatCheck(require_tool_success=True), failed_tool) == 0.0
    many = traj("x", ["x"], turns=[call_turn(ToolStatus.OK, ToolStatus.OK), call_turn(ToolStatus.OK), answer_turn("x")])
    assert await value(FormatCheck(max_calls=2, pass_value=0.1, fail_value=-0.1), many) == -0.1
    assert await value(FormatCheck(max_calls=3), many) == 1.0
    assert await value(FormatCheck(min_calls=1), traj("x", ["x"])) == 0.0
    with pytest.raises(VerifierConfigError, match=r"tags.*without angle brackets"):
        FormatCheck(tags=["<answer>"])
    with pytest.raises(VerifierConfigError, match="max_calls"):
        FormatCheck(min_calls=3, max_calls=1)


@pytest.mark.asyncio
async def test_tool_call_format_and_call_count() -> None:
    t = traj("x", ["x"], turns=[call_turn(ToolStatus.OK, ToolStatus.INVALID_ARGS), invalid_turn(),
                                call_turn(ToolStatus.OK, ToolStatus.ERROR), answer_turn("x")])
    # valid: OK, OK, ERROR (a well-formed call whose tool failed) = 3; malformed: INVALID_ARGS + invalid turn = 2
    s = await ToolCallFormat(low=-0.1, high=0.1).score(t, t.task)
    assert s.value == pytest.approx(-0.1 + 0.2 * 3 / 5)
    assert s.info["tool_call_format/valid"] == 3 and s.info["tool_call_format/invalid"] == 2
    assert await value(ToolCallFormat(no_calls_value=-0.05), traj("x", ["x"])) == -0.05
    # 4 calls made (2 + 2 in TOOL_CALLS turns)
    assert await value(CallCount(max_calls=4, penalty=0.1), t) == 0.0
    assert await value(CallCount(max_calls=1, penalty=0.1), t) == pytest.approx(-0.3)
    assert await value(CallCount(max_calls=1, penalty=0.1, mode="flat"), t) == pytest.approx(-0.1)
    assert await value(CallCount(min_calls=1, penalty=0.5), traj("x", ["x"])) == -0.5
    with pytest.raises(VerifierConfigError, match="set max_calls and/or min_calls"):
        CallCount()
    with pytest.raises(VerifierConfigError, match="penalty"):
        CallCount(max_calls=2, penalty=-0.1)
    assert await value(Constant(value=0.25), t) == 0.25


# ------------------------------------------------------------------------------------------ process rewards


def test_turn_rewarder_hand_checked() -> None:
    r = TurnRewarder(valid_call_bonus=0.1, tool_error_penalty=0.2, timeout_penalty=0.3, invalid_call_penalty=0.4,
                     invalid_action_penalty=0.5, answer_bonus=0.05)
    assert r.turn_reward(call_turn(ToolStatus.OK, ToolStatus.OK)) == pytest.approx(0.2)
    assert r.turn_reward(call_turn(ToolStatus.OK, ToolStatus.ERROR)) == pytest.approx(-0.1)
    assert r.turn_reward(call_turn(ToolStatus.TIMEOUT, ToolStatus.UNKNOWN_TOOL)) == pytest.approx(-0.7)
    assert r.turn_reward(call_turn(ToolStatus.CRASHED)) == 0.0  # infra failure: not the policy's fault by default
    assert r.turn_reward(invalid_turn()) == pytest.approx(-0.5)
    assert r.turn_reward(answer_turn("x")) == pytest.approx(0.05)
    capped = TurnRewarder(TurnRewardConfig(valid_call_bonus=0.1, max_rewarded_calls=2, clip_min=-0.15))
    assert capped.turn_reward(call_turn(*[ToolStatus.OK] * 5)) == pytest.approx(0.2)  # no reward for spamming
    assert TurnRewarder(invalid_call_penalty=1, clip_min=-0.15).turn_reward(call_turn(ToolStatus.INVALID_ARGS)) == -0.15
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        TurnRewarder(tool_error_penalty=-0.2)


@pytest.mark.asyncio
async def test_process_reward_per_turn_and_assign() -> None:
    turns = [call_turn(ToolStatus.OK), invalid_turn(), call_turn(ToolStatus.ERROR), answer_turn("x")]
    t = traj("x", ["x"], turns=turns)
    cfg = TurnRewardConfig(valid_call_bonus=0.1, invalid_action_penalty=0.2, tool_error_penalty=0.3)
    s = await ProcessReward(turn=cfg).score(t, t.task)
    assert s.per_turn == pytest.approx((0.1, -0.2, -0.3, 0.0))
    assert s.value == pytest.approx(-0.4)
    assert (await ProcessReward(turn=cfg, aggregate="mean").score(t, t.task)).value == pytest.approx(-0.1)
    assert (await ProcessReward(turn=cfg, aggregate="none").score(t, t.task)).value == 0.0
    TurnRewarder(cfg).assign(t)
    assert t.per_turn_rewards == pytest.approx([0.1, -0.2, -0.3, 0.0])


def test_build_turn_rewarder_from_yaml_mapping() -> None:
    assert build_turn_rewarder(None) is None
    r = build_turn_rewarder({"valid_call_bonus": 0.1, "invalid_action_penalty": 0.2})
    assert r is not None and r.turn_reward(invalid_turn()) == pytest.approx(-0.2)
    with pytest.raises(VerifierConfigError) as ei:
        build_turn_rewarder({"valid_call_bonus": 0.1, "invalid_call_penalty": -0.5, "tool_eror_penalty": 1})
    msg = str(ei.value)
    assert "turn_reward.invalid_call_penalty: Input should be greater than or equal to 0 (got -0.5)" in msg
    assert "turn_reward.tool_eror_penalty: Extra inputs are not permitted" in msg
