"""Tool-call accounting in the env: unparsed turns, calls to undeclared tools and bad arguments are counted per turn
and per episode, and `max_invalid_streak` ends an episode after K unusable turns in a row."""

from __future__ import annotations

import gymnasium as gym
import pytest

import rlf_envs  # noqa: F401 - registers the ids

GOOD = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 1"}}</tool_call>'
UNKNOWN = '<tool_call>{"name": "no_such_tool", "arguments": {}}</tool_call>'
BAD_ARGS = '<tool_call>{"name": "calculator", "arguments": {"expr": 3}}</tool_call>'
MALFORMED = '<tool_call>{"name": "calculator", "arguments": </tool_call>'


def test_unusable_turns_are_counted_and_a_streak_ends_the_episode() -> None:
    env = gym.make("rlf/Calculator-v0", max_turns=10, max_invalid_streak=3).unwrapped
    env.reset(seed=0)
    for a in (UNKNOWN, GOOD, MALFORMED, BAD_ARGS):
        _, _, term, trunc, info = env.step(a)
        assert not (term or trunc)
    _, _, term, trunc, info = env.step(UNKNOWN)  # the third unusable turn in a row (the GOOD one broke the first)
    assert trunc and not term and info["end_reason"] == "invalid_calls"
    traj = info["trajectory"]
    assert traj.num_unknown_tool_calls == 2 and traj.num_invalid_turns == 1
    assert [t.stats.unusable for t in traj.turns] == [True, False, True, True, True]
    assert traj.turns[3].stats.invalid_args == 1


def test_without_the_option_nothing_ends_early_and_bad_values_are_refused() -> None:
    env = gym.make("rlf/Calculator-v0", max_turns=6).unwrapped
    env.reset(seed=0)
    for _ in range(5):
        *_, term, trunc, info = env.step(UNKNOWN)
        assert not (term or trunc)
    *_, term, trunc, info = env.step(UNKNOWN)
    assert trunc and info["end_reason"] == "max_turns"
    with pytest.raises(ValueError, match="max_invalid_streak"):
        gym.make("rlf/Calculator-v0", max_invalid_streak=0)
