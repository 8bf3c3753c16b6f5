"""rlf/SWE-v0 through the trainer's agent endpoint: the example ReAct agent (examples/swe_agent/agent.py, the
`openai` SDK against rlf's policy endpoint) repairs a tiny repository in its own session, and the episode's
records show the shell command the policy called and what it printed. The slow test runs the trainer itself
(`rollout.agent`, tiny model from config, two updates) on the shipped SWE tasks: the pipe runs end to end (a random
tiny model does not learn; its episodes score 0, none an infrastructure failure)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from repo_paths import REPO

from rlf_envs.envs.swe.env import SweVerifier
from rlf_envs.envs.swe.tasks import load_swe_rows
from rlf_envs.formats import Qwen3Format
from rlf_envs.formats.chat import ChatCodec
from rlf_envs.records import sample_records
from tests.envs.envs.swe.test_swe_env import _skip_without_sessions, tiny_row

ROOT = REPO
AGENT = f"{ROOT / 'examples' / 'swe_agent' / 'agent.py'}:agent"
FIX = ("sed -i 's/if x < hi:/if x > hi:/' calc/__init__.py && python3 -m pytest -q -o addopts= tests 2>&1 | "
       "tail -1")


def fix_then_submit(context: str) -> str:
    """The policy: one shell command that fixes the bug and runs the tests, then submit() once it saw the result."""
    if "<tool_response>" in context:
        return '<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>'
    return "<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"command": FIX}}) + "\n</tool_call>"


def test_example_agent_repairs_and_records_show_the_command(tmp_path: Path) -> None:
    _skip_without_sessions()
    pytest.importorskip("torch")
    from agent_support import ScriptedEngine

    from rlf_train.policy.tokenizer import build_tiny_tokenizer
    from rlf_train.rollout.agent_runner import AgentRunner, load_agent
    from rlf_train.rollout.endpoint.engine import EngineFront
    from rlf_train.rollout.endpoint.sessions import EndpointLimits

    [task] = load_swe_rows([tiny_row(tmp_path)])
    tok = build_tiny_tokenizer(3072)
    codec = ChatCodec(Qwen3Format())
    engine = ScriptedEngine(tok, fix_then_submit)

    async def main() -> Any:
        runner = AgentRunner(load_agent(AGENT), codec, tok, EndpointLimits(8192, 512, 120.0), 2,
                             EngineFront(engine, codec.stop_strings, window_s=0.001))
        await runner.start()
        try:
            return await runner.run([task], SweVerifier())
        finally:
            await runner.close()

    eps = asyncio.run(main())
    assert eps.rewards == [1.0], eps
    traj = eps.trajectories[0]
    calls = [(c.name, c.arguments) for t in traj.turns for c in t.action.calls]
    assert calls[0] == ("bash", {"command": FIX}) and calls[-1] == ("submit", {})
    rec = sample_records([traj], 1, source="train", step=1)[0]
    first = rec.turns[0]
    assert first.tool_calls[0].name == "bash" and FIX in json.dumps(first.tool_calls[0].arguments)
    assert "4 passed" in first.results[0].content and "[exit code 0]" in first.results[0].content


@pytest.mark.slow
def test_trainer_runs_swe_v0_through_the_agent_endpoint(tmp_path: Path) -> None:
    _skip_without_sessions()
    pytest.importorskip("torch")
    from rlf_train.config import load_config
    from rlf_train.trainer import Trainer

    cfg = load_config(None, [
        "env.id=rlf/SWE-v0", "env.eval_split=test", f"rollout.agent={AGENT}",
        f"logging.run_dir={tmp_path / 'run'}", "logging.progress=false", "logging.tensorboard=false", "threads=1",
        "model.tiny.hidden_size=16", "model.tiny.intermediate_size=32", "model.tiny.num_layers=1",
        "rollout.prompts_per_step=1", "rollout.samples_per_prompt=2", "rollout.max_new_tokens_per_turn=8",
        "rollout.max_total_tokens=4096", "sft.enabled=false", "algorithm.steps=2", "algorithm.kl_coef=0",
        "eval.num_tasks=1", "eval.sampled=false", "seed=3"])
    summary = Trainer(cfg).run()
    assert summary["evals"]
    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    train = [m for m in metrics if "agent_errors" in m]
    assert len(train) == 2  # two updates, each from agent episodes
    # an infrastructure failure makes the example agent raise (an error, not a reward): none here
    assert all(m["agent_errors"] == 0 and m["agent_timeouts"] == 0 for m in train), train
    records = [json.loads(line) for p in sorted((run / "trajectories").glob("*.jsonl")) for line in p.open()]
    assert records and all("swe" in r["task"]["meta"] for r in records)
