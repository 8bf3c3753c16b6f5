"""rlf envs inside OpenRLHF's vLLM rollout actors: an `AgentExecutorBase` that runs one episode per
`execute` call, token in / token out.

Per turn: vLLM generates from the exact context ids (stopping at the env format's stop strings, kept in the
output), the generated ids go to the env as the action, and the env's observation ids are appended. Nothing
is re-tokenised, so the sequence OpenRLHF trains on is `env.trajectory.token_ids` and its action mask is
`env.trajectory.loss_mask` (OpenRLHF's stock `MultiTurnAgentExecutor` re-encodes the env's feedback text).

Budgets: the env enforces max turns, the per-observation cap and the total budget (`min(max_total_tokens,
max_length)`); each generation asks for at most `min(max_new_tokens_per_turn, max_length - context)` tokens,
so OpenRLHF never receives a sequence it would cut. Tools run on rlf's own event-loop thread (the env's
toolbox bridges to it), so a slow tool never blocks the actor's loop, which vLLM shares.

The class takes no arguments (OpenRLHF builds it so): it reads the run's resolved config from the
`RLF_OPENRLHF_CONFIG` environment variable (JSON, set by the launcher for the Ray job) or from the YAML
file named by `RLF_OPENRLHF_CONFIG_FILE`.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from openrlhf.utils.agent import AgentExecutorBase

from rlf_envs.env.tool_env import ToolEnv
from rlf_envs.tasks import task_from_dict
from rlf_envs.types import EndReason, Task, Trajectory
from rlf_train.config import TrainConfig, config_from_dict, load_config
from rlf_train.envs import SUCCESS_THRESHOLD, make_env

log = logging.getLogger("rlf_train.openrlhf")

CONFIG_ENV = "RLF_OPENRLHF_CONFIG"
CONFIG_FILE_ENV = "RLF_OPENRLHF_CONFIG_FILE"


def config_from_environment() -> TrainConfig:
    raw = os.environ.get(CONFIG_ENV)
    if raw:
        return config_from_dict(json.loads(raw))
    path = os.environ.get(CONFIG_FILE_ENV)
    if path:
        return load_config(path)
    raise RuntimeError(f"rlf's OpenRLHF agent needs the run config: set {CONFIG_ENV} (JSON) or {CONFIG_FILE_ENV} "
                       "(a YAML path); `python -m rlf_train --config X.yaml` with backend: openrlhf sets it")


def task_to_label(task: Task, split: str) -> str:
    """The task (and the config split it comes from: "train" or "eval") as the JSON label OpenRLHF passes back
    to `execute`; inverse of `task_from_label`."""
    return json.dumps({"split": split, "task": {
        "id": task.id, "question": task.question, "ground_truth": task.ground_truth,
        "messages": [m.to_dict() for m in task.messages], "meta": task.meta,
    }}, ensure_ascii=False)


def task_from_label(label: Any) -> tuple[Task, str]:
    d = json.loads(label) if isinstance(label, str) else label
    if not isinstance(d, dict) or "task" not in d:
        raise ValueError(f"not an rlf task label (write the prompt dataset with rlf_train's launcher): {label!r:.200}")
    return task_from_dict(d["task"]), str(d.get("split", "train"))


@dataclass(frozen=True)
class EpisodeSettings:
    max_new_tokens_per_turn: int
    per_turn_rewards: bool = True

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> EpisodeSettings:
        return cls(cfg.rollout.max_new_tokens_per_turn, cfg.algorithm.per_turn_rewards)


def turn_params(sampling_params: Any, max_tokens: int, stop: Sequence[str]) -> Any:
    """A copy of OpenRLHF's vLLM SamplingParams for one turn: at most `max_tokens` new tokens, stopping at
    the format's stop strings (kept in the output, so the env sees the whole action)."""
    p = copy.deepcopy(sampling_params)
    p.max_tokens = max_tokens
    if stop:
        p.stop = list(stop)
        p.include_stop_str_in_output = True
    return p


def _ids(obs: Any) -> list[int]:
    return obs.astype(np.int64).tolist() if isinstance(obs, np.ndarray) else [int(x) for x in obs]


def _action_logprobs(output: Any, ids: Sequence[int]) -> list[float]:
    lps = getattr(output, "logprobs", None) or []
    out = []
    for k, tok in enumerate(ids):
        entry = lps[k].get(tok) if k < len(lps) and lps[k] is not None else None
        out.append(float(entry.logprob) if entry is not None else 0.0)
    return out


def episode_logs(traj: Trajectory, vllm_truncations: int, error: bool) -> dict[str, float]:
    """Scalars for OpenRLHF's `extra_logs` (averaged over the batch in its logs)."""
    turns = traj.turns
    return {
        "rlf_turns": float(len(turns)),
        "rlf_tool_calls": float(traj.num_tool_calls),
        "rlf_tool_errors": float(traj.num_tool_errors),
        "rlf_tool_timeouts": float(sum(t.stats.timeouts for t in turns)),
        "rlf_invalid_actions": float(sum(t.stats.invalid for t in turns)),
        "rlf_success": float(traj.reward >= SUCCESS_THRESHOLD),
        "rlf_end_answer": float(traj.end is EndReason.ANSWER),
        "rlf_end_max_turns": float(traj.end is EndReason.MAX_TURNS),
        "rlf_end_token_budget": float(traj.end is EndReason.TOKEN_BUDGET),
        "rlf_vllm_length_stops": float(vllm_truncations),
        "rlf_episode_error": float(error),
    }


async def run_episode(
    env: ToolEnv,
    prompt: str,
    label: Any,
    sampling_params: Any,
    max_length: int,
    engine: Any,
    settings: EpisodeSettings,
) -> dict[str, Any]:
    """One episode of `env` on the task in `label`, generated by `engine`; OpenRLHF's response dict."""
    task, _ = task_from_label(label)
    obs, _ = await env.areset(options={"task": task})
    context = _ids(obs)
    want_logprobs = getattr(sampling_params, "logprobs", None) is not None
    logprobs: list[float] | None = [0.0] * len(context) if want_logprobs else None
    stop = env.format.stop_strings
    length_stops = 0
    last_finish = None
    error = False
    try:
        while not env.done:
            room = max_length - len(context)
            if room <= 0:  # only when the prompt alone fills max_length
                break
            request = turn_params(sampling_params, min(settings.max_new_tokens_per_turn, room), stop)
            out = (await engine.generate(context, request)).outputs[0]
            action = [int(t) for t in out.token_ids]
            last_finish = out.finish_reason
            length_stops += last_finish == "length"
            if logprobs is not None:
                logprobs.extend(_action_logprobs(out, action))
            obs, _, _, _, _ = await env.astep(action)
            context.extend(action)
            if not env.done:
                new = _ids(obs)
                context.extend(new)
                if logprobs is not None:
                    logprobs.extend([0.0] * len(new))
    except Exception:  # a bug or a broken env: this sample gets reward 0, training goes on
        log.exception("rlf episode failed; the sample gets reward 0")
        error = True
    traj = env.trajectory
    ids = list(traj.token_ids or [])
    if not error and ids != context:
        raise RuntimeError("rlf executor: the context given to vLLM differs from the env's trajectory ids")
    ranges = [t.action_span for t in traj.turns if t.action_span is not None]
    outcome = 0.0 if error else float(traj.reward)
    reward = outcome + (sum(t.reward for t in traj.turns) if settings.per_turn_rewards and not error else 0.0)
    if logprobs is not None:  # after an error the env may hold one more action than the context
        logprobs = (logprobs + [0.0] * len(ids))[: len(ids)]
    return {
        "prompt": prompt,
        "label": label,
        "images": None,
        "mm_train_inputs": None,
        "observation_tokens": ids,
        "action_ranges": ranges,
        "rollout_log_probs": logprobs,
        "reward": reward,
        "scores": outcome,
        "truncated": last_finish == "length",
        "extra_logs": episode_logs(traj, length_stops, error),
    }


class RlfAgentExecutor(AgentExecutorBase):
    """OpenRLHF's `AgentExecutor` for rlf envs (see the module docstring)."""

    def __init__(self, config: TrainConfig | None = None) -> None:
        self.cfg = config if config is not None else config_from_environment()
        self.settings = EpisodeSettings.from_config(self.cfg)
        self._free: dict[str, list[ToolEnv]] = {"train": [], "eval": []}  # envs per split (eval_kwargs differ)
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._warned_prompt = False

    def new_env(self, split: str, max_length: int) -> ToolEnv:
        """An env as the rollout actor steps it (token mode, the run's budgets, `split`'s kwargs)."""
        env = make_env(self.cfg, self._tokenizer, self.cfg.env.eval_split if split == "eval" else self.cfg.env.train_split)
        env.max_total_tokens = min(self.cfg.rollout.max_total_tokens, max_length)
        return env

    async def _acquire(self, split: str, hf_tokenizer: Any, max_length: int) -> ToolEnv:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = hf_tokenizer  # the actor's tokenizer; every call sends the same one
            free = self._free.setdefault(split, [])
            if free:
                env = free.pop()
                env.max_total_tokens = min(self.cfg.rollout.max_total_tokens, max_length)
                return env
        # building an env may load an index: off the actor's event loop
        return await asyncio.to_thread(self.new_env, split, max_length)

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):  # type: ignore[no-untyped-def]
        if images:
            raise ValueError("rlf envs are text-only: this prompt carries images")
        _, split = task_from_label(label)
        env = await self._acquire(split, hf_tokenizer, max_length)
        try:
            result = await run_episode(env, prompt, label, sampling_params, max_length, llm_engine, self.settings)
            if not self._warned_prompt and env.trajectory.prompt != prompt:
                self._warned_prompt = True
                log.warning("the prompt in the dataset differs from the one the env renders for the same task "
                            "(was the dataset written with another config?); training uses the env's prompt")
            return result
        finally:
            with self._lock:
                self._free[split].append(env)
