"""rlf envs as SkyRL-Gym environments (`pip install -e './rlf_envs[skyrl]'`).

    import skyrl_gym
    from rlf_envs.adapters.skyrl import register_skyrl

    register_skyrl()  # skyrl_gym id "rlf" -> RlfSkyRLEnv
    env = skyrl_gym.make("rlf", env_config={"env_id": "rlf/Calculator-v0"}, extras={"task_index": 0})
    prompt, info = env.init([])          # rlf's prompt as chat messages
    out = env.step("<answer>42</answer>") # BaseTextEnvStepOutput: observations, reward, done, metadata

In a SkyRL run set `environment.env_class: rlf` and put the env under `environment.skyrl_gym.rlf`
(`env_id`, `env_kwargs`, `observation`); each dataset row's `extra_info`/env extras pick the task:
`{"task": {...}}` (an rlf task dict), `{"task_index": i}`, or SkyRL's own `reward_spec.ground_truth` with the
row's `prompt` messages.

What is kept. SkyRL-Gym's `step` takes the policy's text and returns chat messages: the rlf env runs in text
mode (no tokenizer: SkyRL tokenises, token-in-token-out, from the engine's own ids). Observations:
- `observation="messages"` (default; SkyRL's `use_conversation_multi_turn=True`): the observation as chat
  messages (`chatml_messages`); Qwen's chat template renders them back to rlf's exact observation text.
- `observation="raw"` (SkyRL's `use_conversation_multi_turn=False`): one message holding rlf's observation
  text verbatim (SkyRL encodes it as is), so the sequence SkyRL trains on is rlf's text trajectory.
Per-turn rewards: each step's reward is the turn's reward (the verifier's score added on the last step);
SkyRL places per-step rewards at turn ends. Tool calls of a turn run concurrently; MCP tools work as in rlf.
A tokenizer in `env_kwargs` is refused (SkyRL's step carries text, not ids).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

from rlf_envs.adapters import require_trainer
from rlf_envs.adapters.support import chatml_messages, task_options
from rlf_envs.registration import make_tool_env

log = logging.getLogger(__name__)
SKYRL_ID = "rlf"
ObservationMode = Literal["messages", "raw"]

_base = require_trainer("skyrl")
BaseTextEnv = _base.BaseTextEnv
BaseTextEnvStepOutput = _base.BaseTextEnvStepOutput


def _plain(cfg: Any) -> dict[str, Any]:
    """A dict from a dict, an OmegaConf DictConfig (SkyRL's configs) or None."""
    if cfg is None:
        return {}
    if isinstance(cfg, Mapping) and type(cfg).__module__.startswith("builtins"):
        return dict(cfg)
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(cfg):
            return dict(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
    except ImportError:
        pass
    return dict(cfg)


class RlfSkyRLEnv(BaseTextEnv):  # type: ignore[misc, valid-type]
    """Any registered rlf env (`env_config.env_id` + `env_config.env_kwargs`) as a SkyRL-Gym `BaseTextEnv`."""

    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        cfg = _plain(env_config)
        self.extras = dict(extras or {})
        env_id = cfg.get("env_id")
        if not env_id:
            raise ValueError("RlfSkyRLEnv needs env_config.env_id (a registered rlf env id, e.g. rlf/Search-v0)")
        env_kwargs = _plain(cfg.get("env_kwargs"))
        if "tokenizer" in env_kwargs:
            raise ValueError("SkyRL-Gym's step carries the policy's text, not token ids: the rlf env runs in text "
                             "mode under SkyRL (SkyRL itself keeps the engine's ids); drop env_kwargs.tokenizer")
        mode = cfg.get("observation", "messages")
        if mode not in ("messages", "raw"):
            raise ValueError(f"env_config.observation must be 'messages' or 'raw', got {mode!r}")
        self.observation_mode: ObservationMode = mode
        if "max_turns" in self.extras and "max_turns" not in env_kwargs:  # SkyRL's generator sets this
            env_kwargs["max_turns"] = int(self.extras["max_turns"])
        self.env = make_tool_env(str(env_id), **env_kwargs)
        self.max_turns = self.env.max_turns
        self._reward = 0.0

    def init(self, prompt: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        """Start an episode on the task named by the row's extras; returns rlf's prompt as chat messages."""
        spec = self.extras.get("reward_spec") or {}
        options = task_options(self.extras, list(prompt or []), spec.get("ground_truth"),
                               task_id=str(self.extras.get("uid", "skyrl")))
        seed = self.extras.get("seed")
        _, info = self.env.reset(seed=None if seed is None else int(seed), options=options)
        self.turns = 0
        self._reward = 0.0
        split = chatml_messages(self.env.trajectory.prompt)
        return split.messages, {"task_id": info["task_id"]}

    def _observations(self, text: str) -> list[dict[str, str]]:
        if not text:
            return []
        if self.observation_mode == "raw":
            return [{"role": "user", "content": text}]
        return chatml_messages(text).messages

    def step(self, action: str) -> Any:
        """One policy turn (its text) -> SkyRL's BaseTextEnvStepOutput."""
        if not isinstance(action, str):
            raise TypeError(f"SkyRL passes the policy's text to step(); got {type(action).__name__}")
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.turns += 1
        self._reward += float(reward)
        done = bool(terminated or truncated)
        meta: dict[str, Any] = {
            "turn": info["turn"], "action_kind": info["action_kind"], "tool_calls": info["tool_calls"],
            "tool_errors": info["tool_errors"], "invalid": info["invalid"], "turn_reward": info["turn_reward"],
        }
        if done:
            traj = self.env.trajectory
            meta.update(end_reason=traj.end.value, score=traj.reward, per_turn_rewards=traj.per_turn_rewards,
                        answer=traj.answer)
        return BaseTextEnvStepOutput(observations=[] if done else self._observations(obs), reward=float(reward),
                                     done=done, metadata=meta)

    def get_metrics(self) -> dict[str, Any]:
        if self.env._traj is None:
            return {}
        traj = self.env.trajectory
        return {"turns": len(traj.turns), "tool_calls": traj.num_tool_calls, "tool_errors": traj.num_tool_errors,
                "return": self._reward, "score": traj.reward, "answered": float(traj.answer is not None)}

    def close(self) -> None:
        self.env.close()


def register_skyrl(env_id: str = SKYRL_ID, **defaults: Any) -> str:
    """Register `RlfSkyRLEnv` with `skyrl_gym.register` under `env_id` (default "rlf"); `defaults` are the
    env_config keys used when a make() call gives none (e.g. `env_config={"env_id": "rlf/Search-v0"}`).
    Idempotent for the same id."""
    import skyrl_gym

    if env_id in skyrl_gym.registry:
        return env_id
    skyrl_gym.register(id=env_id, entry_point=f"{__name__}:RlfSkyRLEnv", kwargs=defaults)
    return env_id


__all__ = ["SKYRL_ID", "RlfSkyRLEnv", "register_skyrl"]
