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

    #: steps in a row in which no group could be judged (every one scored by the fallback) before the run stops
    MAX_UNJUDGED_STEPS = 3

    def __init__(self, verifier: GroupVerifier) -> None:
        self.verifier = verifier
        self.prefix = verifier.name  # metrics `<name>/<counter>`, as the judge's score_info entries
        self._before: dict[str, float] = dict(verifier.metrics())
        self._unjudged_steps = 0
        self.totals: dict[str, float] = {}

    def check_endpoint(self, timeout_s: float = 10.0) -> None:
        """Before any training work: the judge's endpoint answers (`GET <base_url>/models`) and serves its model;
        ConfigError naming `group_reward.base_url` / `.model` otherwise (a wrong URL used to print one line per
        group for the whole run and train nothing)."""
        cfg = getattr(self.verifier, "cfg", None)
        base_url, model = getattr(cfg, "base_url", None), getattr(cfg, "model", None)
        if not base_url:
            return
        import json
        import os
        import urllib.error
        import urllib.request

        req = urllib.request.Request(f"{base_url}/models")
        key_env = getattr(cfg, "api_key_env", None)
        if key_env and os.environ.get(key_env):
            req.add_header("Authorization", f"Bearer {os.environ[key_env]}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                body = json.loads(r.read(1 << 20) or b"{}")
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                raise ConfigError(f"group_reward.base_url: {base_url} refused the key (HTTP {e.code}); set the "
                                  f"variable group_reward.api_key_env names") from None
            return  # it answers: an endpoint without /models (some proxies) is not refused
        except (OSError, ValueError) as e:
            raise ConfigError(f"group_reward.base_url: no OpenAI-compatible endpoint answers at {base_url} "
                              f"({getattr(e, 'reason', e)}); start the judge server (e.g. `vllm serve MODEL`) or fix "
                              "base_url") from None
        served = [m.get("id") for m in body.get("data", []) if isinstance(m, dict)] if isinstance(body, dict) else []
        if served and model not in served:
            raise ConfigError(f"group_reward.model: {base_url} serves {', '.join(map(str, served[:5]))}, not "
                              f"{model!r}")

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
        self.totals = now
        groups, fallbacks = delta.get("groups", 0.0), delta.get("fallbacks", 0.0)
        self._unjudged_steps = self._unjudged_steps + 1 if groups and fallbacks >= groups else 0
        if self._unjudged_steps >= self.MAX_UNJUDGED_STEPS:
            raise RuntimeError(f"group_reward: no group could be judged for {self._unjudged_steps} steps in a row "
                               f"({int(now.get('errors', 0))} judge errors, {int(now.get('timeouts', 0))} timeouts "
                               "so far; the log says why): the run stops instead of training on fallback scores. "
                               "Check the judge server and group_reward.base_url / model")
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

    def summary(self) -> str:
        """One line for the end of the run: groups judged, fell back, errors."""
        t = self.totals
        return (f"group_reward ({self.prefix}): {int(t.get('groups', 0))} groups, {int(t.get('fallbacks', 0))} scored "
                f"by the fallback, {int(t.get('errors', 0))} judge errors, {int(t.get('timeouts', 0))} timeouts")

    def close(self) -> None:
        runtime.run(self.verifier.aclose())
