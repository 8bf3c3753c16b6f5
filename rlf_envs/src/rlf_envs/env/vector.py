"""ToolVectorEnv: N ToolEnvs stepped concurrently on one event loop (the work is I/O, not CPU).

It is a real `gymnasium.vector.VectorEnv` (batched `reset`/`step`, Gymnasium's autoreset modes), and
has a trainer-facing async API that steps only the envs you give actions to::

    venv = ToolVectorEnv(num_envs=64, tools=[...], tasks=...)
    obs = await venv.areset_envs({i: {"task_index": k} for i, k in ...})
    results = await venv.astep_active({i: action for i in venv.active})   # dict[int, StepResult]

All envs share one Toolbox (one caller, one set of MCP servers). A slow tool call only delays its own
env up to its deadline; the others' results are computed concurrently.

A batch is stepped phase by phase (ToolEnv's `_record` / `_call_tools` / `_observation_text` /
`_finish` / `_score_end`): one gather for the batch's tool calls, one tokenizer call for its
observations (and for its prompts on reset), tasks only where something can wait. A batch that holds an
env overriding `astep` (or `areset`) goes through those methods instead (steps still concurrently).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium.spaces import Tuple as TupleSpace
from gymnasium.vector import AutoresetMode, VectorEnv

from rlf_envs import runtime
from rlf_envs.env.tool_env import StepReturn, ToolEnv, start_episodes, step_envs


@dataclass(slots=True)
class StepResult:
    obs: Any
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


class ToolVectorEnv(VectorEnv[Any, Any, Any]):
    """Vectorised ToolEnv. Pass `env_fns` (callables making ToolEnvs) or `num_envs` + ToolEnv kwargs.

    `pause_gc` (default on) holds Python's cyclic GC while a batch of steps runs; it runs once after.
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], ToolEnv]] | None = None,
        *,
        num_envs: int | None = None,
        env_cls: type[ToolEnv] = ToolEnv,
        autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
        pause_gc: bool = True,
        **env_kwargs: Any,
    ) -> None:
        self.pause_gc = pause_gc  # hold the cyclic GC during a batch of steps (see runtime.paused_gc)
        if env_fns is not None:
            if num_envs is not None and num_envs != len(env_fns):
                raise ValueError(f"num_envs={num_envs} but {len(env_fns)} env_fns given")
            self.envs: list[ToolEnv] = [fn() for fn in env_fns]
        else:
            if not num_envs or num_envs < 1:
                raise ValueError("give env_fns or num_envs >= 1")
            self.envs = [env_cls(**env_kwargs) for _ in range(num_envs)]
        for e in self.envs:
            if not isinstance(e, ToolEnv):
                raise TypeError(f"ToolVectorEnv runs ToolEnvs, got {type(e).__name__}")
        self.num_envs = len(self.envs)
        self.autoreset_mode = (
            autoreset_mode if isinstance(autoreset_mode, AutoresetMode) else AutoresetMode(autoreset_mode)
        )
        first = self.envs[0]
        self.metadata = {**first.metadata, "autoreset_mode": self.autoreset_mode}
        self.render_mode = first.render_mode
        self.single_observation_space = first.observation_space
        self.single_action_space = first.action_space
        self.observation_space = TupleSpace([first.observation_space] * self.num_envs)
        self.action_space = TupleSpace([first.action_space] * self.num_envs)
        self._autoreset = np.zeros(self.num_envs, dtype=bool)
        self._last_obs: tuple[Any, ...] = (None,) * self.num_envs
        self.closed = False

    # -- trainer-facing async API --------------------------------------------------------------------
    @property
    def active(self) -> list[int]:
        """Indices of envs whose episode is still running."""
        return [i for i, e in enumerate(self.envs) if not e.done]

    async def areset_envs(
        self, options: Mapping[int, dict[str, Any] | None], seeds: Mapping[int, int | None] | None = None
    ) -> dict[int, tuple[Any, dict[str, Any]]]:
        """Reset the given envs (index -> reset options); the prompts are encoded in one tokenizer call."""
        idx = list(options)
        seeds = seeds or {}
        envs = [self.envs[i] for i in idx]
        out: dict[int, tuple[Any, dict[str, Any]]] = {}
        if any(type(e).areset is not ToolEnv.areset or type(e)._begin is not ToolEnv._begin for e in envs):
            for i in idx:
                out[i] = await self.envs[i].areset(seed=seeds.get(i), options=options[i])
        else:
            out = dict(zip(idx, start_episodes(envs, [seeds.get(i) for i in idx], [options[i] for i in idx]),
                           strict=True))
        self._autoreset[idx] = False
        return out

    async def astep_active(self, actions: Mapping[int, Any]) -> dict[int, StepResult]:
        """Step only the given envs, all concurrently; no autoreset."""
        idx = list(actions)
        res = await runtime.bridge(self._gather(idx, [actions[i] for i in idx]))
        return {i: StepResult(*r) for i, r in zip(idx, res, strict=True)}

    async def _gather(self, idx: list[int], acts: list[Any]) -> list[StepReturn]:
        """Step envs idx[k] with acts[k] concurrently (`step_envs`: phase by phase for the whole batch). A
        batch with an env that overrides `astep` goes through each env's `astep`."""
        envs = [self.envs[i] for i in idx]
        with runtime.paused_gc() if self.pause_gc else contextlib.nullcontext():
            if any(type(e).astep is not ToolEnv.astep for e in envs):
                return list(await asyncio.gather(*(e.astep(a) for e, a in zip(envs, acts, strict=True))))
            return await step_envs(envs, acts)

    # -- gymnasium VectorEnv API ------------------------------------------------------------------------
    def reset(
        self, *, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if seed is None:
            seeds: list[int | None] = [None] * self.num_envs
        elif isinstance(seed, int):
            seeds = [seed + i for i in range(self.num_envs)]
        else:
            seeds = list(seed)
            if len(seeds) != self.num_envs:
                raise ValueError(f"got {len(seeds)} seeds for {self.num_envs} envs")
        options = dict(options or {})
        mask = options.pop("reset_mask", None)
        if mask is not None:
            mask = np.asarray(mask, dtype=bool)
            if mask.shape != (self.num_envs,):
                raise ValueError(f"reset_mask must have shape ({self.num_envs},), got {mask.shape}")
        infos: dict[str, Any] = {}
        obs = list(self._last_obs)
        for i, env in enumerate(self.envs):
            if mask is not None and not mask[i]:
                continue
            obs[i], info = env.reset(seed=seeds[i], options=options or None)
            infos = self._add_info(infos, info, i)
            self._autoreset[i] = False
        self._last_obs = tuple(obs)
        return self._last_obs, infos

    def step(
        self, actions: Sequence[Any]
    ) -> tuple[tuple[Any, ...], np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        if len(actions) != self.num_envs:
            raise ValueError(f"expected {self.num_envs} actions, got {len(actions)}")
        return runtime.run(self._step_all(list(actions)))

    async def _step_all(
        self, actions: list[Any]
    ) -> tuple[tuple[Any, ...], np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        n = self.num_envs
        obs: list[Any] = [None] * n
        rewards = np.zeros(n, dtype=np.float64)
        terms = np.zeros(n, dtype=bool)
        truncs = np.zeros(n, dtype=bool)
        infos: dict[str, Any] = {}
        mode = self.autoreset_mode
        if mode is AutoresetMode.DISABLED and self._autoreset.any():
            bad = np.flatnonzero(self._autoreset).tolist()
            raise RuntimeError(f"envs {bad} finished; reset them with reset(options={{'reset_mask': ...}}) first")
        to_step = [i for i in range(n) if not (mode is AutoresetMode.NEXT_STEP and self._autoreset[i])]
        results = await self._gather(to_step, [actions[i] for i in to_step])
        stepped = dict(zip(to_step, results, strict=True))
        for i in range(n):
            if i not in stepped:  # NEXT_STEP: this step resets env i, the action is ignored
                obs[i], info = self.envs[i].reset()
            else:
                obs[i], rewards[i], terms[i], truncs[i], info = stepped[i]
                if mode is AutoresetMode.SAME_STEP and (terms[i] or truncs[i]):
                    infos = self._add_info(infos, {"final_obs": obs[i], "final_info": info}, i)
                    obs[i], info = self.envs[i].reset()
            infos = self._add_info(infos, info, i)
        self._autoreset = terms | truncs
        self._last_obs = tuple(obs)
        return self._last_obs, rewards, terms, truncs, infos

    def _add_info(self, vector_infos: dict[str, Any], env_info: dict[str, Any], env_num: int) -> dict[str, Any]:
        """Gymnasium's info batching (same arrays, dtypes and `_key` masks), without allocating a fresh mask
        per key per env (the base class builds its default eagerly: ~2x slower at 512 envs)."""
        n = self.num_envs
        for key, value in env_info.items():
            array = vector_infos.get(key)
            if isinstance(value, dict) and key != "final_obs":
                array = self._add_info(array if array is not None else {}, value, env_num)
            else:
                if array is None:
                    if key == "final_obs":
                        array = np.full(n, None, dtype=object)
                    elif type(value) in (int, float, bool) or isinstance(value, np.number):
                        array = np.zeros(n, dtype=type(value))
                    elif isinstance(value, np.ndarray) and key != "final_obs":
                        array = np.zeros((n, *value.shape), dtype=value.dtype)
                    else:
                        array = np.full(n, None, dtype=object)
                array[env_num] = value
            mask = vector_infos.get(f"_{key}")
            if mask is None:
                mask = np.zeros(n, dtype=np.bool_)
            mask[env_num] = True
            vector_infos[key] = array
            vector_infos[f"_{key}"] = mask
        return vector_infos

    def render(self) -> tuple[Any, ...] | None:
        return tuple(e.render() for e in self.envs)

    def close_extras(self, **kwargs: Any) -> None:
        for e in self.envs:
            e.close()


def make_tool_vector_env(num_envs: int = 1, env_cls: type[ToolEnv] = ToolEnv, **kwargs: Any) -> ToolVectorEnv:
    """`vector_entry_point` for gymnasium.make_vec on rlf ids."""
    autoreset_mode = kwargs.pop("autoreset_mode", AutoresetMode.NEXT_STEP)
    kwargs.pop("max_episode_steps", None)
    return ToolVectorEnv(num_envs=num_envs, env_cls=env_cls, autoreset_mode=autoreset_mode, **kwargs)
