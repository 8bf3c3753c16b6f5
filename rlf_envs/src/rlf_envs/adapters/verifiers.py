"""rlf envs in PrimeIntellect's `verifiers` (its current API, `verifiers.v1`): a taskset plus an in-process harness.

    vf-eval rlf_verifiers --env.taskset.env-id rlf/Search-v0 --env.agent.runtime.type subprocess \\
        -m MODEL --client.base-url http://127.0.0.1:8000/v1 -n 20 --no-push

`rlf_verifiers` (a top-level module shipped with rlf-envs: verifiers resolves a taskset id to an importable
module name, which may not contain dots) exports:

- `RlfTaskset`: the tasks of any registered rlf env id (`--env.taskset.env-id`, `--env.taskset.env-kwargs`),
  one `RlfTask` each (prompt: the task's question; the env renders its own prompt from the task).
- `RlfHarness` (the taskset's default harness): runs the rlf episode in this process: every model turn goes
  through verifiers' interception endpoint (so verifiers records it on the trace), the reply steps the rlf env
  (rlf parses the tool calls and runs them with its caller: deadlines, validation, output caps, MCP), and the
  env's observation is the next message (`rlf_envs.eval.ChatProtocol`, the same mapping as
  `python -m rlf_envs.eval`). The score is rlf's verifier's: recorded as the trace's reward `rlf`, with
  per-turn rewards summed into it (a verifiers trace takes named rewards per trace, not per turn).

What verifiers does not get: rlf's token ids and loss mask (verifiers records what its interception saw;
the chat API re-templates the conversation) and a batched step of many envs (each trace steps its own env;
their tools still run concurrently on rlf's loop). verifiers 0.4.0 pins `mcp==2.0.0` and `openai<3`, while
rlf-envs needs `mcp>=2.3`: there is no `rlf-envs[verifiers]` extra; install verifiers without its pins
(`pip install --no-deps verifiers==0.4.0` plus its other requirements, as tox -e adapters does), tested so.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from typing import Any

from pydantic import Field

from rlf_envs.adapters import require_trainer

try:
    import verifiers.v1 as vf
except ImportError:
    require_trainer("verifiers")  # raises MissingDependency saying how to install it
    raise

from rlf_envs.env.tool_env import ToolEnv
from rlf_envs.eval import ChatPolicy, ChatProtocol
from rlf_envs.registration import make_tool_env
from rlf_envs.types import Task

log = logging.getLogger(__name__)
REWARD_NAME = "rlf"


class RlfTasksetConfig(vf.TasksetConfig):
    env_id: str = "rlf/Calculator-v0"
    """Any registered rlf env id (rlf's own or an installed env package's)."""
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for gymnasium.make (text mode: no tokenizer)."""


class RlfData(vf.TaskData):
    env_id: str
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    task_index: int


class RlfTask(vf.Task[RlfData, vf.State, vf.TaskConfig]):
    @property
    def key(self) -> str:
        return f"{self.data.env_id}#{self.data.id}"


class _Envs:
    """Text-mode rlf envs by (env id, kwargs), reused across traces (one per episode in flight)."""

    def __init__(self) -> None:
        self._free: dict[str, list[ToolEnv]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(env_id: str, kwargs: dict[str, Any]) -> str:
        import json

        return json.dumps([env_id, kwargs], sort_keys=True, default=str)

    def get(self, env_id: str, kwargs: dict[str, Any]) -> ToolEnv:
        with self._lock:
            free = self._free.get(self._key(env_id, kwargs))
            if free:
                return free.pop()
        if "tokenizer" in kwargs:
            raise ValueError("the verifiers adapter drives rlf envs in text mode (verifiers speaks chat "
                             "messages): remove the tokenizer from env_kwargs")
        return make_tool_env(env_id, **kwargs)

    def put(self, env_id: str, kwargs: dict[str, Any], env: ToolEnv) -> None:
        with self._lock:
            self._free.setdefault(self._key(env_id, kwargs), []).append(env)


ENVS = _Envs()


class RlfTaskset(vf.Taskset[RlfTask, RlfTasksetConfig]):
    def load(self) -> Iterator[RlfTask]:
        env = ENVS.get(self.config.env_id, self.config.env_kwargs)
        try:
            tasks: list[Task] = list(env.tasks)
        finally:
            ENVS.put(self.config.env_id, self.config.env_kwargs, env)
        for k, t in enumerate(tasks):
            yield RlfTask(RlfData(id=t.id, name=t.id, prompt=t.question, env_id=self.config.env_id,
                                  env_kwargs=dict(self.config.env_kwargs), task_index=k), self.config.task)


class RlfHarnessConfig(vf.HarnessConfig):
    id: str = "rlf_verifiers"
    max_tokens: int = 512
    """Most tokens per model reply."""
    temperature: float | None = None
    """Sampling temperature (None: the run's sampling)."""
    request_timeout_s: float = Field(120.0, gt=0)
    """Deadline of one model request through the interception endpoint."""
    max_retries: int = Field(2, ge=0)


class RlfHarness(vf.Harness[RlfHarnessConfig]):
    """Runs one rlf episode in this process (see the module docstring)."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: Any) -> Any:
        from verifiers.v1.runtimes import ProgramResult

        if not isinstance(data, RlfData):
            data = RlfData.model_validate(data.model_dump())
        temperature = self.config.temperature
        if temperature is None:
            temperature = getattr(ctx.sampling, "temperature", None)
        policy = ChatPolicy(endpoint, ctx.model, secret, self.config.request_timeout_s, self.config.max_retries,
                            0.0 if temperature is None else float(temperature), self.config.max_tokens)
        env = ENVS.get(data.env_id, data.env_kwargs)
        try:
            await env.areset(options={"task_index": data.task_index})
            traj = env.trajectory
            if traj.task.id != data.id:
                raise ValueError(f"task {data.task_index} of {data.env_id} is {traj.task.id}, not {data.id}: "
                                 "were the env kwargs changed since the taskset loaded?")
            proto = ChatProtocol(env)
            messages = proto.initial_messages(traj)
            while True:
                reply = await policy.reply(messages, proto.tools(), proto.stop)
                _, _, terminated, truncated, _ = await env.astep(proto.action_text(reply))
                if terminated or truncated:
                    break
                messages.extend(proto.next_messages(reply, traj.turns[-1]))
            reward = float(traj.reward) + sum(t.reward for t in traj.turns)
            trace.record_reward(REWARD_NAME, reward, 1.0)
            trace.record_metrics({
                "rlf_turns": float(len(traj.turns)),
                "rlf_tool_calls": float(traj.num_tool_calls),
                "rlf_tool_errors": float(traj.num_tool_errors),
                "rlf_outcome": float(traj.reward),
            })
            trace.info["rlf_end_reason"] = traj.end.value
            trace.info["rlf_answer"] = traj.answer
        finally:
            await policy.aclose()
            ENVS.put(data.env_id, data.env_kwargs, env)
        await asyncio.sleep(0)
        return ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["RlfHarness", "RlfHarnessConfig", "RlfTask", "RlfTaskset", "RlfTasksetConfig"]
