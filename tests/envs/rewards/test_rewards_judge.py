"""Model judge against a real aiohttp server on loopback that speaks the chat-completions API."""

from __future__ import annotations

import asyncio
import json
import socket
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from rlf_envs.rewards import ModelJudge, build_verifier, parse_judge_score
from rlf_envs.types import Action, ActionKind, Task, Trajectory, Turn


@dataclass
class FakeJudgeServer:
    """Behaviour is chosen by the candidate answer in the prompt (after 'Candidate answer:')."""

    url: str = ""
    hits: Counter[str] = field(default_factory=Counter)
    auth: list[str | None] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        user = body["messages"][-1]["content"]
        answer = user.split("Candidate answer:\n", 1)[1].split("\n", 1)[0].strip()
        self.hits[answer] += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self.respond(answer)
        finally:
            self.in_flight -= 1

    async def respond(self, answer: str) -> web.StreamResponse:
        def chat(content: str) -> web.Response:
            return web.json_response({"id": "x", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]})

        if answer.startswith("correct"):
            return chat("<think>checking <score>0</score></think>The answer matches. <score>1</score>")
        if answer.startswith("wrong"):
            return chat("<score>0</score>")
        if answer == "json":
            return chat('Verdict: {"score": 0.7, "reason": "partly"}')
        if answer == "garbage":
            return chat("I think it is probably fine?")
        if answer == "outofrange":
            return chat("<score>7</score>")
        if answer == "http500":
            return web.Response(status=500, text="internal error")
        if answer == "flaky":
            if self.hits[answer] <= 2:
                return web.Response(status=503, text="overloaded")
            return chat("<score>1</score>")
        if answer == "unauthorized":
            return web.Response(status=401, text='{"error": "bad key"}')
        if answer == "notjson":
            return web.Response(text="<html>proxy error</html>", content_type="text/html")
        if answer == "nochoices":
            return web.json_response({"choices": []})
        if answer == "huge":
            return web.Response(body=b"x" * 3_000_000)
        if answer.startswith("slowish"):
            await asyncio.sleep(0.15)
            return chat("<score>1</score>")
        if answer == "hang":
            await asyncio.sleep(300)
        return chat("<score>0.5</score>")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest_asyncio.fixture
async def server() -> AsyncIterator[FakeJudgeServer]:
    fake = FakeJudgeServer()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    fake.url = f"http://127.0.0.1:{port}/v1"
    try:
        yield fake
    finally:
        await runner.cleanup()


def traj(answer: str | None, tid: str = "t") -> Trajectory:
    task = Task(tid, "Who wrote Hamlet?", {"target": ["William Shakespeare", "Shakespeare"]})
    turns = [Turn(Action(ActionKind.ANSWER, f"<answer>{answer}</answer>", answer=answer))] if answer else []
    return Trajectory(task, "P", turns, answer)


def judge(server: FakeJudgeServer, **kw: Any) -> ModelJudge:
    cfg = {"type": "judge", "base_url": server.url, "model": "judge-model", "backoff_s": 0.01, **kw}
    v = build_verifier(cfg)
    assert isinstance(v, ModelJudge)
    return v


async def value(j: ModelJudge, answer: str | None) -> tuple[float, dict[str, float]]:
    t = traj(answer)
    s = await j.safe_score(t, t.task)
    return s.value, s.info


@pytest.mark.parametrize(
    ("content", "expected"),
    [("<score>1</score>", 1.0), ("<SCORE> 0.25 </SCORE>", 0.25), ("<score>0</score> then <score>1</score>", 1.0),
     ("<think><score>1</score></think> <score>0</score>", 0.0), ('{"score": 0.5}', 0.5), ('x {"score": "0.3"} y', 0.3),
     ('{"score": true}', None), ("score: 1", None), ("<score>nan</score>", None), ("", None), ("{" * 5000, None)],
)
def test_parse_judge_score(content: str, expected: float | None) -> None:
    assert parse_judge_score(content) == expected


@pytest.mark.asyncio
async def test_happy_path_prompt_and_api_key(server: FakeJudgeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLF_TEST_JUDGE_KEY", "secret-123")
    async with judge(server, api_key_env="RLF_TEST_JUDGE_KEY", extra_body={"top_p": 1.0}) as j:
        assert (await value(j, "correct"))[0] == 1.0
        assert (await value(j, "wrong"))[0] == 0.0
        assert (await value(j, "json"))[0] == pytest.approx(0.7)
        assert (await value(j, None)) == (0.0, {"judge": 0.0, "judge/no_answer": 1.0})
    assert server.auth == ["Bearer secret-123"] * 3
    body = server.bodies[0]
    assert body["model"] == "judge-model" and body["temperature"] == 0.0 and body["top_p"] == 1.0
    user = body["messages"][-1]["content"]
    assert "Who wrote Hamlet?" in user and "- William Shakespeare\n- Shakespeare" in user and "correct" in user
    assert body["messages"][0]["role"] == "system"
    assert j.stats.successes == 3 and j.stats.failures == 0 and j._session is None


@pytest.mark.asyncio
async def test_custom_template_and_score_range(server: FakeJudgeServer) -> None:
    tpl = "Q: {question}\nGold: {gold}\nCandidate answer:\n{answer}\nRate 0-10 as JSON like {{\"score\": 7}}."
    async with judge(server, prompt_template=tpl, score_max=10, system_prompt=None) as j:
        assert (await value(j, "outofrange"))[0] == pytest.approx(0.7)
    assert len(server.bodies[0]["messages"]) == 1 and '{"score": 7}' in server.bodies[0]["messages"][0]["content"]


@pytest.mark.asyncio
async def test_cache_and_inflight_dedup(server: FakeJudgeServer) -> None:
    async with judge(server) as j:
        scores = await j.score_batch([traj("correct") for _ in range(20)])
        assert all(s.value == 1.0 for s in scores)
        assert server.hits["correct"] == 1
        v, info = await value(j, "correct")
        assert v == 1.0 and info["judge/cache_hit"] == 1.0
        assert server.hits["correct"] == 1 and j.stats.deduplicated == 19 and j.stats.cache_hits == 1
    async with judge(server, cache_size=0) as j2:
        await value(j2, "wrong")
        await value(j2, "wrong")
    assert server.hits["wrong"] == 2


@pytest.mark.asyncio
async def test_concurrency_limit(server: FakeJudgeServer) -> None:
    async with judge(server, max_concurrency=3) as j:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        scores = await j.score_batch([traj(f"slowish{i}") for i in range(12)])
        dt = loop.time() - t0
    assert [s.value for s in scores] == [1.0] * 12
    assert server.max_in_flight == 3
    assert dt > 0.55  # 12 requests of 0.15 s, at most 3 at a time: at least 4 waves (no upper bound: load)


@pytest.mark.asyncio
async def test_timeouts_are_bounded_and_counted(server: FakeJudgeServer) -> None:
    async with judge(server, timeout_s=0.2, max_retries=1, fallback=-1.0) as j:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        v, info = await value(j, "hang")
        assert loop.time() - t0 < 120.0  # two attempts of 0.2 s fired; the server hangs 300 s each
    assert v == -1.0 and info["judge/failed"] == 1.0
    assert server.hits["hang"] == 2 and j.stats.timeouts == 2 and j.stats.retries == 1 and j.stats.failures == 1


@pytest.mark.asyncio
async def test_http_500_retried_then_fallback_and_flaky_recovers(server: FakeJudgeServer) -> None:
    async with judge(server, max_retries=2, fallback=0.123) as j:
        v, _ = await value(j, "http500")
        assert v == 0.123 and server.hits["http500"] == 3 and j.stats.http_errors == 3
        v, _ = await value(j, "flaky")  # 503, 503, ok
        assert v == 1.0 and server.hits["flaky"] == 3
        assert j.stats.retries == 4 and j.stats.failures == 1 and j.stats.successes == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("answer", ["garbage", "outofrange", "notjson", "nochoices", "huge", "unauthorized"])
async def test_garbage_and_client_errors_are_not_retried(server: FakeJudgeServer, answer: str) -> None:
    async with judge(server, max_retries=3, fallback=0.0) as j:
        v, info = await value(j, answer)
    assert v == 0.0 and info["judge/failed"] == 1.0
    assert server.hits[answer] == 1 and j.stats.failures == 1


@pytest.mark.asyncio
async def test_retry_on_parse_error_is_opt_in(server: FakeJudgeServer) -> None:
    async with judge(server, max_retries=2, retry_on_parse_error=True) as j:
        await value(j, "garbage")
    assert server.hits["garbage"] == 3 and j.stats.parse_errors == 3


@pytest.mark.asyncio
async def test_connection_refused_gives_fallback() -> None:
    j = build_verifier({"type": "judge", "base_url": f"http://127.0.0.1:{free_port()}/v1", "model": "m",
                        "max_retries": 1, "backoff_s": 0.01, "fallback": 0.5})
    assert isinstance(j, ModelJudge)
    try:
        v, _ = await value(j, "correct")
    finally:
        await j.aclose()
    assert v == 0.5 and j.stats.connection_errors == 2 and j.stats.failures == 1


@pytest.mark.asyncio
async def test_mixed_batch_goes_on(server: FakeJudgeServer) -> None:
    answers = ["correct", "http500", "garbage", "wrong", "json", "hang"]
    async with judge(server, max_retries=0, timeout_s=3.0, fallback=-1) as j:  # answers in time on a busy machine
        scores = await j.score_batch([traj(a, tid=f"id{i}") for i, a in enumerate(answers)])
    assert [s.value for s in scores] == pytest.approx([1.0, -1, -1, 0.0, 0.7, -1])
    assert j.stats.as_dict()["failures"] == 3
    assert json.dumps(j.stats.as_dict())  # loggable


@pytest.mark.asyncio
async def test_session_is_recreated_for_a_new_event_loop(server: FakeJudgeServer) -> None:
    j = judge(server)
    assert (await value(j, "correct"))[0] == 1.0
    first = j._session
    # Simulate use from another loop: the judge must not reuse a session bound to a different loop.
    j._loop = object()  # type: ignore[assignment]
    assert (await value(j, "wrong"))[0] == 0.0
    assert j._session is not first
    assert first is not None
    await first.close()
    await j.aclose()


@pytest.mark.asyncio
async def test_requests_go_through_the_official_openai_client(server: FakeJudgeServer) -> None:
    import openai

    async with judge(server) as j:
        assert (await value(j, "correct"))[0] == 1.0
        assert isinstance(j._session, openai.AsyncOpenAI)
        assert j._session.max_retries == 2 and j._session.timeout == 30.0


def test_without_openai_the_error_names_the_judge_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "openai", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install -e '.*/rlf_envs\[judge\]'"):
        build_verifier({"type": "judge", "base_url": "http://127.0.0.1:1/v1", "model": "m"})
