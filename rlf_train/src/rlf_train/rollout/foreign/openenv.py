"""OpenEnv environments through rlf: `rollout.environment: "openenv:<server>"`.

`<server>` is a running server's URL (`http://127.0.0.1:8000`), or what starts one as OpenEnv's docs say: an
environment directory (the one `openenv init` makes: its `openenv.yaml` names the app, `server.app:app`) or an app
reference (`my_env.server.app:app`); rlf then runs `python -m uvicorn <app>` on a free loopback port (from the
directory, if one was given), waits for `/health`, and stops the server (its process group) when the run ends.

Each episode is one WebSocket session (OpenEnv's `GenericEnvClient`): `reset(seed=...)`, then the policy acts
through rlf's endpoint (an OpenAI chat loop) until the env says `done` or `rollout.max_turns` replies. How a reply
becomes an action (`env.kwargs.options.mode`, detected when not given):

- `tools`: an MCP environment (`MCPEnvironment`: `list_tools` answers): its tools are the policy's tools, each call
  a `call_tool` step, the result the tool message (OpenEnv's white-box harness loop: a reply without a tool call ends
  the episode);
- `text`: the action has one required string field: each reply's text is that field, the next observation the next
  user message;
- `act`: otherwise, one tool `act` whose parameters are the action's JSON schema.

The reward is the env's: per step (`StepResult.reward`), the episode's the last one given (OpenEnv's harness rule,
`options.reward: last`) or their sum (`sum`); both are kept (`foreign/reward_last`, `foreign/reward_sum`). An action
the server refuses as invalid (its validation error) is shown to the policy as the step's observation; a server
that fails (a connection lost, an execution error, no session slot within the deadline) is an infrastructure
failure. OpenEnv environments have no dataset: the tasks are reset seeds (`options.num_tasks` for train, from 0;
`options.eval_tasks` for eval, from 1,000,000), every episode of a GRPO group on the same seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlf_envs.types import Task
from rlf_train.config import ConfigError
from rlf_train.rollout.foreign import Backend, Episode, ForeignHostFailed, Outcome, free_port, require

EVAL_SEED0 = 1_000_000
STEP_FIELDS = {"done", "reward", "metadata"}


class ServerFailed(ForeignHostFailed):
    """The OpenEnv server failed the episode (the host's failure)."""


def obs_text(obs: Any, key: str | None = None) -> str:
    """An observation as the text the policy reads: `key`'s field, else its one text field, else its JSON."""
    if not isinstance(obs, dict):
        return str(obs)
    rest = {k: v for k, v in obs.items() if k not in STEP_FIELDS}
    if key is not None:
        return str(rest.get(key, ""))
    texts = [v for v in rest.values() if isinstance(v, str) and v]
    if len(texts) == 1:
        return texts[0]
    return json.dumps(rest, sort_keys=True, default=str)


def tool_text(obs: dict[str, Any]) -> str:
    """A `call_tool` observation (CallToolObservation) as the tool message: its error, or its result's text."""
    err = obs.get("error")
    if err:
        return f"error: {err.get('message', err) if isinstance(err, dict) else err}"
    result = obs.get("result")
    if isinstance(result, dict):
        content = result.get("content")
        if isinstance(content, list):
            texts = [c.get("text", "") for c in content if isinstance(c, dict) and c.get("type") == "text"]
            if texts:
                return "\n".join(texts)
        if "data" in result and result["data"] is not None:
            return result["data"] if isinstance(result["data"], str) else json.dumps(result["data"], default=str)
    return result if isinstance(result, str) else json.dumps(result, default=str)


class OpenEnvBackend(Backend):
    ecosystem = "openenv"

    def __init__(self, target: str, options: dict[str, Any]) -> None:
        super().__init__(target, options)
        require("openenv", "openenv.core.generic_client")
        o = self.options
        known = {"mode", "reward", "num_tasks", "eval_tasks", "reset", "seed", "system_prompt", "observation_key",
                 "max_sessions", "startup_timeout_s", "step_timeout_s", "max_turns"}
        unknown = sorted(set(o) - known)
        if unknown:
            raise ConfigError(f"env.kwargs.options: {', '.join(map(repr, unknown))} are not options of the openenv "
                              f"ecosystem; known: {', '.join(sorted(known))}")
        if o.get("mode") not in (None, "tools", "text", "act"):
            raise ConfigError(f"env.kwargs.options.mode {o['mode']!r}: one of tools, text, act (or leave it unset)")
        if o.get("reward", "last") not in ("last", "sum"):
            raise ConfigError(f"env.kwargs.options.reward {o['reward']!r}: last or sum")
        self.url: str | None = target.rstrip("/") if target.startswith(("http://", "https://")) else None
        self.app, self.cwd = (None, None) if self.url else self._app_of(target)
        self.spawned = False  # rlf started the server (and stops it; a later start starts a new one)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: Any = None
        self.mode: str | None = o.get("mode")
        self.field: str | None = None
        self.action_schema: dict[str, Any] = {}
        self.sem: asyncio.Semaphore | None = None
        self.http: Any = None

    @staticmethod
    def _app_of(target: str) -> tuple[str, str | None]:
        path = Path(target).expanduser()
        if path.is_dir():
            spec = path / "openenv.yaml"
            if not spec.is_file():
                raise ConfigError(f"rollout.environment 'openenv:{target}': no openenv.yaml in that directory (an "
                                  "OpenEnv environment directory, as `openenv init` makes it)")
            import yaml

            app = (yaml.safe_load(spec.read_text()) or {}).get("app")
            if not isinstance(app, str) or ":" not in app:
                raise ConfigError(f"rollout.environment 'openenv:{target}': its openenv.yaml names no app "
                                  "('app: server.app:app')")
            return app, str(path.resolve())
        if ":" not in target or "/" in target:
            raise ConfigError(f"rollout.environment 'openenv:{target}': give a server URL (http://host:port), an "
                              "environment directory (with openenv.yaml) or an app ('package.module:app')")
        return target, None

    def tasks(self, split: str | None) -> list[Task]:
        test = split not in (None, "train")
        n = int(self.options.get("eval_tasks" if test else "num_tasks", 64 if test else 256))
        if n < 1:
            raise ConfigError("env.kwargs.options.num_tasks / eval_tasks must be >= 1")
        s0 = EVAL_SEED0 if test else 0
        return [Task(id=f"{split or 'all'}-seed{s0 + i}", question=f"reset(seed={s0 + i})",
                     meta={"seed": s0 + i, "split": split or ""}) for i in range(n)]

    # ------------------------------------------------------------------ the server
    async def start(self) -> None:
        import openai

        self.sem = asyncio.Semaphore(int(self.options.get("max_sessions", 64)))
        self.http = openai.DefaultAsyncHttpxClient(timeout=float(self.options.get("step_timeout_s", 120)))
        if self.url is None or self.spawned:
            self.spawned = True
            await asyncio.to_thread(self._spawn)
        await self._probe()

    def _spawn(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115  (kept open while the server runs; closed in close())
        env = dict(os.environ)
        if self.cwd is not None:
            env["PYTHONPATH"] = os.pathsep.join([self.cwd, str(Path(self.cwd).parent), env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen([sys.executable, "-m", "uvicorn", str(self.app), "--host", "127.0.0.1", "--port",
                                      str(port), "--log-level", "warning"], cwd=self.cwd, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        import httpx

        deadline = time.monotonic() + float(self.options.get("startup_timeout_s", 120))
        while True:
            if self.proc.poll() is not None:
                raise ServerFailed(f"the OpenEnv server ({self.app}) exited with status {self.proc.returncode} "
                                   f"before it served: {self._log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self._kill()
                raise ServerFailed(f"the OpenEnv server ({self.app}) did not answer /health within "
                                   f"{self.options.get('startup_timeout_s', 120)} s: {self._log_tail()}")
            time.sleep(0.2)

    def _log_tail(self) -> str:
        if self.log is None:
            return ""
        self.log.seek(0)
        return " ".join(self.log.read()[-2000:].decode(errors="replace").split())

    async def _probe(self) -> None:
        """The action schema (GET /schema) and, unless given, how replies become actions."""
        import httpx

        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.get(f"{self.url}/schema")
        if r.status_code >= 400:
            raise ServerFailed(f"GET {self.url}/schema answered {r.status_code}: is this an OpenEnv server?")
        self.action_schema = dict(r.json().get("action") or {})
        props = {k: v for k, v in (self.action_schema.get("properties") or {}).items() if k != "metadata"}
        required = [k for k in self.action_schema.get("required") or [] if k in props]
        strings = [k for k in required if (props[k].get("type") == "string")]
        if self.mode is None:
            tools = await self._list_tools_probe()
            self.mode = "tools" if tools else "text" if len(required) == 1 and strings else "act"
        if self.mode == "text":
            if len(strings) != 1:
                raise ConfigError(f"env.kwargs.options.mode text: the action ({self.action_schema.get('title')}) "
                                  f"has no single required string field (required: {required}); use mode: act")
            self.field = strings[0]

    async def _list_tools_probe(self) -> list[dict[str, Any]]:
        from openenv.core.generic_client import GenericEnvClient

        try:
            async with GenericEnvClient(base_url=self.url) as env:
                await env.reset()
                return await self._tools(env)
        except (RuntimeError, KeyError, TypeError):
            return []

    async def _tools(self, env: Any) -> list[dict[str, Any]]:
        r = await env.step({"type": "list_tools"})
        tools = (r.observation or {}).get("tools") or []
        return [{"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                                  "parameters": t.get("input_schema") or {"type": "object"}}}
                for t in tools]

    def _kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    async def close(self) -> None:
        try:
            if self.http is not None:
                await self.http.aclose()
        finally:
            self.http = None
            await asyncio.to_thread(self._kill)
            if self.log is not None:
                self.log.close()
                self.log = None

    # ------------------------------------------------------------------ an episode
    async def episode(self, ep: Episode) -> Outcome:
        assert self.sem is not None
        async with self.sem:
            try:
                return await self._episode(ep)
            except ServerFailed as e:
                return Outcome(infra_error=f"openenv: {e}"[:2000])
            except (TimeoutError, ConnectionError, OSError) as e:
                return Outcome(infra_error=f"openenv: the server connection failed: {type(e).__name__}: {e}"[:2000])
            except Exception as e:
                if type(e).__name__.startswith("ConnectionClosed"):  # websockets' own
                    return Outcome(infra_error=f"openenv: the server closed the session: {e}"[:2000])
                raise

    async def _open(self, ep: Episode) -> tuple[Any, Any]:
        """A session on the server and its reset observation. A full server (its `max_concurrent_envs`) refuses the
        session, or closes it: wait for a slot and try again, within the step deadline."""
        from openenv.core.generic_client import GenericEnvClient

        kw = dict(self.options.get("reset") or {})
        if self.options.get("seed", True):
            kw.setdefault("seed", int(ep.task.meta.get("seed", ep.group_seed)))
        timeout = float(self.options.get("step_timeout_s", 120))
        deadline = time.monotonic() + timeout
        while True:
            env = GenericEnvClient(base_url=self.url, message_timeout_s=timeout)
            try:
                await env.connect()
                return env, await env.reset(**kw)
            except Exception as e:
                await env.close()
                full = "CAPACITY_REACHED" in str(e) or type(e).__name__.startswith("ConnectionClosed")
                if not full or time.monotonic() > deadline:
                    if isinstance(e, RuntimeError) and "Server error" in str(e):
                        raise ServerFailed(str(e)) from e
                    raise
                await asyncio.sleep(0.05)

    async def _step(self, env: Any, action: dict[str, Any]) -> tuple[Any, str | None]:
        """(StepResult, None), or (None, the refusal) for an action the server refused as invalid (the policy's)."""
        try:
            return await env.step(action), None
        except RuntimeError as e:
            if "VALIDATION_ERROR" in str(e) or "INVALID_JSON" in str(e):
                return None, f"invalid action: {e}"
            raise ServerFailed(str(e)) from e

    async def _episode(self, ep: Episode) -> Outcome:
        import openai

        o = self.options
        max_turns = int(o.get("max_turns", ep.max_turns))
        rewards: list[float] = []
        steps = invalid = 0
        done = False
        budget: str | None = None
        llm = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key or "none", max_retries=0,
                                 http_client=self.http)
        env, first = await self._open(ep)
        try:
            tools: list[dict[str, Any]] = []
            if self.mode == "tools":
                tools = await self._tools(env)
            elif self.mode == "act":
                params = {k: v for k, v in self.action_schema.items() if k not in ("title", "description")}
                params.setdefault("type", "object")
                (params.get("properties") or {}).pop("metadata", None)
                tools = [{"type": "function", "function": {
                    "name": "act", "description": self.action_schema.get("description") or "Take an action.",
                    "parameters": params}}]
            messages: list[dict[str, Any]] = []
            if o.get("system_prompt"):
                messages.append({"role": "system", "content": str(o["system_prompt"])})
            messages.append({"role": "user", "content": obs_text(first.observation, o.get("observation_key"))})
            for _ in range(max_turns):
                try:
                    kw: dict[str, Any] = {"tools": tools} if tools else {}
                    reply = await llm.chat.completions.create(model=ep.model, messages=messages,
                                                              max_tokens=ep.max_tokens, **kw)
                except openai.APIStatusError as e:
                    if 400 <= e.status_code < 500:  # rlf's budgets (context length, calls, time): the policy's
                        budget = f"{e.status_code}: {e.message}"
                        break
                    raise ServerFailed(f"the policy endpoint failed: {e}") from e
                msg = reply.choices[0].message
                messages.append(msg.model_dump(exclude_none=True))
                if self.mode == "text":
                    result, refused = await self._step(env, {self.field: msg.content or ""})
                    steps += 1
                    if result is None:
                        invalid += 1
                        messages.append({"role": "user", "content": refused})
                        continue
                    if result.reward is not None:
                        rewards.append(float(result.reward))
                    if result.done:
                        done = True
                        break
                    messages.append({"role": "user", "content": obs_text(result.observation, o.get("observation_key"))})
                    continue
                if not msg.tool_calls:
                    break  # OpenEnv's harness loop: a reply without a tool call ends the episode
                for call in msg.tool_calls:
                    try:
                        args = json.loads(call.function.arguments or "{}")
                    except ValueError as e:
                        args, bad = None, f"invalid arguments: {e}"
                    if not isinstance(args, dict):
                        args, bad = None, "invalid arguments: not a JSON object"
                    result = refused = None
                    if args is not None:
                        action = ({"type": "call_tool", "tool_name": call.function.name, "arguments": args}
                                  if self.mode == "tools" else args)
                        result, refused = await self._step(env, action)
                    steps += 1
                    if result is None:
                        invalid += 1
                        messages.append({"role": "tool", "tool_call_id": call.id, "content": refused or bad})
                        continue
                    if result.reward is not None:
                        rewards.append(float(result.reward))
                    obs = result.observation or {}
                    content = tool_text(obs) if self.mode == "tools" else obs_text(obs, o.get("observation_key"))
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
                    if result.done:
                        done = True
                        break
                if done:
                    break
        finally:
            await env.close()
        last = rewards[-1] if rewards else None
        total = sum(rewards) if rewards else None
        reward = total if o.get("reward", "last") == "sum" else last
        scores = {} if not rewards else {"reward_last": float(last), "reward_sum": float(total)}  # type: ignore[arg-type]
        return Outcome(reward=reward, scores=scores, budget_error=budget,
                       metrics={"steps": float(steps), "done": float(done), "invalid_actions": float(invalid)},
                       info={"rewards": rewards})


BACKEND = OpenEnvBackend
