"""rlf envs served as NeMo-Gym resources servers (no extra: see docs/integrations/nemo-gym.md; Python >= 3.12).

`RlfGymnasiumServer` is a NeMo-Gym `GymnasiumServer` (the resources-server base that pairs with NeMo-Gym's
`gymnasium_agent`): `/reset` starts an episode of any registered rlf env for the rollout's session, `/step` takes
the model's Responses-API output, steps the env and answers with `(observation, reward, terminated, truncated,
info)`. Its config (YAML, as every NeMo-Gym server's) names the env::

    rlf_search:
      resources_servers:
        rlf:
          entrypoint: <path of this file>   # or a 2-line app.py: from rlf_envs.adapters.nemo_gym import *
          domain: knowledge
          env_id: rlf/Search-v0
          env_kwargs: {max_turns: 4}

and `dataset_rows(env_id, n)` writes the JSONL rows (the prompt as `responses_create_params.input`, the task as
`task_index`) for the agent's dataset. A row may instead carry `task` (an rlf task dict) or `ground_truth`
(+ `question`).

What NeMo-Gym's protocol cannot carry: token ids (observations are strings; NeMo-Gym's model server applies the
chat template and returns the ids itself), so the rlf env runs in text mode and a tokenizer in `env_kwargs` is
refused. The observation of a ChatML format is the content of rlf's observation turn (the model server's
template wraps it back into the same turn). Per-turn rewards are per-step rewards, which `gymnasium_agent` sums
(the list is in the final step's `info["per_turn_rewards"]`). The rlf env parses tool calls from the model's
text: run the model server without a tool-call parser; `function_call` items that a parser produced anyway are
rendered back as `<tool_call>` blocks for the qwen3/hermes format (other formats: ignored, with a warning).
"""

from __future__ import annotations

import importlib
import json
import logging
from collections import OrderedDict
from typing import Any

from pydantic import Field, PrivateAttr

from rlf_envs.adapters import require_trainer
from rlf_envs.adapters.support import chatml_messages, observation_content, task_options
from rlf_envs.env.tool_env import ToolEnv
from rlf_envs.registration import make_tool_env

log = logging.getLogger(__name__)
_gym = require_trainer("nemo_gym")
_base = importlib.import_module("nemo_gym.base_resources_server")
GymnasiumServer = _gym.GymnasiumServer
extract_text = _gym.extract_text
HERMES_FORMATS = ("qwen3", "hermes")
_warned: set[str] = set()


class RlfGymnasiumServerConfig(_base.BaseResourcesServerConfig):  # type: ignore[misc, name-defined]
    """The server's YAML config: the rlf env id and kwargs; `max_sessions` caps episodes held at once (the
    least recently used unfinished one is dropped beyond it)."""

    env_id: str
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    max_sessions: int = Field(4096, ge=1)


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning("%s (logged once)", msg)


def action_text(response: Any, format_name: str) -> str:
    """The policy's turn as rlf's text: the response's output text, plus any `function_call` items rendered as
    the format's `<tool_call>` blocks (qwen3/hermes) when the model server parsed them out of the text."""
    text = extract_text(response)
    calls = [o for o in response.output if getattr(o, "type", None) == "function_call"]
    if not calls:
        return str(text)
    if format_name not in HERMES_FORMATS:
        _warn_once("calls", f"the model server returned function_call items but the rlf env's format is "
                            f"{format_name!r}, which parses its own tags from the text: the items are ignored; run "
                            "the model server without a tool-call parser")
        return str(text)
    blocks = []
    for c in calls:
        try:
            args = json.loads(c.arguments) if c.arguments.strip() else {}
        except json.JSONDecodeError:
            args = c.arguments  # rlf's parser reports it as an invalid call, as it would the raw text
        blocks.append("<tool_call>\n" + json.dumps({"name": c.name, "arguments": args}, ensure_ascii=False)
                      + "\n</tool_call>")
    return str(text) + ("\n" if text else "") + "\n".join(blocks)


class RlfGymnasiumServer(GymnasiumServer):  # type: ignore[misc, valid-type]
    """Any rlf env as a NeMo-Gym GymnasiumServer (see the module docstring); one rlf env per rollout session."""

    config: RlfGymnasiumServerConfig
    _envs: OrderedDict[str, ToolEnv] = PrivateAttr(default_factory=OrderedDict)
    _idle: list[ToolEnv] = PrivateAttr(default_factory=list)

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        if "tokenizer" in self.config.env_kwargs:
            raise ValueError("NeMo-Gym's env protocol carries text observations (its model server tokenises): the "
                             "rlf env runs in text mode; drop env_kwargs.tokenizer")
        self._idle.append(make_tool_env(self.config.env_id, **self.config.env_kwargs))  # a bad id fails at start

    def _env(self, session_id: str | None, create: bool) -> ToolEnv:
        key = session_id or ""
        env = self._envs.get(key)
        if env is not None:
            self._envs.move_to_end(key)
            return env
        if not create:
            raise ValueError("no episode for this session: POST /reset first (with the session's cookies)")
        env = self._idle.pop() if self._idle else make_tool_env(self.config.env_id, **self.config.env_kwargs)
        self._envs[key] = env
        while len(self._envs) > self.config.max_sessions:
            _, old = self._envs.popitem(last=False)
            old.close()
            self._idle.append(old)
        return env

    async def reset(self, metadata: dict[str, Any], session_id: str | None = None) -> tuple[str | None, dict]:  # type: ignore[type-arg]
        question = metadata.get("question")
        options = task_options(metadata, [{"role": "user", "content": str(question or "")}],
                               metadata.get("ground_truth"), task_id=str(metadata.get("id", session_id or "row")))
        env = self._env(session_id, create=True)
        _, info = await env.areset(seed=metadata.get("seed"), options=options)
        return None, {"task_id": info["task_id"]}

    async def step(self, action: Any, metadata: dict[str, Any],
                   session_id: str | None = None) -> tuple[str | None, float, bool, bool, dict]:  # type: ignore[type-arg]
        env = self._env(session_id, create=False)
        obs, reward, terminated, truncated, info = await env.astep(action_text(action, env.format.name))
        out: dict[str, Any] = {k: info[k] for k in ("turn", "action_kind", "tool_calls", "tool_errors", "invalid",
                                                    "turn_reward")}
        if terminated or truncated:
            traj = env.trajectory
            out.update(end_reason=traj.end.value, score=traj.reward, per_turn_rewards=traj.per_turn_rewards,
                       answer=traj.answer)
            return None, float(reward), bool(terminated), bool(truncated), out
        return observation_content(str(obs)) or None, float(reward), False, False, out

    async def close_session(self, session_id: str | None) -> None:
        await super().close_session(session_id)
        env = self._envs.pop(session_id or "", None)
        if env is not None:
            env.close()
            self._idle.append(env)


def dataset_rows(env_id: str, n: int | None = None, **env_kwargs: Any) -> list[dict[str, Any]]:
    """NeMo-Gym JSONL rows for the first `n` tasks of an rlf env (all if None): the rendered prompt as chat
    messages in `responses_create_params.input`, the task as `task_index` (what `/reset` reads)."""
    env = make_tool_env(env_id, **env_kwargs)
    rows = []
    try:
        for k in range(len(env.tasks) if n is None else min(n, len(env.tasks))):
            env.reset(options={"task_index": k})
            rows.append({"responses_create_params": {"input": chatml_messages(env.trajectory.prompt).messages},
                         "task_index": k})
    finally:
        env.close()
    return rows


__all__ = ["RlfGymnasiumServer", "RlfGymnasiumServerConfig", "action_text", "dataset_rows"]

if __name__ == "__main__":  # NeMo-Gym's `entrypoint`: ng_run starts the server from its YAML config
    RlfGymnasiumServer.run_webserver()
