"""A small OpenAI-compatible chat server (aiohttp) that plays a scripted policy, for rlf_envs.eval tests.

It runs on its own event loop in a thread (rlf_envs.eval runs on rlf's loop). The policy solves
Calculator questions ("What is 12 * 34?") or searches the question (Search-v0), in one of these modes:

- "native": tool calls in the API's `tool_calls` field; "text": `<tool_call>` blocks in the content
- "malformed": the first call of an episode has arguments that are not JSON (then a good call)
- "search_r1": `<search>question` with the stop string cut off (as OpenAI servers do), then an answer

and with these faults: `slow_first` (the first k attempts of each distinct request sleep `delay_s`),
`error_first` (the first k attempts of each distinct request are 500s), `always_error`, `always_slow`.
Faults are per request content, not per arrival order, so concurrency cannot change what a test sees.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

_EXPR = re.compile(r"What is (.+?)\?")


@dataclass
class FakeChatServer:
    mode: str = "native"
    slow_first: int = 0
    error_first: int = 0
    always_error: bool = False
    always_slow: bool = False
    delay_s: float = 5.0
    requests: int = 0
    errors_sent: int = 0
    slow_sent: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    attempts: Counter[str] = field(default_factory=Counter)
    url: str = ""
    closing: asyncio.Event | None = None  # set on stop: slow handlers return at once

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        body = await request.json()
        self.bodies.append(body)
        key = json.dumps(body["messages"], sort_keys=True)
        self.attempts[key] += 1
        k = self.attempts[key]
        if self.always_error or k <= self.error_first:
            self.errors_sent += 1
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        if self.always_slow or k <= self.slow_first:
            self.slow_sent += 1
            assert self.closing is not None
            try:
                await asyncio.wait_for(self.closing.wait(), self.delay_s)
            except TimeoutError:
                pass
        return web.json_response(self.reply(body["messages"], body.get("model", "")))

    def reply(self, messages: list[dict[str, Any]], model: str) -> dict[str, Any]:
        first_user = next(m["content"] for m in messages if m["role"] == "user")
        last = messages[-1]
        content: str | None = None
        calls: list[dict[str, Any]] = []
        finish = "stop"
        if self.mode == "search_r1":
            question = first_user.rsplit("Question:", 1)[-1].strip()
            if len(messages) > 1 and "<information>" in last["content"]:
                content = "<answer>nobody knows"  # the stop string '</answer>' cut off by the server
            else:
                content = f"<search>{question}"
        else:
            m = _EXPR.search(first_user)
            expr = m.group(1) if m else "1 + 1"
            if last["role"] == "tool" or "<tool_response>" in (last.get("content") or ""):
                result = last["content"].replace("<tool_response>", "").replace("</tool_response>", "").strip()
                content = f"<answer>{result}</answer>"
            else:
                bad = self.mode == "malformed" and not any(x["role"] == "tool" or "invalid" in (x.get("content") or "")
                                                           for x in messages)
                args = '{"expression": ' if bad else json.dumps({"expression": expr})
                if self.mode == "text":
                    content = f'<tool_call>\n{{"name": "calculator", "arguments": {args}}}\n</tool_call>'
                else:
                    calls = [{"id": f"call_{self.requests}", "type": "function",
                              "function": {"name": "calculator", "arguments": args}}]
                    finish = "tool_calls"
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        return {"id": f"chatcmpl-{self.requests}", "object": "chat.completion", "created": 0, "model": model,
                "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


class RunningServer:
    """Start `FakeChatServer` on 127.0.0.1 in a thread; `stop()` shuts it down."""

    def __init__(self, fake: FakeChatServer) -> None:
        self.fake = fake
        self.loop = asyncio.new_event_loop()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        fake.url = f"http://127.0.0.1:{self.port}/v1"
        app = web.Application()
        app.router.add_post("/v1/chat/completions", fake.handle)
        self.runner = web.AppRunner(app)
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            fake.closing = asyncio.Event()
            self.loop.run_until_complete(self.runner.setup())
            self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        if not ready.wait(30):
            raise RuntimeError("fake chat server did not start")

    def stop(self) -> None:
        assert self.fake.closing is not None
        self.loop.call_soon_threadsafe(self.fake.closing.set)
        fut = asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop)
        try:
            fut.result(30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
            self.loop.close()
