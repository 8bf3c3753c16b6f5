"""rlf envs served as OpenEnv environments (`pip install -e './rlf_envs[openenv]'`).

    from rlf_envs.adapters.openenv import RlfEnvClient, create_rlf_app

    app = create_rlf_app("rlf/Search-v0", max_concurrent_envs=64)   # a FastAPI app: uvicorn.run(app, port=8000)
    python -m rlf_envs.adapters.openenv --env rlf/Search-v0 --port 8000   # the same, from the shell

    with RlfEnvClient(base_url="http://127.0.0.1:8000").sync() as client:   # OpenEnv's WebSocket session
        r = client.reset(task_index=0)      # r.observation.text / .messages / .token_ids
        r = client.step(RlfAction(text="<answer>42</answer>"))   # r.reward, r.done

`RlfEnvironment` is an OpenEnv `Environment` (`reset`/`step`/`state`, async twins) over any registered rlf env
id; each OpenEnv session gets its own rlf env (they share one toolbox, so `SUPPORTS_CONCURRENT_SESSIONS`).

What is kept: everything. Give the server a tokenizer (`create_rlf_app(..., tokenizer=tok)`, or
`--tokenizer tokenizer.json`) and the env runs in token mode: actions may be token ids, observations carry the
exact observation ids (`token_ids`), and `state` returns the whole trajectory's ids and loss mask. Rewards are
per step (the turn's reward; the verifier's score added on the last step). A turn's tool calls run
concurrently; MCP servers in the env kwargs work as in rlf. Observations also come as text and as chat
messages (`messages`) for clients that template themselves.
"""

from __future__ import annotations

import argparse
import importlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import Field

from rlf_envs.adapters import require_trainer
from rlf_envs.adapters.support import chatml_messages
from rlf_envs.env.episodes import obs_ids
from rlf_envs.env.tool_env import ToolEnv
from rlf_envs.registration import make_tool_env

_server = require_trainer("openenv")
_client = importlib.import_module("openenv.core.env_client")
_types = importlib.import_module("openenv.core.client_types")


class RlfAction(_server.Action):  # type: ignore[misc, name-defined]
    """One policy turn: its text, or (token-mode server) its token ids. Exactly one of the two."""

    text: str | None = None
    token_ids: list[int] | None = None


class RlfObservation(_server.Observation):  # type: ignore[misc, name-defined]
    """What the env answers: `text` (rlf's observation text: the prompt after reset), `messages` (the same as
    chat messages), `token_ids` (token-mode server: the exact new context ids), and step info."""

    text: str = ""
    messages: list[dict[str, str]] = Field(default_factory=list)
    token_ids: list[int] | None = None
    task_id: str = ""
    turn: int = 0
    info: dict[str, Any] = Field(default_factory=dict)


class RlfState(_server.State):  # type: ignore[misc, name-defined]
    """The episode so far: task, turns, end reason, per-turn rewards and (token mode) the trajectory's exact ids
    and loss mask."""

    task_id: str = ""
    turns: int = 0
    done: bool = True
    end_reason: str = "running"
    answer: str | None = None
    score: float = 0.0
    per_turn_rewards: list[float] = Field(default_factory=list)
    token_ids: list[int] | None = None
    loss_mask: list[int] | None = None


def _ids(obs: Any) -> list[int] | None:
    return None if isinstance(obs, str) else obs_ids(obs)


class RlfEnvironment(_server.Environment):  # type: ignore[misc, name-defined]
    """Any rlf env as an OpenEnv `Environment` (one per session)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, env: ToolEnv, release: Callable[[ToolEnv], None] | None = None) -> None:
        super().__init__()
        self.env = env
        self._release = release
        self._episode_id: str | None = None
        self._steps = 0

    # -- OpenEnv API -------------------------------------------------------------------------------
    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> RlfObservation:
        obs, info = self.env.reset(seed=seed, options=self._options(kwargs))
        return self._start(obs, info, episode_id)

    async def reset_async(self, seed: int | None = None, episode_id: str | None = None,
                          **kwargs: Any) -> RlfObservation:
        obs, info = await self.env.areset(seed=seed, options=self._options(kwargs))
        return self._start(obs, info, episode_id)

    def step(self, action: RlfAction, timeout_s: float | None = None, **kwargs: Any) -> RlfObservation:
        return self._observation(self.env.step(self._action(action)))

    async def step_async(self, action: RlfAction, timeout_s: float | None = None, **kwargs: Any) -> RlfObservation:
        return self._observation(await self.env.astep(self._action(action)))

    @property
    def state(self) -> RlfState:
        if self.env._traj is None:
            return RlfState(episode_id=self._episode_id, step_count=0)
        traj = self.env.trajectory
        return RlfState(episode_id=self._episode_id, step_count=self._steps, task_id=traj.task.id,
                        turns=len(traj.turns), done=self.env.done, end_reason=traj.end.value, answer=traj.answer,
                        score=traj.reward, per_turn_rewards=traj.per_turn_rewards,
                        token_ids=None if traj.token_ids is None else list(traj.token_ids),
                        loss_mask=None if traj.loss_mask is None else list(traj.loss_mask))

    def close(self) -> None:
        """OpenEnv closes a session's environment when the session ends: the rlf env goes back to the factory's
        pool (sessions come and go with connections; an rlf env costs its task list and toolbox to build)."""
        self.env.close()
        release, self._release = self._release, None
        if release is not None:
            release(self.env)

    # -- helpers -----------------------------------------------------------------------------------
    @staticmethod
    def _options(kwargs: dict[str, Any]) -> dict[str, Any] | None:
        unknown = set(kwargs) - {"task", "task_index"}
        if unknown:
            raise ValueError(f"unknown reset parameters {sorted(unknown)}: rlf envs take task (an rlf task dict) "
                             "or task_index")
        return {k: kwargs[k] for k in ("task", "task_index") if kwargs.get(k) is not None} or None

    def _action(self, action: RlfAction) -> Any:
        if (action.text is None) == (action.token_ids is None):
            raise ValueError("an RlfAction has exactly one of text or token_ids")
        if action.token_ids is not None:
            if not self.env.token_mode:
                raise ValueError("token_ids actions need a token-mode server: create_rlf_app(..., tokenizer=...)")
            return list(action.token_ids)
        if self.env.token_mode:
            raise ValueError("this server runs the env in token mode: send token_ids (re-encoding the policy's "
                             "text would break the exact trajectory)")
        return action.text

    def _start(self, obs: Any, info: dict[str, Any], episode_id: str | None) -> RlfObservation:
        self._episode_id, self._steps = episode_id, 0
        text = self.env.trajectory.prompt
        return RlfObservation(text=text, messages=chatml_messages(text).messages, token_ids=_ids(obs),
                              task_id=info["task_id"], turn=0, done=False, reward=None)

    def _observation(self, result: Any) -> RlfObservation:
        obs, reward, terminated, truncated, info = result
        self._steps += 1
        done = bool(terminated or truncated)
        traj = self.env.trajectory
        text = traj.turns[-1].observation
        out = {k: info[k] for k in ("action_kind", "tool_calls", "tool_errors", "invalid", "turn_reward")}
        if done:
            out.update(end_reason=traj.end.value, score=traj.reward, per_turn_rewards=traj.per_turn_rewards,
                       answer=traj.answer, terminated=bool(terminated), truncated=bool(truncated))
        return RlfObservation(text=text, messages=chatml_messages(text).messages if text else [], token_ids=_ids(obs),
                              task_id=traj.task.id, turn=info["turn"], info=out, done=done, reward=float(reward))


def environment_factory(env_id: str, tokenizer: Any = None, **env_kwargs: Any) -> Callable[[], RlfEnvironment]:
    """The factory OpenEnv's server calls once per session (in its executor threads): an rlf env of `env_id`,
    reused from earlier sessions when one is free. Envs are built one at a time (building one in several threads
    at once is not safe: CPython 3.11's `ast.parse`, used by rlf/Calculator-v0's task generator, can fail with
    "AST constructor recursion depth mismatch" when run concurrently)."""
    lock = threading.Lock()
    idle = [make_tool_env(env_id, tokenizer=tokenizer, **env_kwargs)]  # a bad id or kwargs fails here

    def release(env: ToolEnv) -> None:
        with lock:
            idle.append(env)

    def factory() -> RlfEnvironment:
        with lock:
            env = idle.pop() if idle else make_tool_env(env_id, tokenizer=tokenizer, **env_kwargs)
        return RlfEnvironment(env, release)

    return factory


def create_rlf_app(env_id: str, *, tokenizer: Any = None, max_concurrent_envs: int = 64, **env_kwargs: Any) -> Any:
    """OpenEnv's FastAPI app (`create_app`) serving `env_id` (any registered rlf id; `env_kwargs` as for
    gymnasium.make). A tokenizer puts every session's env in token mode."""
    return _server.create_app(environment_factory(env_id, tokenizer, **env_kwargs), RlfAction, RlfObservation,
                              env_name=env_id.replace("/", "_"), max_concurrent_envs=max_concurrent_envs)


class RlfEnvClient(_client.EnvClient[RlfAction, RlfObservation, RlfState]):  # type: ignore[misc, name-defined]
    """OpenEnv's WebSocket client typed for rlf servers (`RlfEnvClient(base_url=...).sync()` for sync code)."""

    def _step_payload(self, action: RlfAction) -> dict[str, Any]:
        return action.model_dump(exclude_none=True, exclude={"metadata"})

    def _parse_result(self, payload: dict[str, Any]) -> Any:
        obs = RlfObservation(**payload.get("observation", {}), done=bool(payload.get("done", False)),
                             reward=payload.get("reward"))
        return _types.StepResult(observation=obs, reward=payload.get("reward"), done=bool(payload.get("done", False)))

    def _parse_state(self, payload: dict[str, Any]) -> RlfState:
        return RlfState(**payload)


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m rlf_envs.adapters.openenv --env rlf/Search-v0 --port 8000 [--tokenizer tokenizer.json]`"""
    import json

    p = argparse.ArgumentParser(description="serve an rlf env as an OpenEnv environment server")
    p.add_argument("--env", required=True, help="a registered rlf env id, e.g. rlf/Search-v0")
    p.add_argument("--env-kwargs", default="{}", help="JSON object of env kwargs (as for gymnasium.make)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json: serve the env in token mode")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-concurrent-envs", type=int, default=64)
    a = p.parse_args(argv)
    kwargs = json.loads(a.env_kwargs)
    if not isinstance(kwargs, dict):
        p.error("--env-kwargs must be a JSON object")
    tok = None
    if a.tokenizer:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(a.tokenizer)
    import uvicorn

    uvicorn.run(create_rlf_app(a.env, tokenizer=tok, max_concurrent_envs=a.max_concurrent_envs, **kwargs),
                host=a.host, port=a.port)


if __name__ == "__main__":
    main()


__all__ = ["RlfAction", "RlfEnvClient", "RlfEnvironment", "RlfObservation", "RlfState", "create_rlf_app",
           "environment_factory", "main"]
