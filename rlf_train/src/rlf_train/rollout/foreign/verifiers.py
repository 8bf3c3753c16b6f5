"""verifiers (v1, `import verifiers.v1 as vf`) environments through rlf: `rollout.environment: "verifiers:<id>"`.

`<id>` is what `vf-eval <id>` takes: a taskset id (an installed environment package exporting its `Taskset`, and
optionally its `Harness` and `Env`, via `__all__`; Hub ids `owner/name@version` install as `name`). The env is
loaded the way vf-eval loads it (`resolve_env_config` + `load_environment`), with `env.kwargs.options` as its
`[env]` config (`{taskset: {...}, agent: {harness: {id: null}}, ...}`). Each episode is its own code's
`Env.run_episode(task, ctx)` inside `Env.serving()`: its harness talks to verifiers' interception server, which
relays every model request to this episode's session on rlf's policy endpoint (`ctx.client.base_url`); the
reward is its rubric's (`Trace.reward`, the weighted sum of its `@vf.reward` functions, each kept by name).

Splits: a taskset whose config has a `split` field gets `env.train_split` / `env.eval_split` there (unless the
options set it); otherwise both splits are the options' tasks (give `env.eval_kwargs.options` for held-out ones).

What rlf sets unless the options do: the agent's runtime is `subprocess` (verifiers' default is Prime's hosted
sandboxes) and whole-episode retries are off (a retry would replay the conversation into the same session).
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from rlf_envs.types import Task
from rlf_train.config import ConfigError
from rlf_train.rollout.foreign import Backend, Episode, Outcome, require

#: verifiers' typed rollout errors that are the host's: the scorer, the tool servers, the sandbox, the
#: interception relay, the env's own hooks
INFRA_ERRORS = {"TaskError", "ToolsetError", "SandboxError", "InterceptionError", "TunnelError", "EnvError"}
#: rlf's endpoint refusing a request for a budget of the episode (rollout.max_total_tokens, agent_max_calls,
#: agent_timeout_s): the policy ran out of room, which is the episode's failure, not the host's
BUDGET = re.compile(r"context_length_exceeded|session_call_limit|session_timeout|session_closed")
MAX_TASKS = 100_000  # an infinite taskset (INFINITE = True) is read this far unless options.max_tasks says


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


class VerifiersBackend(Backend):
    ecosystem = "verifiers"

    def __init__(self, target: str, options: dict[str, Any]) -> None:
        super().__init__(target, options)
        self.vf = require("verifiers", "verifiers.v1")
        self.loaders = require("verifiers", "verifiers.v1.utils.loaders")
        self.max_tasks = int(self.options.pop("max_tasks", MAX_TASKS))
        self.envs: dict[str | None, Any] = {}
        self.by_split: dict[str | None, dict[str, Any]] = {}
        self._by_config: dict[str, Any] = {}
        self._serving: list[Any] = []

    # ------------------------------------------------------------------ loading
    def _config(self, split: str | None) -> dict[str, Any]:
        cfg = _merge({"agent": {"runtime": {"type": "subprocess"}}, "retries": {"max_retries": 0}}, self.options)
        taskset = dict(cfg.get("taskset") or {})
        taskset.setdefault("id", self.target)
        if taskset["id"] != self.target:
            raise ConfigError(f"env.kwargs.options.taskset.id {taskset['id']!r} and rollout.environment "
                              f"'verifiers:{self.target}' disagree: name the taskset once")
        try:
            fields = self.loaders.taskset_config_type(self.target).model_fields
        except ModuleNotFoundError as e:
            cause = e.__cause__
            module = self.target.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
            if isinstance(cause, ModuleNotFoundError) and cause.name and cause.name.split(".")[0] != module:
                raise ConfigError(f"rollout.environment 'verifiers:{self.target}': a package it needs is missing: "
                                  f"{cause} (install the environment's requirements)") from None
            raise ConfigError(f"rollout.environment 'verifiers:{self.target}': {e}") from None
        except ImportError as e:
            raise ConfigError(f"rollout.environment 'verifiers:{self.target}': the environment's module does not "
                              f"import, a package it needs is missing: {e}") from None
        except (TypeError, AttributeError, ValueError) as e:
            raise ConfigError(f"rollout.environment 'verifiers:{self.target}' is not a verifiers taskset: {e}"
                              ) from None
        if split is not None and "split" in fields and "split" not in taskset:
            taskset["split"] = split
        cfg["taskset"] = taskset
        if "agent" in cfg and "agent" not in self.loaders.env_config_type(self.target).model_fields:
            cfg.pop("agent")  # a multi-agent env names its roles itself
        return cfg

    def _env(self, split: str | None) -> Any:
        if split not in self.envs:
            cfg = self._config(split)
            key = json.dumps(cfg, sort_keys=True, default=str)
            if key in self._by_config:  # the same config for another split: one env, one serving context
                self.envs[split] = self._by_config[key]
                return self.envs[split]
            try:
                env = self.loaders.load_environment(self.loaders.resolve_env_config(cfg))
            except ImportError as e:
                raise ConfigError(f"rollout.environment 'verifiers:{self.target}': a package it needs is missing: "
                                  f"{e}") from None
            except ValueError as e:  # pydantic's ValidationError included: the options do not fit its config
                raise ConfigError(f"rollout.environment 'verifiers:{self.target}': env.kwargs.options do not fit "
                                  f"its config: {' '.join(str(e).split())[:1500]}") from None
            self.envs[split] = self._by_config[key] = env
        return self.envs[split]

    def tasks(self, split: str | None) -> list[Task]:
        env = self._env(split)
        ts = env.taskset if env.taskset.bounded else env.taskset.take(self.max_tasks)
        out: list[Task] = []
        table: dict[str, Any] = {}
        for k, t in enumerate(ts):
            if k >= self.max_tasks:
                break
            tid = str(t.data.id or t.key)  # the dataset's own id where it gives one (else verifiers' task key)
            if tid in table:
                tid = f"{tid}#{k}"
            table[tid] = t
            out.append(Task(id=tid, question=t.data.prompt_text, meta={"index": k, "name": t.data.name or "",
                                                                        "split": split or ""}))
        if not out:
            raise ConfigError(f"rollout.environment 'verifiers:{self.target}': its taskset gave no tasks for split "
                              f"{split!r}")
        self.by_split[split] = table
        return out

    # ------------------------------------------------------------------ running
    async def start(self) -> None:
        for env in {id(e): e for e in self.envs.values()}.values():
            cm = env.serving()
            await cm.__aenter__()
            self._serving.append(cm)

    async def close(self) -> None:
        while self._serving:
            await self._serving.pop().__aexit__(None, None, None)

    async def episode(self, ep: Episode) -> Outcome:
        vf = self.vf
        split = ep.task.meta.get("split") or None
        env = self.envs[split]
        task = self.by_split[split][ep.task.id]
        ctx = vf.ModelContext(
            model=ep.model,
            # the session is named by the URL path; verifiers reads the key from an env var, unset here ("EMPTY")
            client=vf.EvalClientConfig(base_url=ep.base_url, api_key_var="RLF_ENDPOINT_NO_KEY"),
            sampling=vf.SamplingConfig(temperature=ep.temperature, top_p=ep.top_p, max_tokens=ep.max_tokens))
        try:
            episode = await env.run_episode(task, ctx)
        finally:
            await _release_client(env, ctx.client)
        return outcome(episode)


async def _release_client(env: Any, client: Any) -> None:
    """Close the interception server's upstream client for this episode's endpoint. verifiers keeps one per distinct
    endpoint config for the server's life (a run has one endpoint); rlf's endpoint is a session URL per episode, so
    without this every episode would leave an HTTP client and its connection pool behind (~1 MB each)."""
    key = client.model_dump_json()
    for server in getattr(getattr(env, "_interception", None), "servers", None) or []:
        clients = getattr(server, "clients", None)
        got = clients.pop(key, None) if isinstance(clients, dict) else None
        if got is None:
            continue
        # ... and the server's exit callback that would close it at the end holds it alive till then: drop it
        callbacks = getattr(getattr(server, "stack", None), "_exit_callbacks", None)
        if callbacks is not None:
            for entry in [e for e in callbacks if getattr(getattr(e[1], "__wrapped__", None), "__self__", None)
                          is got]:
                callbacks.remove(entry)
        await got.close()


def _errors(episode: Any) -> list[tuple[str, str]]:
    errs = [(e.type, e.message) for e in episode.errors]
    for t in episode.traces:
        errs += [(e.type, e.message) for e in t.errors]
        errs += [(c.error.type, c.error.message) for c in t.calls if c.error is not None]
    return errs


def outcome(episode: Any) -> Outcome:
    """A verifiers `Episode` as rlf's `Outcome`: its trainable traces' rubric (mean over traces, each the weighted
    sum of its reward functions), every function's score by name, its metrics; its errors sorted into the host's
    (infra) and the policy's (an rlf budget refused a call, or a deadline)."""
    errs = _errors(episode)
    budget = next((f"{k}: {m}" for k, m in errs if BUDGET.search(m)), None)
    if budget is None and episode.is_timeout:
        budget = "the environment's episode deadline expired"
    infra = next((f"{k}: {m}" for k, m in errs if k in INFRA_ERRORS), None)
    if infra is None and budget is None and errs:
        infra = "{}: {}".format(*errs[0])  # a harness or provider failure rlf did not cause
    if infra is not None:
        return Outcome(infra_error=f"verifiers {infra}"[:2000])
    traces = [t for t in episode.traces if t.agent is None or t.agent.trainable] or list(episode.traces)
    if not traces:
        return Outcome(infra_error="verifiers: the episode produced no trace")
    scores: dict[str, float] = {}
    metrics: dict[str, float] = {}
    unscored: list[str] = []
    many = len(traces) > 1
    for t in traces:
        prefix = f"{t.agent.name}/" if many and t.agent is not None else ""
        for name, r in t.rewards.items():
            if r is None:
                unscored.append(prefix + name)
            else:
                scores[prefix + name] = r.score
        for name, v in t.metrics.items():
            if v is not None:
                metrics[prefix + name] = float(v)
        metrics[prefix + "turns"] = float(t.num_turns)
    if unscored and budget is None:
        return Outcome(infra_error=f"verifiers: reward functions were not scored: {', '.join(unscored)}")
    reward = None if unscored or not any(t.rewards for t in traces) else sum(t.reward for t in traces) / len(traces)
    info = {"stop": [t.stop_condition for t in traces]}
    return Outcome(reward=reward, scores=scores, metrics=metrics, budget_error=budget, info=info)


BACKEND = VerifiersBackend
