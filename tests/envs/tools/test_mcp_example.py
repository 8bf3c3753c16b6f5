"""configs/mcp_example.yaml without the trainer: the env its YAML describes (rlf/Tools-v0 + a real PyPI MCP
server + a tasks file + a reward YAML), in a vector env; one shared server, per-episode results kept apart;
failure paths."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import psutil
import pytest
import yaml
from procs_support import leftover_children
from repo_paths import REPO

import rlf_envs  # noqa: F401 - registers the ids
from rlf_envs import runtime
from rlf_envs.env import ToolVectorEnv
from rlf_envs.rewards.config import VerifierConfigError
from rlf_envs.tools import close_mcp_servers
from rlf_envs.tools.base import ToolCrashed

ROOT = REPO
CONFIG = ROOT / "configs" / "mcp_example.yaml"


def children() -> list[psutil.Process]:
    return leftover_children()


@pytest.fixture(scope="module")
def example() -> Any:
    """The example's env kwargs, run from the repository root with this venv's scripts on PATH. The server is
    shared by every env made with the same config, so it is closed once, after the module's tests (a closed
    server stays closed for that config's shared toolbox)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        mp.setenv("PATH", str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
        yield yaml.safe_load(CONFIG.read_text())["env"]
    runtime.run(close_mcp_servers())
    deadline = time.time() + 10
    while children() and time.time() < deadline:
        time.sleep(0.05)
    assert children() == [], "MCP server processes left behind"


def test_example_env_in_a_vector_env_shares_one_server(example: dict[str, Any]) -> None:
    venv = gym.make_vec(example["id"], num_envs=4, **example["kwargs"])
    assert isinstance(venv, ToolVectorEnv)
    assert [t.name for t in venv.envs[0].toolbox.specs] == ["convert_time"]  # the allow-list of servers.yaml
    assert {id(e.toolbox) for e in venv.envs} == {id(venv.envs[0].toolbox)}
    demos = [json.loads(line) for line in (ROOT / "configs" / "mcp" / "time_demos.jsonl").read_text().splitlines()]
    picks = demos[:4]

    async def run() -> tuple[dict[int, Any], dict[int, Any]]:
        await venv.areset_envs({k: {"task_index": d["task_index"]} for k, d in enumerate(picks)})
        called = await venv.astep_active({k: d["actions"][0] for k, d in enumerate(picks)})
        answered = await venv.astep_active({k: d["actions"][1] for k, d in enumerate(picks)})
        return called, answered

    called, answered = runtime.run(run())
    assert len([p for p in children() if "mcp-server-time" in " ".join(p.cmdline())]) == 1  # one for all envs
    for k, d in enumerate(picks):
        task = venv.envs[k].trajectory.task
        # each episode saw its own conversion (the server is shared, the calls and results are not)
        target = json.loads(called[k].obs.split("<tool_response>\n")[1].split("\n</tool_response>")[0])["target"]
        assert target["datetime"][11:16] == task.gold_answers[0] == d["actions"][1][8:13]
        assert answered[k].terminated and answered[k].reward == 1.0
    venv.close()


def test_wrong_answer_and_no_answer_score_zero(example: dict[str, Any]) -> None:
    env = gym.make(example["id"], **example["kwargs"]).unwrapped
    env.reset(seed=0, options={"task_index": 0})
    _, r, term, _, _ = env.step("<answer>00:00</answer><|im_end|>")
    assert term and r == 0.0
    env.reset(seed=0, options={"task_index": 0})
    term = trunc = False
    while not (term or trunc):
        _, r, term, trunc, info = env.step("it is noon<|im_end|>")  # no tags: a correction, then truncation
    assert trunc and r == 0.0 and info["end_reason"] == "max_turns"


def test_failure_paths(example: dict[str, Any], tmp_path: Path) -> None:
    kw = dict(example["kwargs"])
    bad_reward = tmp_path / "reward.yaml"
    bad_reward.write_text(
        "reward:\n  type: gate\n  gate: {type: format, require_anser: true}\n  inner: {type: exact_match}\n")
    with pytest.raises(VerifierConfigError, match="require_anser"):
        gym.make(example["id"], **{**kw, "verifier": str(bad_reward)})
    with pytest.raises(VerifierConfigError, match="cannot read"):
        gym.make(example["id"], **{**kw, "verifier": str(tmp_path / "missing.yaml")})
    with pytest.raises(FileNotFoundError, match="task file"):
        gym.make(example["id"], **{**kw, "tasks": str(tmp_path / "missing.jsonl")})
    servers = {"mcpServers": {"time": {"command": "definitely-not-an-mcp-server", "timeout": 5}}}
    with pytest.raises(ToolCrashed, match="'time' failed to start"):
        gym.make(example["id"], **{**kw, "mcp_servers": servers})


def test_a_server_error_is_an_observation(example: dict[str, Any]) -> None:
    env = gym.make(example["id"], **example["kwargs"]).unwrapped
    env.reset(seed=0, options={"task_index": 0})
    call = {"name": "convert_time", "arguments": {"source_timezone": "Mars/Olympus", "time": "12:00",
                                                  "target_timezone": "UTC"}}
    obs, r, term, trunc, info = env.step(f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>")
    assert not term and not trunc and info["tool_errors"] == 1 and "Mars/Olympus" in obs
