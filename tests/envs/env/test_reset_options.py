"""`reset(options=...)`: task, task_index and task_id pick the episode's task; any other key is refused (it was
silently ignored, so `{"task_id": ...}` gave a random task)."""

from __future__ import annotations

import asyncio

import gymnasium as gym
import pytest

import rlf_envs  # noqa: F401


def test_task_id_picks_that_task() -> None:
    env = gym.make("rlf/Calculator-v0").unwrapped
    want = env.tasks[7]
    for seed in range(3):
        _, info = env.reset(seed=seed, options={"task_id": want.id})
        assert info["task_id"] == want.id and env.trajectory.task == want
    _, info = asyncio.run(env.areset(options={"task_id": env.tasks[2].id}))
    assert info["task_id"] == env.tasks[2].id
    with pytest.raises(ValueError, match=r"task_id 'nope': none of this env's \d+ tasks has that id"):
        env.reset(options={"task_id": "nope"})
    env.close()


@pytest.mark.parametrize("options", [{"task_idx": 3}, {"seed": 1}, {"task_index": 1, "split": "test"}])
def test_unknown_options_are_refused(options: dict[str, object]) -> None:
    env = gym.make("rlf/Calculator-v0").unwrapped
    with pytest.raises(ValueError, match="unknown reset options .* task_index .* task_id"):
        env.reset(options=options)
    env.reset(options={"task_index": 1})  # the env still works
    env.close()


def test_vector_env_passes_task_id_and_reset_mask_is_not_an_option() -> None:
    venv = gym.make_vec("rlf/Calculator-v0", num_envs=2)
    tid = venv.envs[0].tasks[5].id
    _, infos = venv.reset(seed=0, options={"task_id": tid})
    assert list(infos["task_id"]) == [tid, tid]
    venv.reset(options={"reset_mask": [True, False]})
    venv.close()
