"""Token-mode episodes of any rlf env, driven by a trainer's generate function: the trainer-env contract.

Every trainer drives rlf envs through here: rlf_train's rollouts (local sampler and vLLM), its OpenRLHF
executor, and the adapters of other trainers (`rlf_envs.adapters`).

A trainer brings a generate function; rlf brings the env. Per turn the function continues each active
episode's exact context ids (the env's prompt ids, then every action and observation id so far) and the
generated ids go to the env as the action; the env's observation ids are appended. Nothing is re-tokenised:
the sequence returned is `env.trajectory.token_ids`, its mask is `env.trajectory.loss_mask`.

Many episodes run in lock-step on one event loop: each turn asks for every active episode's generation at
once (concurrent calls of `generate`, or one call of `generate_batch`), then steps every active env in one
`ToolVectorEnv.astep_active` (all their tool calls concurrently).

    from rlf_envs.env.episodes import Generation, run_token_episodes
    from rlf_envs.registration import make_tool_env

    async def generate(context: list[int], max_tokens: int, stop: list[str]) -> Generation:
        ...  # any engine: vLLM, an HTTP server, a torch model
        return Generation(ids=new_ids, logprobs=new_logprobs)

    envs = [make_tool_env("rlf/Search-v0", tokenizer=tok) for _ in range(8)]
    episodes = await run_token_episodes(envs, generate, options=[{"task_index": k} for k in range(8)])
    episodes[0].completion_ids, episodes[0].env_mask, episodes[0].reward
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from rlf_envs.env.tool_env import ToolEnv
from rlf_envs.env.vector import StepResult, ToolVectorEnv
from rlf_envs.types import EndReason, Trajectory

__all__ = [
    "ENV_ERROR", "MAX_LENGTH", "DriveStats", "GenerateBatchFn", "GenerateFn", "Generation", "TokenEpisode",
    "obs_ids", "run_token_episode", "run_token_episodes", "run_token_episodes_sync",
]

log = logging.getLogger(__name__)

#: end reasons beyond rlf's EndReason: the sequence reached the caller's `max_length` before the env ended,
#: or the env raised (a bug in an env; rlf's own never raise from a step)
MAX_LENGTH = "max_length"
ENV_ERROR = "env_error"


@dataclass(frozen=True, slots=True)
class Generation:
    """What a generate function returns for one context: the new token ids (stop string included, as the
    env must see the whole action), their log-probs under the sampling policy (None if unknown), and why
    generation stopped ("stop", "length", ... or None)."""

    ids: Sequence[int]
    logprobs: Sequence[float] | None = None
    finish_reason: str | None = None


class GenerateFn(Protocol):
    """`await generate(context_ids, max_tokens, stop_strings) -> Generation` for one context."""

    def __call__(self, context: list[int], max_tokens: int, stop: list[str]) -> Awaitable[Generation]: ...


class GenerateBatchFn(Protocol):
    """`await generate_batch(contexts, max_tokens, stop_strings) -> [Generation, ...]`, one per context (in
    order): for engines that batch themselves (an in-process model)."""

    def __call__(
        self, contexts: list[list[int]], max_tokens: list[int], stop: list[str]
    ) -> Awaitable[Sequence[Generation]]: ...


@dataclass(slots=True)
class TokenEpisode:
    """One finished episode, token exact.

    `completion_ids` is everything after the prompt (actions and observations, in order); `env_mask` is 1 on
    the policy's tokens and 0 on the env's (rlf's loss mask); `logprobs` is aligned with `completion_ids`
    (0.0 on observation tokens; None if the generate function gave none). `reward` = `outcome` (the
    verifier's score) + the sum of `per_turn_rewards` (the env's process rewards, verifier per-turn values
    included)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    env_mask: list[int]
    logprobs: list[float] | None
    outcome: float
    per_turn_rewards: list[float]
    turns: int
    end_reason: str  # an EndReason value, MAX_LENGTH or ENV_ERROR
    task_id: str
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    invalid_turns: int = 0
    length_stops: int = 0  # turns the generate function ended with finish_reason "length"
    finish_reason: str | None = None  # the generate function's finish_reason of the last turn
    error: str | None = None  # ENV_ERROR: what the env raised
    trajectory: Trajectory | None = field(default=None, repr=False)

    @property
    def reward(self) -> float:
        return 0.0 if self.error is not None else self.outcome + sum(self.per_turn_rewards)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def metrics(self) -> dict[str, float]:
        """Scalars for a trainer's logs."""
        return {
            "turns": float(self.turns),
            "tool_calls": float(self.tool_calls),
            "tool_errors": float(self.tool_errors),
            "tool_timeouts": float(self.tool_timeouts),
            "invalid_turns": float(self.invalid_turns),
            "length_stops": float(self.length_stops),
            "end_answer": float(self.end_reason == EndReason.ANSWER.value),
            "env_error": float(self.error is not None),
        }


@dataclass(slots=True)
class DriveStats:
    """Where a `run_token_episodes` call spent its time (pass one in as `stats=`; it is added to):
    `gen_seconds` in the generate function(s), `env_seconds` in env resets and steps, `gen_tokens` the
    generated ids, `turns` the generations asked for (one per active episode per turn)."""

    gen_seconds: float = 0.0
    env_seconds: float = 0.0
    gen_tokens: int = 0
    turns: int = 0


def obs_ids(obs: Any) -> list[int]:
    """A token-mode observation (numpy array or sequence of ids) as a list of Python ints."""
    return obs.astype(np.int64).tolist() if isinstance(obs, np.ndarray) else [int(x) for x in obs]



def _episode(env: ToolEnv, n_prompt: int, logprobs: list[float] | None, length_stops: int,
             end: str | None, error: str | None, finish: str | None = None) -> TokenEpisode:
    traj = env.trajectory
    ids = list(traj.token_ids or [])
    mask = list(traj.loss_mask or [])
    if logprobs is not None:  # after an env error the env was rewound: align to what it holds
        logprobs = (logprobs + [0.0] * len(ids))[n_prompt: len(ids)]
    turns = traj.turns
    return TokenEpisode(
        prompt_ids=ids[:n_prompt], completion_ids=ids[n_prompt:], env_mask=mask[n_prompt:], logprobs=logprobs,
        outcome=float(traj.reward), per_turn_rewards=[float(t.reward) for t in turns], turns=len(turns),
        end_reason=end or traj.end.value, task_id=traj.task.id, tool_calls=traj.num_tool_calls,
        tool_errors=traj.num_tool_errors, tool_timeouts=sum(t.stats.timeouts for t in turns),
        invalid_turns=sum(t.stats.invalid for t in turns), length_stops=length_stops, finish_reason=finish,
        error=error, trajectory=traj,
    )


class _OneEnv:
    """One env stepped through its own `areset`/`astep` (what `ToolVectorEnv` offers the driver, without
    building one per episode)."""

    def __init__(self, env: ToolEnv) -> None:
        self.envs = [env]
        self.num_envs = 1

    async def areset_envs(self, options: dict[int, dict[str, Any] | None],
                          seeds: dict[int, int | None] | None = None) -> dict[int, tuple[Any, dict[str, Any]]]:
        return {0: await self.envs[0].areset(seed=(seeds or {}).get(0), options=options[0])}

    async def astep_active(self, actions: dict[int, list[int]]) -> dict[int, StepResult]:
        return {0: StepResult(*await self.envs[0].astep(actions[0]))}


def _as_vector(envs: ToolVectorEnv | Sequence[ToolEnv]) -> ToolVectorEnv | _OneEnv:
    if isinstance(envs, ToolVectorEnv):
        return envs
    envs = list(envs)
    if not envs:
        raise ValueError("run_token_episodes needs at least one env")
    if len(envs) == 1:
        return _OneEnv(envs[0])
    return ToolVectorEnv(env_fns=[functools.partial(_same, e) for e in envs])


def _same(env: ToolEnv) -> ToolEnv:
    return env


def _check_generation(g: Any, max_tokens: int) -> Generation:
    if not isinstance(g, Generation):
        raise TypeError(f"the generate function must return rlf_envs.env.episodes.Generation, got "
                        f"{type(g).__name__}")
    if g.logprobs is not None and len(g.logprobs) != len(g.ids):
        raise ValueError(f"the generate function returned {len(g.ids)} ids but {len(g.logprobs)} logprobs")
    if len(g.ids) > max_tokens:
        raise ValueError(f"the generate function returned {len(g.ids)} ids, more than the {max_tokens} asked for")
    return g


async def run_token_episodes(
    envs: ToolVectorEnv | Sequence[ToolEnv],
    generate: GenerateFn | None = None,
    *,
    generate_batch: GenerateBatchFn | None = None,
    options: Sequence[dict[str, Any] | None] | None = None,
    seeds: Sequence[int | None] | None = None,
    max_tokens_per_turn: int = 512,
    max_length: int | None = None,
    max_completion_tokens: int | None = None,
    catch_env_errors: bool = False,
    num_episodes: int | None = None,
    stats: DriveStats | None = None,
    check_turn_length: bool = True,
) -> list[TokenEpisode]:
    """One token-mode episode on each env (env k reset with `options[k]`, e.g. `{"task_index": 3}` or
    `{"task": Task(...)}`), all in lock-step; see the module docstring. Give exactly one of `generate`
    (called concurrently, once per active episode per turn) or `generate_batch` (once per turn).

    `max_length` caps the whole sequence (prompt + completion), `max_completion_tokens` what follows the
    prompt (actions + observations): each env's total budget is lowered to fit and each generation asks for
    at most what is left. A generate function's exception propagates (the
    trainer's to see). An exception from an env step (a bug) propagates too, unless `catch_env_errors`:
    then the episodes of that step end with `error` set, reward 0, and the others go on (and it is logged).

    `num_episodes` runs only on the first that many envs of a bigger `ToolVectorEnv` (a trainer's pool);
    `stats` (a `DriveStats`) receives the seconds spent generating and stepping, the generated ids and turns.
    `check_turn_length=False` lets a (trusted) generate function return more than a turn's `max_tokens`, as
    long as the sequence stays within `max_length` / `max_completion_tokens` (rlf's trainer: scripted actions).
    """
    if (generate is None) == (generate_batch is None):
        raise TypeError("give exactly one of generate= or generate_batch=")
    if max_tokens_per_turn < 1:
        raise ValueError(f"max_tokens_per_turn must be >= 1, got {max_tokens_per_turn}")
    venv = _as_vector(envs)
    n = venv.num_envs if num_episodes is None else num_episodes
    if not 0 < n <= venv.num_envs:
        raise ValueError(f"num_episodes must be in 1..{venv.num_envs} (the number of envs), got {n}")
    opts: list[dict[str, Any] | None] = list(options) if options is not None else [None] * n
    if len(opts) != n:
        raise ValueError(f"got {len(opts)} options for {n} envs")
    if seeds is not None and len(seeds) != n:
        raise ValueError(f"got {len(seeds)} seeds for {n} envs")
    for e in venv.envs[:n]:
        if not e.token_mode:
            raise ValueError("run_token_episodes needs token-mode envs: make them with a tokenizer "
                             "(make_tool_env(env_id, tokenizer=...))")
    budgets = [e.max_total_tokens for e in venv.envs[:n]]
    try:
        return await _drive(venv, n, opts, seeds, generate, generate_batch, max_tokens_per_turn, max_length,
                            max_completion_tokens, catch_env_errors, stats if stats is not None else DriveStats(),
                            check_turn_length)
    finally:  # the budgets were lowered for these episodes only
        for e, b in zip(venv.envs[:n], budgets, strict=True):
            e.max_total_tokens = b


async def _drive(
    venv: ToolVectorEnv | _OneEnv,
    n: int,
    opts: list[dict[str, Any] | None],
    seeds: Sequence[int | None] | None,
    generate: GenerateFn | None,
    generate_batch: GenerateBatchFn | None,
    max_tokens_per_turn: int,
    max_length: int | None,
    max_completion_tokens: int | None,
    catch_env_errors: bool,
    stats: DriveStats,
    check_turn_length: bool,
) -> list[TokenEpisode]:
    envs = venv.envs[:n]
    t = time.perf_counter()
    resets = await venv.areset_envs(dict(enumerate(opts)), seeds=None if seeds is None else dict(enumerate(seeds)))
    stats.env_seconds += time.perf_counter() - t
    contexts = {i: obs_ids(obs) for i, (obs, _) in resets.items()}
    n_prompt = {i: len(c) for i, c in contexts.items()}
    unlimited = 1 << 62
    limit = {i: min(max_length if max_length is not None else unlimited,
                    n_prompt[i] + max_completion_tokens if max_completion_tokens is not None else unlimited)
             for i in range(n)}
    for i, e in enumerate(envs):
        e.max_total_tokens = min(e.max_total_tokens, limit[i])
    logprobs: dict[int, list[float] | None] = {i: [0.0] * len(c) for i, c in contexts.items()}
    length_stops = dict.fromkeys(range(n), 0)
    finish: dict[int, str | None] = dict.fromkeys(range(n))
    ends: dict[int, str | None] = dict.fromkeys(range(n))
    errors: dict[int, str | None] = dict.fromkeys(range(n))
    stop = list(venv.envs[0].format.stop_strings)
    active = list(range(n))
    while active:
        room = {i: min(max_tokens_per_turn, limit[i] - len(contexts[i])) for i in active}
        for i in [i for i in active if room[i] <= 0]:  # only when the prompt alone fills max_length
            ends[i] = MAX_LENGTH
        active = [i for i in active if room[i] > 0]
        if not active:
            break
        t = time.perf_counter()
        if generate_batch is not None:
            gens = list(await generate_batch([list(contexts[i]) for i in active], [room[i] for i in active], stop))
            if len(gens) != len(active):
                raise ValueError(f"generate_batch returned {len(gens)} generations for {len(active)} contexts")
        else:
            assert generate is not None
            gens = list(await asyncio.gather(*(generate(list(contexts[i]), room[i], stop) for i in active)))
        stats.gen_seconds += time.perf_counter() - t
        stats.turns += len(active)
        actions: dict[int, list[int]] = {}
        for i, g in zip(active, gens, strict=True):
            g = _check_generation(g, room[i] if check_turn_length else limit[i] - len(contexts[i]))
            actions[i] = [int(x) for x in g.ids]
            stats.gen_tokens += len(g.ids)
            finish[i] = g.finish_reason
            length_stops[i] += g.finish_reason == "length"
            lp = logprobs[i]
            if lp is not None and g.logprobs is None:
                logprobs[i] = None
            elif lp is not None and g.logprobs is not None:
                lp.extend(float(x) for x in g.logprobs)
        t = time.perf_counter()
        try:
            results = await venv.astep_active(actions)
        except Exception as e:
            if not catch_env_errors:
                raise
            log.exception("rlf env step failed; %d episode(s) end with reward 0", len(active))
            for i in active:
                errors[i], ends[i] = f"{type(e).__name__}: {str(e)[:300]}", ENV_ERROR
            break
        finally:
            stats.env_seconds += time.perf_counter() - t
        still = []
        for i in active:
            contexts[i].extend(actions[i])
            if not results[i].done:
                new = obs_ids(results[i].obs)
                contexts[i].extend(new)
                lp = logprobs[i]
                if lp is not None:
                    lp.extend([0.0] * len(new))
                still.append(i)
        active = still
    out = []
    for i, env in enumerate(envs):
        if errors[i] is None and list(env.trajectory.token_ids or []) != contexts[i]:
            raise RuntimeError("rlf adapters: the context given to the generate function differs from the env's "
                               "trajectory ids (an env that re-tokenises?)")
        out.append(_episode(env, n_prompt[i], logprobs[i], length_stops[i], ends[i], errors[i], finish[i]))
    return out


async def run_token_episode(
    env: ToolEnv,
    generate: GenerateFn,
    *,
    options: dict[str, Any] | None = None,
    seed: int | None = None,
    **kwargs: Any,
) -> TokenEpisode:
    """One episode of one env (`run_token_episodes` with a batch of one; same keyword arguments)."""
    return (await run_token_episodes([env], generate, options=[options], seeds=[seed], **kwargs))[0]


def run_token_episodes_sync(envs: ToolVectorEnv | Sequence[ToolEnv], generate: Any = None,
                            **kwargs: Any) -> list[TokenEpisode]:
    """`run_token_episodes` from synchronous code: the whole loop runs on rlf's event-loop thread (where
    the env's tools live: no thread hop per step), so `generate` must not block for long or must be async."""
    from rlf_envs import runtime

    return runtime.run(run_token_episodes(envs, generate, **kwargs))

