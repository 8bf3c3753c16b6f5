"""Building the configured env (token mode, the rollout's budgets) for either backend, without torch."""

from __future__ import annotations

import importlib
from typing import Any, Literal

from rlf_envs.env.tool_env import ToolEnv
from rlf_train.config import TrainConfig

Stage = Literal["train", "eval"]


def make_env(cfg: TrainConfig, tokenizer: Any, stage: Stage) -> ToolEnv:
    """One unwrapped `gymnasium.make(cfg.env.id, tokenizer=..., split=..., budgets..., **cfg.env.kwargs)` for
    training or eval: `split` is `env.train_split` / `env.eval_split` (not passed when null), and the eval env
    gets `env.eval_kwargs` on top of the kwargs. `tokenizer=None` makes a text-mode env.

    The env gets the Rust `tokenizers` object behind a fast HF tokenizer (same ids, ~10x less per-call
    overhead than the transformers wrapper)."""
    import gymnasium

    for mod in cfg.env.imports:
        try:
            importlib.import_module(mod)
        except ImportError as e:
            raise ValueError(f"env.imports: cannot import {mod!r} ({e}); list modules that register your env ids "
                             "and are installed here") from None
    r = cfg.rollout
    env_tok = getattr(tokenizer, "backend_tokenizer", None) or tokenizer
    kwargs: dict[str, Any] = {"tokenizer": env_tok, "max_turns": r.max_turns,
                              "max_total_tokens": r.max_total_tokens, "max_obs_tokens": r.max_obs_tokens}
    split = cfg.env.eval_split if stage == "eval" else cfg.env.train_split
    if split is not None:
        kwargs["split"] = split
    kwargs.update(cfg.env.kwargs)
    if stage == "eval":
        kwargs.update(cfg.env.eval_kwargs)
    try:
        env = gymnasium.make(cfg.env.id, disable_env_checker=True, **kwargs).unwrapped
    except gymnasium.error.Error as e:
        raise ValueError(f"env.id {cfg.env.id!r}: {e}") from None
    if not isinstance(env, ToolEnv):
        raise ValueError(f"env.id {cfg.env.id!r} makes a {type(env).__name__}, not an rlf ToolEnv; rlf_train "
                         "steps token-mode ToolEnvs (subclass rlf_envs.ToolEnv for your own env)")
    return env
