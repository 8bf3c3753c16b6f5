"""Test helpers for the policy endpoint: a scripted engine (a `GenerateBatchFn` whose replies depend on the
context, as a policy's would) and a running endpoint on rlf's event loop (loopback, a free port)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rlf_envs import runtime
from rlf_envs.env.episodes import Generation
from rlf_envs.env.tokens import TokenizerAdapter
from rlf_envs.formats import Qwen3Format
from rlf_envs.formats.chat import ChatCodec
from rlf_train.rollout.endpoint.engine import EngineFront
from rlf_train.rollout.endpoint.server import PolicyServer
from rlf_train.rollout.endpoint.sessions import EndpointLimits, Session

SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Search the encyclopedia.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "capital of Zorbania"}}\n</tool_call><|im_end|>'
ANSWER = "<answer>Vell</answer><|im_end|>"


def search_then_answer(context: str) -> str:
    """A policy that searches once, then answers once it has seen a tool response."""
    return ANSWER if "<tool_response>" in context else CALL


@dataclass
class ScriptedEngine:
    """Replies chosen by `script(context_text)`, tokenized with the real tokenizer; every call recorded."""

    tokenizer: Any
    script: Callable[[str], str] = search_then_answer
    calls: list[tuple[list[int], int, list[int]]] = field(default_factory=list)  # (context, max_tokens, ids)

    def __post_init__(self) -> None:
        self.adapter = TokenizerAdapter.shared(self.tokenizer)

    async def __call__(self, contexts: list[list[int]], max_tokens: list[int], stop: Sequence[str]
                       ) -> list[Generation]:
        out = []
        for c, m in zip(contexts, max_tokens, strict=True):
            ids = self.adapter.encode(self.script(self.adapter.decode(c)))
            finish = "stop"
            if len(ids) > m:
                ids, finish = ids[:m], "length"
            self.calls.append((list(c), m, list(ids)))
            out.append(Generation(ids, [-0.25] * len(ids), finish))
        return out


@dataclass
class Endpoint:
    server: PolicyServer
    engine: ScriptedEngine
    codec: ChatCodec
    opened: int = 0

    def open(self, limits: EndpointLimits | None = None) -> Session:
        self.opened += 1
        s = Session(f"t{self.opened}", self.codec, self.engine.adapter.encode, limits or LIMITS, meta=None)
        self.server.sessions.add(s)
        return s

    def base_url(self, s: Session) -> str:
        return self.server.base_url(s)

    def close(self, s: Session) -> None:
        runtime.run(_remove(self.server, s))


async def _remove(server: PolicyServer, s: Session) -> None:
    server.sessions.remove(s)


LIMITS = EndpointLimits(max_total_tokens=4096, max_new_tokens=64, timeout_s=60.0)


@contextmanager
def running_endpoint(tokenizer: Any, script: Callable[[str], str] = search_then_answer,
                     fmt: Any = None, max_body_bytes: int = 4 << 20) -> Iterator[Endpoint]:
    codec = ChatCodec(fmt or Qwen3Format())
    engine = ScriptedEngine(tokenizer, script)
    front = EngineFront(engine, codec.stop_strings, window_s=0.001)
    server = PolicyServer(front, engine.adapter.decode, max_body_bytes=max_body_bytes)
    runtime.run(server.start())
    try:
        yield Endpoint(server, engine, codec)
    finally:
        runtime.run(server.close())


def generated_ids(s: Session) -> list[int]:
    """Every id the session's first segment marks as generated, in order."""
    seg = s.segments[0]
    return [t for t, m in zip(seg.ids, seg.mask, strict=True) if m]


def tool_result(call_id: str, content: str = "Vell is the capital of Zorbania.") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def dump(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


_QWEN3: list[Any] = []


def qwen3_tokenizer() -> Any:
    """The real Qwen3 vocabulary built offline (tests/train/hf/test_qwen3_vocab.py's recipe), once per process."""
    if not _QWEN3:
        from tests.train.hf import test_qwen3_vocab

        _QWEN3.append(test_qwen3_vocab.qwen3.__wrapped__())  # type: ignore[attr-defined]
    return _QWEN3[0]
