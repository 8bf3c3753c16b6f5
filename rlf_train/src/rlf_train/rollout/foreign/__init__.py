"""Environments written for other frameworks, trained as they are: `rollout.environment: "<ecosystem>:<target>"`
(docs/guides/foreign-envs.md).

    rollout.environment: "verifiers:my_taskset"          # a verifiers (v1) environment: taskset id / module
    rollout.environment: "openenv:http://127.0.0.1:8000" # a running OpenEnv server, or "openenv:pkg.server.app:app"
    rollout.environment: "nemo_gym:example_multi_step"   # a NeMo-Gym config (or resources server): its own servers

The foreign environment's own rollout and scoring code runs unchanged; its model calls go to rlf's policy
endpoint (one session per episode, `rlf_train.rollout.endpoint`), so every episode becomes token-exact GRPO
rows as with `rollout.agent`, and its reward is the foreign scorer's. Each ecosystem is one small module
(`verifiers.py`, `openenv.py`, `nemo_gym.py`) implementing `Backend`; the packages themselves are imported only
when a config names them, and a missing one is a ConfigError naming its install line.

This module is what the trainer's env factory imports (`env.imports`): it registers `rlf/Foreign-v0`, the rlf env
whose tasks are the foreign environment's dataset (the split `env.train_split` / `env.eval_split` names; the
foreign env's options in `env.kwargs.options`, eval overrides in `env.eval_kwargs.options`). The source itself
(`source.ForeignSource`) is built by `make_source`. No torch here.
"""

from __future__ import annotations

import importlib
import json
import math
import socket
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from rlf_envs.env.tool_env import ToolEnv
from rlf_envs.errors import RlfError
from rlf_envs.registration import register_env
from rlf_envs.types import Task
from rlf_train.config import FOREIGN_ENV_ID, ConfigError

#: ecosystem -> (module, what installs it)
ECOSYSTEMS: dict[str, tuple[str, str]] = {
    "verifiers": ("rlf_train.rollout.foreign.verifiers",
                  "pip install --no-deps verifiers==0.4.0, plus its requirements other than mcp and openai "
                  "(the list in tox.ini's [testenv:adapters]; verifiers pins mcp==2.0.0, openai<3, which rlf cannot "
                  "use)"),
    "openenv": ("rlf_train.rollout.foreign.openenv", "pip install 'openenv-core>=0.3,<0.4'"),
    # NeMo-Gym runs in an interpreter of its own (Python >= 3.12): nothing to import here (nemo_gym.find_interpreter)
    "nemo_gym": ("rlf_train.rollout.foreign.nemo_gym", "a Python >= 3.12 with nemo-gym, named in "
                 "env.kwargs.options.python or $RLF_NEMO_GYM_PYTHON (docs/guides/foreign-envs.md)"),
}
#: ecosystems named in the docs that have no backend yet: a ConfigError saying so, not an import error
NOT_YET: dict[str, str] = {}


def parse_spec(spec: str) -> tuple[str, str]:
    """`"<ecosystem>:<target>"` -> (ecosystem, target); a ConfigError naming `rollout.environment` otherwise."""
    eco, sep, target = spec.partition(":")
    eco = eco.strip().lower().replace("-", "_")
    if not sep or not target.strip():
        raise ConfigError(f"rollout.environment {spec!r}: give it as '<ecosystem>:<env>', ecosystem one of "
                          f"{', '.join(ECOSYSTEMS)} (e.g. 'verifiers:my_taskset', 'openenv:http://127.0.0.1:8000')")
    if eco in NOT_YET:
        raise ConfigError(f"rollout.environment {spec!r}: {NOT_YET[eco]}")
    if eco not in ECOSYSTEMS:
        raise ConfigError(f"rollout.environment {spec!r}: unknown ecosystem {eco!r}; one of {', '.join(ECOSYSTEMS)}")
    return eco, target.strip()


def free_port() -> int:
    """A free loopback TCP port (for a foreign environment's servers rlf starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def require(ecosystem: str, module: str) -> Any:
    """Import the foreign package `module`, or a ConfigError naming what installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"rollout.environment: the {ecosystem} ecosystem needs the `{module.split('.')[0]}` "
                          f"package, which is not importable here ({e}); install it: {ECOSYSTEMS[ecosystem][1]}"
                          ) from None


class ForeignHostFailed(RlfError, RuntimeError):
    """The foreign environment's host failed (its server died or did not start): the host's failure, not the
    policy's, and at start a clear error (`ForeignStartFailed`)."""


@dataclass
class Outcome:
    """How one foreign episode ended, as its own code reported it.

    `reward` is the foreign scorer's (None: it gave none; the episode then scores 0, counted in
    `foreign_no_reward`); `scores` its named parts (a verifiers rubric's functions, OpenEnv's per-step rewards),
    kept in the records (`score_info`, as `foreign/<name>`) and averaged in the metrics; `infra_error` says the
    host failed the episode (a scorer that raised or gave NaN, a server that died): the episode and its GRPO
    group leave the loss and are counted (`foreign_infra_failed`), never scored 0."""

    reward: float | None = None
    scores: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    infra_error: str | None = None
    budget_error: str | None = None  # the episode ran past rlf's budgets (tokens, calls): the policy's failure
    info: dict[str, Any] = field(default_factory=dict)

    def checked(self) -> Outcome:
        """A reward or score that is not a finite number is the scorer's failure, not a value to train on."""
        if self.infra_error is None:
            bad = [k for k, v in self.scores.items() if not _finite(v)]
            if self.reward is not None and not _finite(self.reward):
                self.infra_error = f"the foreign scorer returned a reward of {self.reward!r}"
            elif bad:
                self.infra_error = f"the foreign scorer returned non-finite scores for {', '.join(bad)}"
        return self


def _finite(v: Any) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class Episode:
    """What a backend's episode gets: the task (as `tasks` gave it), the policy endpoint's session (an
    OpenAI-compatible base URL and key, any model name accepted), the sampling rlf uses (recorded for the
    foreign code; rlf ignores what requests ask), and a seed that is the same for every episode of a GRPO group."""

    task: Task
    base_url: str
    api_key: str
    model: str
    temperature: float
    top_p: float
    max_tokens: int
    group_seed: int
    max_turns: int = 4  # rollout.max_turns: for ecosystems whose loop is rlf's (OpenEnv)


class Backend(ABC):
    """One ecosystem's way of running its environments (`verifiers.py`, `openenv.py`).

    `tasks(split)` is the foreign dataset's split as rlf Tasks (unique ids); `start` brings up what the
    environment serves (servers, its interception endpoint), `episode` runs one of its rollouts against the
    session in `Episode` and scores it with its own code, `close` ends everything `start` began. `start`,
    `episode` and `close` run on the backend's own event loop (a thread of its own: `source.ForeignSource`)."""

    ecosystem: str = ""

    def __init__(self, target: str, options: dict[str, Any]) -> None:
        self.target = target
        self.options = dict(options)

    @abstractmethod
    def tasks(self, split: str | None) -> list[Task]: ...

    async def start(self) -> None:
        return None

    @abstractmethod
    async def episode(self, ep: Episode) -> Outcome: ...

    async def close(self) -> None:
        return None


_BACKENDS: dict[str, Backend] = {}
_LOCK = threading.Lock()


def backend_for(spec: str, options: dict[str, Any] | None = None) -> Backend:
    """The backend of `spec` with `options`, made once per process (the trainer makes many envs of one config)."""
    eco, target = parse_spec(spec)
    key = json.dumps([spec, options or {}], sort_keys=True, default=str)
    with _LOCK:
        got = _BACKENDS.get(key)
        if got is None:
            mod_name, _ = ECOSYSTEMS[eco]
            cls = importlib.import_module(mod_name).BACKEND
            got = _BACKENDS[key] = cls(target, dict(options or {}))
        return got


def forget_backends() -> None:
    """Drop the per-process cache (tests, and a run that ended: its servers are closed)."""
    with _LOCK:
        _BACKENDS.clear()


class ForeignEnv(ToolEnv):
    """The rlf env of a foreign environment: its tasks are the foreign dataset's `split`; it is never stepped
    (the foreign code makes the episodes). `format` is how rlf's endpoint renders the foreign code's messages
    (qwen3: chat models, tool calls in Qwen3's template; search_r1)."""

    def __init__(self, environment: str, options: dict[str, Any] | None = None, split: str | None = None,
                 **kwargs: Any) -> None:
        self.environment = environment
        self.backend = backend_for(environment, options)
        self.split = split
        super().__init__(tasks=self.backend.tasks(split), **kwargs)

    def reset(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{FOREIGN_ENV_ID} is not stepped: its episodes are the foreign environment's own "
                           f"({self.environment}), run by the trainer's rollout source for rollout.environment "
                           "(rlf_train.rollout.foreign.source), and for `python -m rlf_train.eval` by the same source")

    async def areset(self, *args: Any, **kwargs: Any) -> Any:
        return self.reset()


register_env(FOREIGN_ENV_ID, "rlf_train.rollout.foreign:ForeignEnv")

__all__ = ["ECOSYSTEMS", "Backend", "Episode", "ForeignEnv", "Outcome", "backend_for", "parse_spec"]
