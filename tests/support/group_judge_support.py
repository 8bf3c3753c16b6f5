"""A scripted OpenAI-compatible group judge on loopback (aiohttp), for the group-judge tests.

The task's question picks the behaviour (`mode[:arg]`). A behaving verdict scores each candidate with the number
its final answer holds ("Final answer: 0.25" -> 0.25; anything else 0), so a test can check that scores come back
to the right trajectories through the shuffle. Misbehaviours: wrong count, out-of-range (0-10 scale), strings,
prose, malformed JSON, NaN, duplicate / missing ids, HTTP 500, a hang, a 400 for response_format json_schema,
and a contract break on the first attempt only.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

CANDIDATE = re.compile(r"<<<(\w+) candidate (c\d+)>>>\n(.*?)\n<<<\1 end>>>", re.DOTALL)
FINAL = re.compile(r"^Final answer: (.*)$", re.MULTILINE)


def candidates(user: str) -> list[tuple[str, str]]:
    """(id, rendering) of every candidate block of a group-judge request, in the order shown."""
    return [(m.group(2), m.group(3)) for m in CANDIDATE.finditer(user)]


def answer_value(text: str) -> float:
    m = FINAL.search(text)
    try:
        v = float(m.group(1)) if m else 0.0
    except ValueError:
        return 0.0
    return v if 0.0 <= v <= 1.0 else 0.0


@dataclass
class ScriptedGroupJudge:
    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    hits: Counter[str] = field(default_factory=Counter)
    in_flight: int = 0
    max_in_flight: int = 0

    def chat(self, content: str, prompt_tokens: int = 100, completion_tokens: int = 20) -> web.Response:
        return web.json_response({
            "id": "x", "object": "chat.completion", "model": "judge",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        user = next(m["content"] for m in body["messages"] if m["role"] == "user")
        mode = user.split("Task:\n", 1)[1].split("\n", 1)[0].strip()
        self.hits[mode] += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self.respond(mode, body, candidates(user))
        finally:
            self.in_flight -= 1

    async def respond(self, mode: str, body: dict[str, Any], cands: list[tuple[str, str]]) -> web.StreamResponse:
        good = [{"id": i, "score": answer_value(text)} for i, text in cands]
        if mode.startswith("slow"):
            await asyncio.sleep(float(mode.split(":")[1]))
            return self.chat(json.dumps({"scores": good}))
        if mode == "count":
            return self.chat(json.dumps({"scores": good[:-1]}))
        if mode == "range":  # a 0-10 habit: 7, 10, 15
            return self.chat(json.dumps({"scores": [{"id": g["id"], "score": [7, 10, 15][k % 3]}
                                                    for k, g in enumerate(good)]}))
        if mode == "ten":  # a 0-10 scale, as configured with score_max: 10
            return self.chat(json.dumps({"scores": [{"id": g["id"], "score": 10 * g["score"]} for g in good]}))
        if mode == "strings":
            return self.chat(json.dumps({"scores": [{"id": g["id"], "score": "high"} for g in good]}))
        if mode == "prose":
            return self.chat("Candidate c1 is clearly the best, the others are weaker.")
        if mode == "malformed":
            return self.chat('{"scores": [{"id": "c1", "score": 0.5}, {"id": "c2", "sco')
        if mode == "nan":
            return self.chat('{"scores": [' + ", ".join(f'{{"id": "{g["id"]}", "score": NaN}}' for g in good) + "]}")
        if mode == "dup_ids":
            return self.chat(json.dumps({"scores": [{"id": good[0]["id"], "score": 0.5} for _ in good]}))
        if mode == "wrong_ids":
            return self.chat(json.dumps({"scores": [{"id": f"t{k}", "score": 0.5} for k in range(len(good))]}))
        if mode == "http500":
            return web.Response(status=500, text="internal error")
        if mode == "hang":
            await asyncio.sleep(300)
        if mode == "no_schema":  # an older server: 400 for json_schema, json_object works
            fmt = (body.get("response_format") or {}).get("type")
            if fmt == "json_schema":
                return web.json_response({"error": {"message": "response_format json_schema is not supported",
                                                    "type": "invalid_request_error"}}, status=400)
            return self.chat(json.dumps({"scores": good}))
        if mode == "too_long":  # a 400 that is not about structured output
            return web.json_response({"error": {"message": "This model's maximum context length is 4096 tokens",
                                                "type": "invalid_request_error"}}, status=400)
        if mode == "once_bad":  # breaks the contract on the first attempt of each verdict only
            if not any(m["role"] == "assistant" for m in body["messages"]):
                return self.chat(json.dumps({"scores": good[:1]}), prompt_tokens=50, completion_tokens=5)
            return self.chat(json.dumps({"scores": good}), prompt_tokens=70, completion_tokens=7)
        if mode == "think_fenced":
            return self.chat("<think>compare them</think>\n```json\n" + json.dumps({"scores": good}) + "\n```")
        if mode == "mapping":
            return self.chat(json.dumps({"scores": {g["id"]: g["score"] for g in good}}))
        return self.chat(json.dumps({"scores": good}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def serve(judge: Any, path: str = "/v1/chat/completions") -> AsyncIterator[Any]:
    """Run `judge.handle` on 127.0.0.1 (a free port) for the block; sets `judge.url` to the base URL."""
    app = web.Application()
    app.router.add_post(path, judge.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    judge.url = f"http://127.0.0.1:{port}/v1"
    try:
        yield judge
    finally:
        await runner.cleanup()
