"""Gymnasium ecosystem: every registered id works with Gymnasium's defaults, in every vectorization mode,
with no arguments, and with the passive env checker turned on."""

from __future__ import annotations

import copy
import importlib.util
import json
import warnings
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import rlf_envs  # noqa: F401 - registers the ids
from rlf_envs.env.spaces import AnyText, SharedTexts
from rlf_envs.envs.demo import TOWNS

HAS_BM25 = importlib.util.find_spec("bm25s") is not None
needs_bm25 = pytest.mark.skipif(not HAS_BM25, reason="rlf/Search-v0 needs rlf-envs[bm25] (tox -e envs has it)")
IDS = [
    "rlf/Calculator-v0",
    "rlf/Tools-v0",
    pytest.param("rlf/Search-v0", marks=needs_bm25),
]


def _call(name: str, **args: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call><|im_end|>"


def _answer(env_id: str) -> str:
    return "<answer>x</answer>" if env_id == "rlf/Search-v0" else "<answer>x</answer><|im_end|>"


@pytest.mark.parametrize("mode", ["sync", "async", "vector_entry_point"])
@pytest.mark.parametrize("env_id", IDS)
def test_make_vec_every_mode_with_defaults(env_id: str, mode: str) -> None:
    venv = gym.make_vec(env_id, 2, vectorization_mode=mode)
    try:
        obs, _ = venv.reset(seed=0)
        assert len(obs) == 2 and all(isinstance(o, str) and o for o in obs)
        # a non-ASCII invalid turn (correction observation) and an answer: both come back through the vector env
        obs, reward, terminated, truncated, info = venv.step(["ünïcødé ✓ 中文 <|im_end|>", _answer(env_id)])
        assert isinstance(obs, tuple)  # a plain tuple of strings, also from shared memory
        assert isinstance(obs[0], str) and "invalid" in obs[0].lower()
        assert obs[1] == "" and terminated.tolist() == [False, True] and reward.shape == (2,)
        obs2, *_ = venv.step(["<answer>y</answer>", _answer(env_id)])  # env 1 autoresets (next-step mode)
        assert obs2[1] != obs[1] and obs2[1]  # each step's observations, not the first one's again
    finally:
        venv.close()


def test_async_shared_memory_is_live_and_copies_are_tuples() -> None:
    venv = gym.make_vec("rlf/Tools-v0", 2, vectorization_mode="async", vector_kwargs={"copy": False})
    try:
        first, _ = venv.reset(seed=0)
        assert isinstance(first, SharedTexts)
        snapshot = copy.deepcopy(first)
        assert type(snapshot) is tuple and snapshot == tuple(first)
        obs, *_ = venv.step([_call("population", town="Kessmoor"), _call("population", town="Nowhere")])
        assert obs is first  # the live view over the shared buffer, as Gymnasium's arrays are
        assert "<tool_response>\n9875\n</tool_response>" in obs[0] and "no census record" in obs[1]
        assert obs[0:1] == (obs[0],) and snapshot != tuple(obs)
    finally:
        venv.close()


def test_tools_v0_without_arguments_is_a_working_demo() -> None:
    env = gym.make("rlf/Tools-v0")
    obs, info = env.reset(seed=3)
    assert '"name": "population"' in obs and '"name": "calculator"' in obs
    task = env.unwrapped.trajectory.task
    towns = [t for t in TOWNS if t in task.question]
    total = 0
    for town in towns:
        obs, *_ = env.step(_call("population", town=town))
        assert f"<tool_response>\n{TOWNS[town]}\n</tool_response>" in obs
        total += TOWNS[town]
    if len(towns) == 2:
        obs, *_ = env.step(_call("calculator", expression=f"{TOWNS[towns[0]]} + {TOWNS[towns[1]]}"))
        assert f"\n{total}\n" in obs
    obs, reward, terminated, truncated, info = env.step(f"<answer>{total}</answer><|im_end|>")
    assert terminated and reward == 1.0
    env.close()


def test_tools_v0_with_tools_but_no_tasks_still_says_what_is_missing() -> None:
    from rlf_envs.envs.calculator import CALCULATOR

    with pytest.raises(ValueError, match="at least one task"):
        gym.make("rlf/Tools-v0", tools=[CALCULATOR])


@pytest.mark.parametrize("env_id", IDS)
def test_passive_env_checker_is_clean_when_enabled(env_id: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any checker warning fails the test
        env = gym.make(env_id, disable_env_checker=False)
        assert any(isinstance(w, gym.wrappers.PassiveEnvChecker) for w in _wrappers(env))
        env.reset(seed=0)
        env.step(_answer(env_id))
        env.reset(seed=1)
        env.step("not an action")
        env.close()


def _wrappers(env: gym.Env[Any, Any]) -> list[gym.Env[Any, Any]]:
    out = []
    while isinstance(env, gym.Wrapper):
        out.append(env)
        env = env.env
    return out


def test_registered_ids_skip_the_checker_by_default() -> None:
    env = gym.make("rlf/Calculator-v0")
    assert not any(isinstance(w, gym.wrappers.PassiveEnvChecker) for w in _wrappers(env))


def test_anytext_shared_memory_round_trip() -> None:
    import multiprocessing as mp

    from gymnasium.vector.utils import create_shared_memory, read_from_shared_memory, write_to_shared_memory

    space = AnyText(max_length=16)
    buf = create_shared_memory(space, n=3, ctx=mp)
    view = read_from_shared_memory(space, buf, n=3)
    for i, s in enumerate(["<tool_call>", "", "ünï ✓ 中文 \U0001f600"]):
        write_to_shared_memory(space, i, s, buf)
    assert tuple(view) == ("<tool_call>", "", "ünï ✓ 中文 \U0001f600")
    with pytest.raises(ValueError, match="does not contain"):
        write_to_shared_memory(space, 0, "x" * 17, buf)
    assert np.frombuffer(buf.get_obj(), dtype=np.int32).size == 3 * 17


def test_async_workers_open_their_own_mcp_servers() -> None:
    """AsyncVectorEnv forks its workers after making an env in the parent: a worker must not use the parent's
    MCP sessions (bound to the parent's event loop: every call would time out) but start its own."""
    import sys
    import time

    import psutil

    from rlf_envs import close_all

    cfg = {"mcpServers": {"time": {"command": sys.executable, "timeout": 10,
                                   "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]}}}
    tasks = [{"id": "1", "question": "What time is it?", "answer": "x"}]
    venv = gym.make_vec("rlf/Tools-v0", 2, vectorization_mode="async", mcp_servers=cfg, tasks=tasks)
    try:
        venv.reset(seed=0)
        obs, *_ = venv.step([_call("get_current_time", timezone="UTC")] * 2)
        assert all('"timezone": "UTC"' in o for o in obs), obs
    finally:
        venv.close()
        close_all()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        left = [p for p in psutil.Process().children(recursive=True) if "mcp_server_time" in " ".join(p.cmdline())]
        if not left:
            break
        time.sleep(0.2)
    assert not left, left
