"""Building the configured env (token mode, the rollout's budgets) for either backend, without torch.

Config mistakes found here (a module of `env.imports` that does not exist, an unregistered `env.id`, an
`env.kwargs` key the env does not take, a split it refuses) raise `ConfigError` naming the key, on one line.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Sequence
from typing import Any, Literal

from rlf_envs.env.tool_env import ToolEnv
from rlf_envs.env.vector import ToolVectorEnv
from rlf_train.config import ConfigError, TrainConfig

Stage = Literal["train", "eval"]


def import_env_modules(imports: Sequence[str]) -> None:
    """Import the modules of `env.imports` (they register env ids); a missing one is a ConfigError."""
    for mod in imports:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name is None or not (mod == e.name or mod.startswith(e.name + ".")):
                raise  # the module exists but one of its own imports is missing: show the real error
            raise ConfigError(f"env.imports: no module named {mod!r}; list importable modules that register "
                              f"your env ids (e.g. rlf_envs), or install the one that provides it") from None


def _entry_point_params(env_id: str) -> set[str] | None:
    """Keyword names the env id accepts, its base classes' included where its `**kwargs` go on to them (rlf's envs
    to ToolEnv); None: not known (an env that keeps `**kwargs` for itself)."""
    from rlf_envs.registration import env_options

    return env_options(env_id)


def _one_line(e: BaseException, limit: int = 300, text: str | None = None) -> str:
    """An exception (or `text` for its message) as one short line (some messages embed a tokenizer's or a
    config's whole repr)."""
    text = " ".join((str(e) if text is None else text).split())
    return f"{type(e).__name__}: {text[:limit] + ' ...' if len(text) > limit else text}"


def make_env(cfg: TrainConfig, tokenizer: Any, stage: Stage) -> ToolEnv:
    """One unwrapped `gymnasium.make(cfg.env.id, tokenizer=..., split=..., budgets..., **cfg.env.kwargs)` for
    training or eval: `split` is `env.train_split` / `env.eval_split` (not passed when null or when the env
    takes no split), and the eval env gets `env.eval_kwargs` on top of the kwargs. `tokenizer=None` makes a
    text-mode env. The env gets the Rust `tokenizers` object behind a fast HF tokenizer (same ids, ~10x less
    per-call overhead than the transformers wrapper)."""
    import gymnasium

    import_env_modules(cfg.env.imports)
    if cfg.env.id not in gymnasium.registry:
        near = difflib.get_close_matches(cfg.env.id, list(gymnasium.registry), n=3)
        raise ConfigError(f"env.id {cfg.env.id!r} is not registered" + (f" (did you mean {', '.join(near)}?)" if near
                          else "; add the module that registers it to env.imports"))
    r = cfg.rollout
    env_tok = getattr(tokenizer, "backend_tokenizer", None) or tokenizer
    kwargs: dict[str, Any] = {"tokenizer": env_tok, "max_turns": r.max_turns,
                              "max_total_tokens": r.max_total_tokens, "max_obs_tokens": r.max_obs_tokens}
    split_key = f"env.{stage}_split"
    split = cfg.env.eval_split if stage == "eval" else cfg.env.train_split
    if split is not None:
        kwargs["split"] = split
    user = {**cfg.env.kwargs, **(cfg.env.eval_kwargs if stage == "eval" else {})}
    accepted = _entry_point_params(cfg.env.id)
    if accepted is not None:
        unknown = sorted(set(user) - accepted)
        if unknown:
            hints = {k: difflib.get_close_matches(k, sorted(accepted), n=1) for k in unknown}
            where = "env.eval_kwargs / env.kwargs" if stage == "eval" and cfg.env.eval_kwargs else "env.kwargs"
            raise ConfigError(f"{where}: " + ", ".join(
                f"{k!r} is not an option of {cfg.env.id}" + (f" (did you mean {h[0]!r}?)" if h else "")
                for k, h in hints.items()) + f"; accepted: {', '.join(sorted(accepted - set(kwargs)))}")
        if split is not None and "split" not in accepted:
            kwargs.pop("split")
    kwargs.update(user)
    try:
        env = gymnasium.make(cfg.env.id, disable_env_checker=True, **kwargs).unwrapped
    except (TypeError, ValueError, KeyError, LookupError, OSError, gymnasium.error.Error) as e:
        # the env's own check of its arguments: a config error, on one line (without the kwargs gymnasium
        # appends: they include the tokenizer's whole repr)
        msg = str(e).split(" was raised from the environment creator")[0]
        bad = re.search(r"unexpected keyword argument '(\w+)'", msg)
        if bad and bad.group(1) in user:
            raise ConfigError(f"env.kwargs: {bad.group(1)!r} is not an option of {cfg.env.id} "
                              f"({' '.join(msg.split())}); check its spelling against the env's arguments") from None
        keys = ", ".join(f"{k}={v!r}" for k, v in user.items()) or "none"
        where = f"{split_key}={split!r} or env.kwargs ({keys})" if split is not None else f"env.kwargs ({keys})"
        raise ConfigError(f"env.id {cfg.env.id!r} could not be made with {where}: {_one_line(e, text=msg)}") from None
    if not isinstance(env, ToolEnv):
        raise ConfigError(f"env.id {cfg.env.id!r} makes a {type(env).__name__}, not an rlf ToolEnv; rlf_train "
                          "steps token-mode ToolEnvs (subclass rlf_envs.ToolEnv for your own env)")
    return env


def make_envs(cfg: TrainConfig, tokenizer: Any, stage: Stage, n: int) -> ToolVectorEnv:
    """A ToolVectorEnv of `n` envs made by `make_env` for training or eval."""
    envs = [make_env(cfg, tokenizer, stage) for _ in range(n)]
    return ToolVectorEnv([(lambda e=e: e) for e in envs])


def env_tasks(env: Any) -> list[Any]:
    tasks = getattr(env, "tasks", None)
    if not tasks:
        raise ValueError("the env exposes no tasks (need env.tasks to sample prompts)")
    return list(tasks)
