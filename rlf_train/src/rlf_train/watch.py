"""Warnings a run gives while it trains, for the silent failures that cost the most (issue 48/49): steps whose
groups carry no reward signal (GRPO learns nothing from them), and reward rising while tool use falls to zero (a
policy that stopped calling tools: the parser never matches, or the reward pays for not using them), and rollout
log-probs that disagree with the learner's on the tokens the current weights sampled (`rlf_train.agreement`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from rlf_train.agreement import WARN_KL, disagreement

NO_SIGNAL_STEPS = 5
COLLAPSE_STEPS = 5


class RunWatch:
    """Fed each step's metrics record; says each warning once (through `say`), with what to check."""

    def __init__(self, say: Callable[[str], Any]) -> None:
        self.say = say
        self._no_signal = 0
        self._first_rewards: list[float] = []
        self._recent: deque[tuple[float, float]] = deque(maxlen=COLLAPSE_STEPS)
        self.warned: set[str] = set()

    def step(self, rec: dict[str, Any]) -> None:
        sig = rec.get("groups_with_signal")
        if sig is not None:
            self._no_signal = self._no_signal + 1 if sig == 0 else 0
            if self._no_signal >= NO_SIGNAL_STEPS and "no_signal" not in self.warned:
                self.warned.add("no_signal")
                self.say(f"warning: no group carried any reward signal for {self._no_signal} steps in a row (every "
                         "sample of a task scored the same): GRPO's advantages are 0 and nothing is learned. Check "
                         "the reward (a verifier that always gives 0, a judge that cannot be reached), raise "
                         "rollout.temperature or samples_per_prompt, or use easier tasks / an SFT warm start.")
        bad = disagreement(rec)
        if bad is not None and f"agree/{bad[0]}" not in self.warned:
            self.warned.add(f"agree/{bad[0]}")
            self.say(f"warning: the {bad[0]} rollout's log-probs disagree with the learner's on tokens the current "
                     f"weights sampled (KL {bad[1]:.2e} > {WARN_KL:g}, agree/{bad[0]}/stale0 in the metrics): the "
                     "engine may not hold the trained weights, or samples with another temperature/top_p, or the "
                     "context was retokenised. `python -m rlf_train.replay` on this step's bundle shows where.")
        reward, calls = rec.get("reward_mean"), rec.get("tool_calls_mean")
        if reward is None or calls is None:
            return
        if len(self._first_rewards) < COLLAPSE_STEPS:
            self._first_rewards.append(float(reward))
        self._recent.append((float(reward), float(calls)))
        if len(self._recent) == COLLAPSE_STEPS and len(self._first_rewards) == COLLAPSE_STEPS \
                and all(c == 0 for _, c in self._recent) and "tool_collapse" not in self.warned:
            start = sum(self._first_rewards) / COLLAPSE_STEPS
            now = sum(r for r, _ in self._recent) / COLLAPSE_STEPS
            if now > start:
                self.warned.add("tool_collapse")
                self.say(f"warning: reward rose ({start:.3f} -> {now:.3f}) while the policy made no tool call for "
                         f"{COLLAPSE_STEPS} steps: check that the format parses its tool calls (invalid_turns_mean, "
                         "unknown_tool_calls_mean) and that the reward cannot be earned without the tools.")
