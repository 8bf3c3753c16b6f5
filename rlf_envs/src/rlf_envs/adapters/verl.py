"""rlf envs as a verl agent loop (`pip install -e './rlf_envs[verl]'`): `RlfAgentLoop`, registered as "rlf_agent".

verl runs one agent loop per dataset row (`agent_name` column) on its AgentLoopWorker; the loop calls the
rollout server manager's `generate(request_id, prompt_ids=..., sampling_params=...)` (token ids in, `TokenOutput`
with token ids and logprobs out) and returns an `AgentLoopOutput`. This loop runs the rlf env in token mode with
verl's tokenizer: the prompt ids are the env's, each generation's ids go to the env as the action, the env's
observation ids are appended, and nothing is re-tokenised; `response_mask` is rlf's loss mask.

Configure it with an agent-loop file (`actor_rollout_ref.rollout.agent.agent_loop_config_path`)::

    - name: rlf_agent
      _target_: rlf_envs.adapters.verl.RlfAgentLoop
      env_id: rlf/Search-v0
      env_kwargs: {max_turns: 4}

or import this module (which registers "rlf_agent") and give `env_id`/`env_kwargs` in each row's `extra_info`.
A row picks its task with `extra_info.task` (an rlf task dict) / `extra_info.task_index`, or verl's own
`reward_model.ground_truth` with the row's `raw_prompt` messages.

What verl cannot carry: `AgentLoopOutput.reward_score` is one number placed on the last token, so per-turn
rewards are summed into it (a warning says so once; they are kept in `extra_fields["turn_scores"]`). The
trajectory is capped at `prompt_length` + `response_length` tokens through the env's own token budget (the
episode ends truncated), never by cutting the sequence; a prompt longer than `prompt_length` is an error, not
left-truncated.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any
from uuid import uuid4

from rlf_envs.adapters import require_trainer
from rlf_envs.adapters.support import task_options
from rlf_envs.env.episodes import Generation, TokenEpisode, run_token_episode
from rlf_envs.env.tool_env import ToolEnv
from rlf_envs.registration import make_tool_env

log = logging.getLogger(__name__)
AGENT_NAME = "rlf_agent"

_agent_loop = require_trainer("verl")
AgentLoopBase = _agent_loop.AgentLoopBase
AgentLoopOutput = _agent_loop.AgentLoopOutput
_warned: set[str] = set()


class _EnvPool:
    """Idle envs per (env id, kwargs, tokenizer): verl makes one agent loop object per row, the envs outlive it."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, str, int], list[ToolEnv]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(env_id: str, env_kwargs: Mapping[str, Any], tokenizer: Any) -> tuple[str, str, int]:
        return env_id, json.dumps(env_kwargs, sort_keys=True, default=repr), id(tokenizer)

    def take(self, env_id: str, env_kwargs: Mapping[str, Any], tokenizer: Any) -> ToolEnv:
        with self._lock:
            idle = self._idle.get(self.key(env_id, env_kwargs, tokenizer))
            if idle:
                return idle.pop()
        return make_tool_env(env_id, tokenizer=tokenizer, **env_kwargs)

    def give(self, env: ToolEnv, env_id: str, env_kwargs: Mapping[str, Any], tokenizer: Any, budget: int) -> None:
        env.max_total_tokens = budget  # undo this episode's cap
        with self._lock:
            self._idle.setdefault(self.key(env_id, env_kwargs, tokenizer), []).append(env)


POOL = _EnvPool()


def _plain(x: Any) -> Any:
    """OmegaConf containers (verl's configs) and numpy values (parquet rows) as plain Python."""
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(x):
            return OmegaConf.to_container(x, resolve=True)
    except ImportError:
        pass
    return x.tolist() if hasattr(x, "tolist") else x


def num_chat_turns(episode: TokenEpisode) -> int:
    """verl's `num_turns`: chat messages (the user prompt, each assistant turn, each observation)."""
    traj = episode.trajectory
    obs = sum(1 for t in traj.turns if t.observation_span is not None) if traj is not None else 0
    return 1 + episode.turns + obs


@_agent_loop.register(AGENT_NAME)
class RlfAgentLoop(AgentLoopBase):  # type: ignore[misc, valid-type]
    """verl agent loop over any registered rlf env id (see the module docstring)."""

    def __init__(self, *args: Any, env_id: str | None = None, env_kwargs: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        kwargs.pop("name", None)  # the agent-loop file's own key, passed along by hydra
        super().__init__(*args, **kwargs)
        self.env_id = env_id
        self.env_kwargs = dict(_plain(env_kwargs) or {})
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.response_length = int(self.rollout_config.response_length)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        extra = dict(_plain(kwargs.get("extra_info")) or {})
        env_id = extra.get("env_id") or self.env_id
        if not env_id:
            raise ValueError("RlfAgentLoop needs an rlf env id: `env_id` in the agent-loop config entry or in the "
                             "row's extra_info (e.g. rlf/Search-v0)")
        env_kwargs = {**self.env_kwargs, **dict(_plain(extra.get("env_kwargs")) or {})}
        if "tokenizer" in env_kwargs:
            raise ValueError("RlfAgentLoop gives the env verl's own tokenizer; drop env_kwargs.tokenizer")
        prompt = [dict(m) for m in _plain(kwargs.get("raw_prompt")) or []]
        reward_model = dict(_plain(kwargs.get("reward_model")) or {})
        options = task_options(extra, prompt, reward_model.get("ground_truth"),
                               task_id=str(extra.get("index", "row")))
        env = POOL.take(str(env_id), env_kwargs, self.tokenizer)
        budget = env.max_total_tokens
        request_id = uuid4().hex
        timing = {"generate": 0.0}
        stop_strings = [s for s in env.format.stop_strings if s]
        n_prompt: list[int] = []

        async def generate(context: list[int], max_tokens: int, stop: list[str]) -> Generation:
            if not n_prompt:  # first turn: the context is the env's prompt; cap the episode at verl's lengths
                if len(context) > self.prompt_length:
                    raise ValueError(f"the rlf prompt has {len(context)} tokens, more than verl's "
                                     f"rollout.prompt_length ({self.prompt_length}); raise prompt_length (rlf never "
                                     "truncates a prompt)")
                n_prompt.append(len(context))
                env.max_total_tokens = min(budget, len(context) + self.response_length)
            params = dict(sampling_params)
            params["max_tokens"] = max(1, min(max_tokens, env.max_total_tokens - len(context)))
            if stop_strings and "stop" not in params:
                params.update(stop=stop_strings, include_stop_str_in_output=True)
            t0 = time.perf_counter()
            out = await self.server_manager.generate(request_id=request_id, prompt_ids=context,
                                                     sampling_params=params)
            timing["generate"] += time.perf_counter() - t0
            return Generation(ids=list(out.token_ids), logprobs=out.log_probs or None,
                              finish_reason=getattr(out, "stop_reason", None))

        try:
            ep = await run_token_episode(env, generate, options=options, max_tokens_per_turn=self.response_length)
        finally:
            POOL.give(env, str(env_id), env_kwargs, self.tokenizer, budget)
        return self._output(ep, timing["generate"])

    def _output(self, ep: TokenEpisode, generate_s: float) -> Any:
        if any(ep.per_turn_rewards) and "per_turn" not in _warned:
            _warned.add("per_turn")
            log.warning("verl puts one reward_score on an episode's last token: rlf's per-turn rewards are summed "
                        "into it (each is kept in extra_fields['turn_scores']); logged once")
        traj = ep.trajectory
        tool_s = sum(t.stats.tool_seconds for t in traj.turns) if traj is not None else 0.0
        return AgentLoopOutput(
            prompt_ids=ep.prompt_ids,
            response_ids=ep.completion_ids,
            response_mask=ep.env_mask,
            response_logprobs=ep.logprobs,
            reward_score=ep.reward,
            num_turns=num_chat_turns(ep),
            metrics={"generate_sequences": generate_s, "tool_calls": tool_s},
            extra_fields={"turn_scores": list(ep.per_turn_rewards), "tool_rewards": [],
                          "rlf_outcome": ep.outcome, "rlf_end_reason": ep.end_reason, **{
                              f"rlf_{k}": v for k, v in ep.metrics().items()}},
        )


__all__ = ["AGENT_NAME", "POOL", "RlfAgentLoop", "num_chat_turns"]
