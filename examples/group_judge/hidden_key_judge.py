"""A scripted OpenAI-compatible group judge that ranks by a hidden criterion: correctness against an answer key it
is given out of band (never shown to the policy, never sent in the request). It stands in for a real judge model
in the quickstart-sized demonstration that GRPO learns from group-judge rewards (examples/group_judge/
train_quickstart.py) and in the trainer's group-reward test.

It reads each candidate's "Final answer:" line from rlf's group-judge request and scores 1.0 for a correct answer,
0.1 for a wrong one and 0.0 for none, replying in the requested shape ({"scores": [{"id", "score"}...]}).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from aiohttp import web

from rlf_envs.rewards import exact_match

CANDIDATE = re.compile(r"<<<(\w+) candidate (c\d+)>>>\n(.*?)\n<<<\1 end>>>", re.DOTALL)
FINAL = re.compile(r"^Final answer: (.*)$", re.MULTILINE)


@dataclass
class HiddenKeyJudge:
    """`key`: question -> acceptable answers (the hidden criterion)."""

    key: Mapping[str, Sequence[str]]
    requests: int = 0
    unknown: int = 0
    formats: dict[str, int] = field(default_factory=dict)

    def score(self, question: str, text: str) -> float:
        m = FINAL.search(text)
        if m is None:
            return 0.0
        return 1.0 if exact_match(m.group(1), self.key.get(question, ())) else 0.1

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests += 1
        fmt = (body.get("response_format") or {}).get("type", "none")
        self.formats[fmt] = self.formats.get(fmt, 0) + 1
        user = next(m["content"] for m in body["messages"] if m["role"] == "user")
        question = user.split("Task:\n", 1)[1].split("\n\n", 1)[0].strip()
        if question not in self.key:
            self.unknown += 1
            return web.json_response({"error": {"message": f"unknown task {question[:80]!r}"}}, status=500)
        scores = [{"id": m.group(2), "score": self.score(question, m.group(3))} for m in CANDIDATE.finditer(user)]
        content = json.dumps({"scores": scores})
        return web.json_response({
            "id": f"j{self.requests}", "object": "chat.completion", "model": body.get("model", "hidden-key"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(user) // 4, "completion_tokens": len(content) // 4,
                      "total_tokens": (len(user) + len(content)) // 4}})


@contextmanager
def judge_server(judge: HiddenKeyJudge, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve `judge` on a free loopback port from a thread of its own; yields the base URL (.../v1)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    loop = asyncio.new_event_loop()
    runner: list[web.AppRunner] = []
    started = threading.Event()

    async def start() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", judge.handle)
        r = web.AppRunner(app, shutdown_timeout=0.5)
        await r.setup()
        await web.TCPSite(r, host, port).start()
        runner.append(r)

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="hidden-key-judge", daemon=True)
    thread.start()
    try:
        if not started.wait(30):
            raise RuntimeError("the scripted judge did not start within 30 s")
        yield f"http://{host}:{port}/v1"
    finally:
        if runner:
            asyncio.run_coroutine_threadsafe(runner[0].cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
