"""The run's own warnings (rlf_train.watch): no reward signal in any group, and reward rising while tool use falls to
zero; each said once, with what to check; and the step metrics count unusable turns and reward without tools."""

from __future__ import annotations

from rlf_train.watch import COLLAPSE_STEPS, NO_SIGNAL_STEPS, RunWatch


def test_no_signal_is_said_once_after_consecutive_steps() -> None:
    said: list[str] = []
    w = RunWatch(said.append)
    for _ in range(NO_SIGNAL_STEPS - 1):
        w.step({"groups_with_signal": 0.0, "reward_mean": 0.0, "tool_calls_mean": 1.0})
    w.step({"groups_with_signal": 0.5, "reward_mean": 0.0, "tool_calls_mean": 1.0})  # a step with signal resets
    for _ in range(NO_SIGNAL_STEPS - 1):
        w.step({"groups_with_signal": 0.0, "reward_mean": 0.0, "tool_calls_mean": 1.0})
    assert said == []
    for _ in range(3):
        w.step({"groups_with_signal": 0.0, "reward_mean": 0.0, "tool_calls_mean": 1.0})
    assert len(said) == 1 and "no group carried any reward signal" in said[0]


def test_reward_rising_while_tool_use_falls_to_zero_is_said() -> None:
    said: list[str] = []
    w = RunWatch(said.append)
    for i in range(COLLAPSE_STEPS):
        w.step({"groups_with_signal": 1.0, "reward_mean": 0.1, "tool_calls_mean": 1.0 - i / COLLAPSE_STEPS})
    for _ in range(COLLAPSE_STEPS):
        w.step({"groups_with_signal": 1.0, "reward_mean": 0.6, "tool_calls_mean": 0.0})
    assert len(said) == 1 and "no tool call" in said[0]
    quiet: list[str] = []
    w2 = RunWatch(quiet.append)
    for _ in range(3 * COLLAPSE_STEPS):  # no tools and a falling reward: nothing to say
        w2.step({"groups_with_signal": 1.0, "reward_mean": 0.0, "tool_calls_mean": 0.0})
    assert quiet == []


def test_episode_stats_count_unusable_turns_and_reward_without_tools() -> None:
    import gymnasium as gym

    import rlf_envs  # noqa: F401
    from rlf_train.rollout.batch import episode_stats

    env = gym.make("rlf/Calculator-v0", max_turns=3).unwrapped
    env.reset(seed=0)
    env.step('<tool_call>{"name": "nope", "arguments": {}}</tool_call>')
    env.step('<tool_call>{"name": "calculator", "arguments": </tool_call>')
    *_, info = env.step("<answer>1</answer>")
    st = episode_stats([info["trajectory"]])
    assert st["unknown_tool_calls_mean"] == 1.0 and st["invalid_turns_mean"] == 1.0
    assert "zero_tool_reward_mean" not in st  # it made a (failed) call
    env.reset(seed=1)
    *_, info = env.step("<answer>1</answer>")
    st = episode_stats([info["trajectory"]])
    assert st["zero_tool_reward_mean"] == info["trajectory"].reward
