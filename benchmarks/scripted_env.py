"""Shared by the env-steps benchmarks (`sql_env.py`, `code_env.py`): scripted episodes stepped through a vector
env, the instant-tool Tools-v0 reference, and the report of an env's rate against its baselines."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from tool_calls import make_tool, write_report

from rlf_envs.env import ToolEnv, ToolVectorEnv
from rlf_envs.types import Task


def tool_call(name: str, **args: Any) -> str:
    """A Qwen3-format tool-call action."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call><|im_end|>"


def scripted_rate(
    venv: gym.vector.VectorEnv,
    seconds: float,
    plan: Callable[[Any], list[str]],
    check: Callable[[np.ndarray], None] | None = None,
) -> float:
    """Env steps/s over whole episodes for at least `seconds`: each env plays `plan(env)` (its actions, one per
    step; every plan has the same length); `check` sees each episode's final rewards. The envs are closed after."""
    envs = [e.unwrapped for e in venv.envs]  # type: ignore[attr-defined]
    steps, seed = 0, 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or steps == 0:
        venv.reset(seed=seed)
        seed += 1
        plans = [plan(e) for e in envs]
        for k in range(len(plans[0])):
            _, rewards, *_ = venv.step([p[k] for p in plans])
            steps += len(envs)
        if check is not None:
            check(rewards)
    rate = steps / (time.perf_counter() - t0)
    venv.close()
    return rate


def instant_tool_rate(n: int, seconds: float, steps: int, max_turns: int) -> float:
    """The env machinery alone: `n` Tools-v0 envs whose episodes call an instant tool `steps - 1` times, then answer."""
    tasks = [Task(id=str(i), question=f"q{i}", ground_truth=["x"]) for i in range(8)]
    work = make_tool(0.0)
    plan = [tool_call("work", x=1)] * (steps - 1) + ["<answer>x</answer>"]
    venv = ToolVectorEnv([lambda: ToolEnv(tools=[work], tasks=tasks, max_turns=max_turns) for _ in range(n)])
    return scripted_rate(venv, seconds, lambda env: plan)


def report(
    env: str, key: str, n: int, episode: str, rates: dict[str, float], raw: tuple[str, str], json_path: Path | None,
    *, rate_digits: int = 0, share_digits: int = 2,
) -> None:
    """Print `rates` (steps/s: "ours", "sync", "instant", "raw") with their ratios and write them as JSON under
    `{key}_env`; `raw` = (its JSON name, its label), e.g. ("sqlite", "raw SQLite, same queries")."""
    ours, base, instant, raw_rate = rates["ours"], rates["sync"], rates["instant"], rates["raw"]
    raw_key, raw_label = raw
    res = {"envs": n, f"{key}_vector_steps_per_s": ours, f"{key}_sync_vector_steps_per_s": base,
           "instant_tool_vector_steps_per_s": instant, f"raw_{raw_key}_episode_steps_per_s": raw_rate,
           "speedup_vs_sync": ours / base, "share_of_instant_tool": ours / instant,
           f"vs_raw_{raw_key}": ours / raw_rate}
    f = f">9,.{rate_digits}f"
    print(f"\nrlf/{env} steps/s, {n} envs, scripted {episode}:")
    print(f"  rlf ToolVectorEnv          {ours:{f}}/s")
    print(f"  gymnasium SyncVectorEnv    {base:{f}}/s   -> rlf {ours / base:.2f}x")
    print(f"  Tools-v0, instant tool     {instant:{f}}/s   -> {env} runs at {ours / instant:.{share_digits}f} of it")
    print(f"  {raw_label:<26} {raw_rate:{f}}/s   -> {env} runs at {ours / raw_rate:.2f} of it")
    if json_path:
        write_report(json_path, {f"{key}_env": res})
