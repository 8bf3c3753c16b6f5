"""The policy endpoint under bad input (issue 42, item 6): whatever JSON a client sends, the answer is a 2xx
or a 4xx in OpenAI's error shape (`{"error": {"message", "type", "code", "param"}}`), never a plain-text 500,
and the server serves a well-formed request right after. The three cases an outside check found (a lone
surrogate, an assistant tool call whose `function` is a string, JSON nested 100,000 deep) and `n` < 1 are
pinned by name; a property-based test (hypothesis) throws arbitrary JSON values and shapes at the real server
on loopback."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from agent_support import SEARCH_TOOL, Endpoint, running_endpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlf_envs.formats import Qwen3Format
from rlf_train.rollout.endpoint.sessions import EndpointLimits

QUESTION = [{"role": "system", "content": "You are a careful researcher."},
            {"role": "user", "content": "What is the capital of Zorbania?"}]
LIMITS = EndpointLimits(max_total_tokens=4096, max_new_tokens=32, timeout_s=60.0)


@pytest.fixture(scope="module")
def ep() -> Any:
    from rlf_train.config import ModelConfig
    from rlf_train.policy.tokenizer import load_tokenizer

    with running_endpoint(load_tokenizer(ModelConfig()), fmt=Qwen3Format()) as e:
        yield e


async def _post(url: str, data: bytes) -> tuple[int, str, Any]:
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as http, \
            http.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        text = await r.text()
        try:
            return r.status, r.content_type, json.loads(text)
        except ValueError:
            return r.status, r.content_type, text


def post(ep: Endpoint, body: Any, raw: bytes | None = None) -> tuple[int, Any]:
    s = ep.open(LIMITS)
    try:
        data = raw if raw is not None else json.dumps(body).encode()
        status, ctype, got = asyncio.run(_post(f"{ep.base_url(s)}/chat/completions", data))
    finally:
        ep.close(s)
    if status >= 400:
        assert_openai_error(status, ctype, got)
    return status, got


def assert_openai_error(status: int, ctype: str, got: Any) -> None:
    assert 400 <= status < 500, (status, got)
    assert ctype == "application/json", (status, ctype, got)
    err = got["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and "code" in err and "param" in err


def well_formed_still_served(ep: Endpoint) -> None:
    status, got = post(ep, {"model": "m", "messages": QUESTION, "tools": [SEARCH_TOOL]})
    assert status == 200 and got["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls"), got


def test_the_reported_three_get_openai_shaped_400s(ep: Endpoint) -> None:
    # a lone surrogate in content, as a raw client sends a surrogateescape'd file name
    status, got = post(ep, None, raw=b'{"messages": [{"role": "user", "content": "file \\ud800.txt"}]}')
    assert status == 400 and got["error"]["code"] == "invalid_unicode"
    assert "messages[0].content" in got["error"]["message"]
    well_formed_still_served(ep)
    # a valid pair (escaped non-BMP text) is text, served
    status, got = post(ep, None, raw=b'{"messages": [{"role": "user", "content": "hi \\ud83d\\ude00"}]}')
    assert status == 200, got
    # an assistant tool call whose function is a string
    msgs = [*QUESTION, {"role": "assistant", "content": None,
                        "tool_calls": [{"id": "c1", "type": "function", "function": "search"}]},
            {"role": "tool", "tool_call_id": "c1", "content": "Vell"}]
    status, got = post(ep, {"messages": msgs})
    assert status == 400 and got["error"]["code"] == "invalid_tool_call"
    well_formed_still_served(ep)
    # JSON nested 100,000 deep, at the top and inside a message
    deep = b"[" * 100_000 + b"]" * 100_000
    for raw in (deep, b'{"messages": [{"role": "user", "content": "x", "extra": ' + deep + b"}]}"):
        status, got = post(ep, None, raw=raw)
        assert status == 400 and got["error"]["code"] == "invalid_json"
        well_formed_still_served(ep)


def test_other_unparseable_bodies_are_400s(ep: Endpoint) -> None:
    for raw in (b"", b"{", b"\xff\xfe{}", b'{"messages": [], "n": ' + b"1" * 5000 + b"}", b"\xed\xa0\x80",
                b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'):
        status, got = post(ep, None, raw=raw)
        assert status == 400 and got["error"]["code"] == "invalid_json", (raw[:40], got)
    well_formed_still_served(ep)


@pytest.mark.parametrize("n", [0, -1])
def test_n_below_one_is_refused_like_openai(ep: Endpoint, n: int) -> None:
    status, got = post(ep, {"messages": QUESTION, "n": n})
    assert status == 400 and got["error"]["param"] == "n" and "at least 1" in got["error"]["message"]
    assert post(ep, {"messages": QUESTION, "n": 1})[0] == 200


# ---------------------------------------------------------------- property-based
_word = st.sampled_from(["system", "user", "assistant", "tool", "search", "text", "function", "\ud800", "a\udfffb",
                         "<tool_call>", "</tool_call>", "<|im_end|>", "{}", '{"query": 1}', ""])
_str = _word | st.text(max_size=12)
_leaf = st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False) | _str
_json = st.recursive(_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(
    st.sampled_from(["role", "content", "tool_calls", "function", "name", "arguments", "id", "type", "text",
                     "tool_call_id", "parameters", "x"]) | st.text(max_size=6), c, max_size=5), max_leaves=24)


def _typed(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a value of the right type (so the request gets past the schema and into the handler), sometimes any
    JSON."""
    return st.one_of(valid, valid, _json)


_call = st.fixed_dictionaries({"id": _typed(_str), "type": _typed(st.just("function")), "function": _typed(
    st.fixed_dictionaries({"name": _typed(_str), "arguments": _typed(_str | st.dictionaries(_str, _json))}))})
_part = st.fixed_dictionaries({"type": _typed(st.just("text")), "text": _typed(_str)})
_message = st.fixed_dictionaries(
    {"role": _typed(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))},
    optional={"content": _typed(_str | st.none() | st.lists(_part, max_size=3)),
              "tool_calls": _typed(st.lists(_call, max_size=2) | st.none()),
              "tool_call_id": _typed(_str), "reasoning_content": _typed(_str), "name": _json})
_tool = st.fixed_dictionaries({"type": _typed(st.just("function")), "function": _typed(st.fixed_dictionaries(
    {"name": _typed(_str)}, optional={"parameters": _json, "description": _typed(_str)}))})
_int = _typed(st.integers(-3, 3) | st.integers(-10**20, 10**20))
_body = st.fixed_dictionaries(
    {"messages": _typed(st.lists(_message, min_size=1, max_size=4))},
    optional={"model": _json, "tools": _typed(st.lists(_tool, max_size=2)), "stream": _typed(st.booleans()),
              "stream_options": _typed(st.fixed_dictionaries({"include_usage": _json})), "n": _int,
              "max_tokens": _int, "max_completion_tokens": _int, "logprobs": _typed(st.booleans()),
              "temperature": _json, "seed": _json, "stop": _json, "tool_choice": _json}) | _json


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=_body)
def test_any_json_gets_2xx_or_an_openai_shaped_4xx_and_the_server_goes_on(ep: Endpoint, body: Any) -> None:
    raw = json.dumps(body).encode()  # ensure_ascii: a lone surrogate travels as its escape, as raw clients send it
    status, got = post(ep, None, raw=raw)
    assert status < 300 or 400 <= status < 500, (status, got)
    if status == 200 and not (isinstance(body, dict) and body.get("stream") is True):
        assert got["object"] == "chat.completion" and got["choices"][0]["message"]["role"] == "assistant"
    well_formed_still_served(ep)

