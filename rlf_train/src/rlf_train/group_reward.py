"""`group_reward`: score each GRPO group of a training batch with a group verifier (e.g. `type: group_judge`)
before its advantages are computed.

The env's own verifier still scores every episode (its value is kept in `score_info["env_reward"]`, and held-out
evaluation uses it); the group verifier's score replaces the training reward. Groups are scored concurrently on
rlf's loop (the judge bounds its calls in flight). Its counters (tokens in/out, seconds, calls, contract
violations, fallbacks, audits) are logged per step as `group_judge/<counter>`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlf_envs import runtime
from rlf_envs.rewards import BuildContext, GroupVerifier, VerifierConfigError, build_group_verifier
from rlf_envs.types import Trajectory
from rlf_train.config import ConfigError


class GroupReward:
    """The configured group verifier, applied to training batches (`apply`) and closed at the end (`close`)."""

    def __init__(self, verifier: GroupVerifier) -> None:
        self.verifier = verifier
        self.prefix = verifier.name  # metrics `<name>/<counter>`, as the judge's score_info entries
        self._before: dict[str, float] = dict(verifier.metrics())

    @classmethod
    def from_config(cls, config: dict[str, Any] | None, env: Any) -> GroupReward | None:
        """Built from the config's `group_reward` mapping (None: no group reward); the judge is shown the tools of
        `env` (a ToolEnv). A bad mapping raises ConfigError naming the key."""
        if config is None:
            return None
        toolbox = getattr(env, "toolbox", None)
        try:
            verifier = build_group_verifier(config, BuildContext(tools=toolbox), path="group_reward")
        except VerifierConfigError as e:
            raise ConfigError(str(e)) from None
        if toolbox is not None and hasattr(verifier, "tools"):
            verifier.tools = list(toolbox.specs)
        return cls(verifier)

    def apply(self, trajs: Sequence[Trajectory], group_size: int) -> dict[str, float]:
        """Score the batch's groups (rows i*G..(i+1)*G-1), setting each trajectory's reward; returns this batch's
        metrics: the change of every counter, the mean seconds per judge call, and the audit means if any."""
        from rlf_envs.rewards import score_groups

        runtime.run(score_groups(self.verifier, list(trajs), group_size))
        now = dict(self.verifier.metrics())
        delta = {k: v - self._before.get(k, 0.0) for k, v in now.items()}
        self._before = now
        p = self.prefix
        out = {f"{p}/{k}": v for k, v in delta.items()}
        calls = delta.get("calls", 0.0)
        if calls:
            out[f"{p}/seconds_per_call"] = delta.get("seconds", 0.0) / calls
        # the batch's reward_mean / success_rate mix in the neutral value of groups that were not judged (all members
        # identical, or the fallback); these two say what the judge gave and what the env's own verifier gave
        judged = [t.reward for t in trajs if not any(f"{p}/{k}" in t.score_info for k in ("no_call", "fallback"))]
        if judged:
            out[f"{p}/judged_reward_mean"] = sum(judged) / len(judged)
        env = [t.score_info["env_reward"] for t in trajs if "env_reward" in t.score_info]
        if env:
            out[f"{p}/env_reward_mean"] = sum(env) / len(env)
        audit = [[t.score_info[f"{p}/audit"], t.reward] for t in trajs if f"{p}/audit" in t.score_info]
        if audit:
            out[f"{p}/audit_mean"] = sum(a for a, _ in audit) / len(audit)
            out[f"{p}/audit_judge_mean"] = sum(j for _, j in audit) / len(audit)
        return out

    def close(self) -> None:
        runtime.run(self.verifier.aclose())
