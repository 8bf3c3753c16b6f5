"""Agent trajectories hold their tool data (issue 42, item 3): the calls the policy made (parsed from its
tokens), the tool messages the agent sent back for them, per segment, and the text the policy saw after each
reply, so the run's records and the viewer show what the tools returned, with `num_tool_calls` equal to the
metrics' tool calls."""

from __future__ import annotations

import asyncio
from typing import Any

from agent_support import ScriptedEngine, search_then_answer

from rlf_envs.formats import Qwen3Format
from rlf_envs.formats.chat import ChatCodec
from rlf_envs.records import sample_records
from rlf_envs.rewards.rules import ExactMatch
from rlf_envs.types import Task, ToolStatus
from rlf_train.policy.tokenizer import build_tiny_tokenizer
from rlf_train.rollout.agent_runner import NO_TOOL_MESSAGE, AgentRunner
from rlf_train.rollout.batch import episode_stats
from rlf_train.rollout.endpoint.engine import EngineFront
from rlf_train.rollout.endpoint.sessions import EndpointLimits

RESULT = "Vell is the capital of Zorbania."


def run(agent: Any) -> Any:
    tok = build_tiny_tokenizer(3072)
    codec = ChatCodec(Qwen3Format())
    engine = ScriptedEngine(tok, search_then_answer)  # a tool call, then (after a tool response) an answer

    async def main() -> Any:
        runner = AgentRunner(agent, codec, tok, EndpointLimits(2048, 64, 30.0), 4,
                             EngineFront(engine, codec.stop_strings, window_s=0.001))
        await runner.start()
        try:
            return await runner.run([Task("t", "Capital of Zorbania?", ground_truth="Vell")], ExactMatch())
        finally:
            await runner.close()

    return asyncio.run(main())


TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}]


async def react(task: Task, client: Any) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.question}]
    while True:
        r = await client.chat.completions.create(model=client.model, messages=messages, tools=TOOLS)
        m = r.choices[0].message
        if not m.tool_calls:
            return None  # the last reply's <answer> is scored
        messages.append(m.model_dump(exclude_none=True))
        for c in m.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": RESULT})


def test_calls_results_and_observations_are_recorded() -> None:
    eps = run(react)
    assert eps.rewards == [1.0] and len(eps.trajectories) == 1
    traj = eps.trajectories[0]
    first, last = traj.turns
    assert [(c.name, c.arguments) for c in first.action.calls] == [("search", {"query": "capital of Zorbania"})]
    assert [(r.call.name, r.content, r.status) for r in first.results] == [("search", RESULT, ToolStatus.OK)]
    assert RESULT in first.observation and "<tool_response>" in first.observation
    assert not last.action.calls and not last.results and last.action.answer == "Vell"
    # the records the viewer reads, and the metrics, agree
    rec = sample_records([traj], 1, source="train", step=1)[0]
    assert rec.num_tool_calls == 1 == episode_stats([traj])["tool_calls_mean"] == eps.stats.tool_calls
    assert rec.turns[0].tool_calls[0].name == "search" and rec.turns[0].results[0].content == RESULT
    assert RESULT in rec.turns[0].observation


async def drops_the_call(task: Task, client: Any) -> str:
    r = await client.chat.completions.create(model=client.model, tools=TOOLS,
                                             messages=[{"role": "user", "content": task.question}])
    return "Vell" if r.choices[0].message.tool_calls else ""


def test_a_call_without_a_tool_message_says_so() -> None:
    eps = run(drops_the_call)
    (turn,) = eps.trajectories[0].turns
    assert len(turn.action.calls) == 1 and [(r.content, r.status) for r in turn.results] == [
        (NO_TOOL_MESSAGE, ToolStatus.ERROR)]
    rec = sample_records(eps.trajectories, 1, source="train", step=1)[0]
    assert rec.num_tool_calls == 1 == episode_stats(eps.trajectories)["tool_calls_mean"]
