"""The chat codec (what the agent endpoint renders with) gives exactly the text an rlf env of the same format
shows its policy: the prompt, and after each tool call the observation, for Qwen3 and Search-R1; a reply
is read back by the format's own parser (tool calls, answers; a malformed call stays text)."""

from __future__ import annotations

import json

import pytest

from rlf_envs import ToolEnv, tool
from rlf_envs.formats import Qwen3Format, SearchR1Format
from rlf_envs.formats.chat import ChatCodec, ChatMessage, ChatToolCall


@tool
def search(query: str) -> str:
    """Search the encyclopedia.

    Args:
        query: what to look for
    """
    return f"Doc 1(Title: \"{query}\") {query}: capital Vell."


def episode(fmt: object, actions: list[str]) -> ToolEnv:
    env = ToolEnv(tasks=[{"id": "0", "question": "Capital of Zorbania?", "answers": ["Vell"]}], tools=[search],
                  format=fmt, max_turns=4)
    env.reset(seed=0)
    for a in actions:
        env.step(a)
    return env


@pytest.mark.parametrize("fmt, actions", [
    (Qwen3Format(), ['<tool_call>\n{"name": "search", "arguments": {"query": "Zorbania"}}\n</tool_call><|im_end|>',
                     "<answer>Vell</answer><|im_end|>"]),
    (SearchR1Format(instruction="Question: {question}\n"), ["<search> Zorbania </search>", "<answer> Vell </answer>"]),
])
def test_codec_renders_what_the_env_shows(fmt: object, actions: list[str]) -> None:
    env = episode(fmt, actions)
    traj = env.trajectory
    codec = ChatCodec(env.format)
    first = tuple(ChatMessage(m["role"], m["content"]) for m in env.format.messages(traj.task))  # type: ignore[attr-defined]
    tools = [s.to_openai() for s in env.toolbox.specs]
    assert codec.render(first, tools if isinstance(fmt, Qwen3Format) else []) == traj.prompt
    reply = codec.parse_reply(actions[0], call_id="c")
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("search", {"query": "Zorbania"})]
    results = [ChatMessage("tool", r.content, tool_call_id=c.id)
               for r, c in zip(traj.turns[0].results, reply.tool_calls, strict=True)]
    assert codec.render_tail(actions[0], results) == traj.turns[0].observation
    # the whole conversation rendered at once gives the same text (a segment that starts over)
    whole = codec.render((*first, reply.message(), *results), tools if isinstance(fmt, Qwen3Format) else [])
    assert whole == traj.prompt + actions[0] + traj.turns[0].observation
    final = codec.parse_reply(actions[1])
    assert final.answer == "Vell" and not final.tool_calls


def test_replies_read_by_the_format_parser() -> None:
    codec = ChatCodec(Qwen3Format())
    r = codec.parse_reply('<think>\nlook it up\n</think>\n\nLet me check.\n<tool_call>\n{"name": "search", '
                          '"arguments": {"query": "x"}}\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": '
                          '{"query": "y"}}\n</tool_call><|im_end|>', call_id="k")
    assert r.reasoning == "look it up" and r.content == "Let me check."
    assert [(c.id, c.arguments) for c in r.tool_calls] == [("k_0", '{"query": "x"}'), ("k_1", '{"query": "y"}')]
    assert r.matches(ChatMessage("assistant", "Let me check.", r.tool_calls))
    spaced = tuple(ChatToolCall(c.id, c.name, json.dumps({"query": q}, indent=2))
                   for c, q in zip(r.tool_calls, "xy", strict=True))
    assert r.matches(ChatMessage("assistant", "Let me check.", spaced))  # the same arguments, other spacing
    assert not r.matches(ChatMessage("assistant", "Let me check.", r.tool_calls[:1]))
    assert not r.matches(ChatMessage("assistant", "Something else.", r.tool_calls))
    bad = codec.parse_reply('<tool_call>\n{"name": "search", "arguments": {"query": \n</tool_call><|im_end|>')
    assert not bad.tool_calls and bad.content.startswith("<tool_call>")
    # hostile replies: linear-time parsing, never an exception
    huge = "<tool_call>" * 40_000 + "<|im_end|>"
    assert codec.parse_reply(huge).tool_calls == ()
    with pytest.raises(ValueError, match="qwen3 and search_r1"):
        ChatCodec(object())  # type: ignore[arg-type]
