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


#: the clock a rate is measured on: wall time, or `time.process_time` (CPU seconds of this process, all its
#: threads) for steps per CPU-second, which a loaded shared box disturbs far less (`--cpu` of sql_env.py)
CLOCK: Callable[[], float] = time.perf_counter


def scripted_rate(
    venv: gym.vector.VectorEnv,
    seconds: float,
    plan: Callable[[Any], list[str]],
    check: Callable[[np.ndarray], None] | None = None,
    check_env: Callable[[Any], None] | None = None,
) -> float:
    """Env steps/s over whole episodes for at least `seconds`: each env plays `plan(env)` (its actions, one per
    step; every plan has the same length); `check` sees each episode's final rewards, `check_env` each env (its
    finished episode) after them. The envs are closed after."""
    envs = [e.unwrapped for e in venv.envs]  # type: ignore[attr-defined]
    steps, seed = 0, 0
    t0, c0 = time.perf_counter(), CLOCK()
    while time.perf_counter() - t0 < seconds or steps == 0:
        venv.reset(seed=seed)
        seed += 1
        plans = [plan(e) for e in envs]
        for k in range(len(plans[0])):
            _, rewards, *_ = venv.step([p[k] for p in plans])
            steps += len(envs)
        if check is not None:
            check(rewards)
        if check_env is not None:
            for e in envs:
                check_env(e)
    rate = steps / (CLOCK() - c0)
    venv.close()
    return rate


def interleaved(measure: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """The median of `rounds` measurements of each rate, taken in turn (A B C, A B C, ...), so that a shared
    box's load changing during the run weighs on every rate alike."""
    got: dict[str, list[float]] = {name: [] for name in measure}
    for _ in range(rounds):
        for name, fn in measure.items():
            got[name].append(fn())
    return {name: float(np.median(v)) for name, v in got.items()}


def compare_rows(
    envs: list[int], make: dict[str, Callable[[int], gym.vector.VectorEnv]], seconds: float, rounds: int,
    plan: Callable[[Any], list[str]], check: Callable[[np.ndarray], None] | None, steps: int, max_turns: int,
    check_env: Callable[[Any], None] | None = None,
) -> dict[int, dict[str, float]]:
    """For each env count n: steps/s of each `make[name](n)` vector env and of the instant-tool floor
    ("instant", episodes of `steps` steps), measured `interleaved`."""
    rows: dict[int, dict[str, float]] = {}
    for n in envs:
        measure: dict[str, Callable[[], float]] = {
            name: (lambda mk=mk, n=n: scripted_rate(mk(n), seconds, plan, check, check_env))
            for name, mk in make.items()}
        measure["instant"] = lambda n=n: instant_tool_rate(n, seconds, steps=steps, max_turns=max_turns)
        rows[n] = interleaved(measure, rounds)
    return rows


def instant_tool_rate(n: int, seconds: float, steps: int, max_turns: int) -> float:
    """The env machinery alone: `n` Tools-v0 envs whose episodes call an instant tool `steps - 1` times, then answer."""
    tasks = [Task(id=str(i), question=f"q{i}", ground_truth=["x"]) for i in range(8)]
    work = make_tool(0.0)
    plan = [tool_call("work", x=1)] * (steps - 1) + ["<answer>x</answer>"]
    venv = ToolVectorEnv([lambda: ToolEnv(tools=[work], tasks=tasks, max_turns=max_turns) for _ in range(n)])
    return scripted_rate(venv, seconds, lambda env: plan)


def report(
    env: str, key: str, episode: str, rows: dict[int, dict[str, float]], labels: dict[str, str], json_path: Path | None,
    *, after: str, before: str, extra: dict[str, Any] | None = None,
) -> None:
    """Print steps/s per env count (`rows[n][name]`, names described by `labels`) with the ratios that matter:
    `after` over `before` (the speed-up, same run) and `after` over "instant" (the share of the instant-tool
    floor: what the env costs with a tool that does nothing); write them as JSON under `{key}_env`."""
    res: dict[str, Any] = {"rows": {}, **(extra or {})}
    for n, rates in rows.items():
        print(f"\nrlf/{env} steps/s, {n} envs, scripted {episode}:")
        for name, rate in rates.items():
            note = ""
            if name == before:
                note = f"   -> {after} is {rates[after] / rate:.2f}x of it"
            elif name == "instant":
                note = f"   -> {after} runs at {rates[after] / rate:.3f} of it ({rate / rates[after]:.2f}x slower)"
            print(f"  {labels[name]:<44} {rate:>10,.1f}/s{note}")
        res["rows"][str(n)] = {**{f"{k}_steps_per_s": v for k, v in rates.items()},
                               "speedup_vs_before": rates[after] / rates[before],
                               "share_of_instant_tool": rates[after] / rates["instant"]}
    if json_path:
        write_report(json_path, {f"{key}_env": res})
