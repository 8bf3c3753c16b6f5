"""The Search env's HTTP backend coalesces concurrent searches into one /retrieve request per batch.

Against a Search-R1-style server on loopback (real aiohttp, started and stopped here) that counts requests and can
be told to misbehave: each query's hits are `<query>-0, <query>-1, ...` (prefix-consistent, like rlf's indexes).
The same checks against rlf's own retrieval server are in test_retrieval_search_env.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from rlf_envs import runtime
from rlf_envs.env import ToolVectorEnv
from rlf_envs.envs.search import HTTPBackend, SearchEnv
from rlf_envs.retrieval.batcher import BatcherClosed
from rlf_envs.tools import ToolCrashed, ToolError

pytestmark = pytest.mark.timeout(300)


@dataclass
class FakeRetriever:
    """A Search-R1 `/retrieve` on loopback. A query containing BAD makes the whole request a 400 naming it (as rlf's
    and Search-R1's servers answer a request with one invalid query); MALFORMED gets a malformed result list; HUGE
    documents of 20 kB, LONG of 2 kB."""

    url: str = ""
    requests: list[tuple[list[str], int]] = field(default_factory=list)
    mode: str = "ok"  # ok | 500 | garbage | wrong_length | hold
    release: asyncio.Event | None = None  # "hold": answer once set
    arrived: asyncio.Event | None = None  # set when a request arrives

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        queries, topk = body["queries"], body["topk"]
        self.requests.append((queries, topk))
        if self.arrived is not None:
            self.arrived.set()
        if self.mode == "hold" and self.release is not None:
            await self.release.wait()
        if self.mode == "500":
            return web.json_response({"error": "boom"}, status=500)
        if self.mode == "garbage":
            return web.Response(text="<html>not json</html>")
        bad = [i for i, q in enumerate(queries) if "BAD" in q]
        if bad:
            return web.json_response({"error": f"queries.{bad[0]}: not allowed"}, status=400)
        result: list[Any] = []
        for q in queries:
            if "MALFORMED" in q:
                result.append([{"document": {"id": "x"}}])
            else:
                text = "x" * 20_000 if "HUGE" in q else "y" * 2_000 if "LONG" in q else ""
                docs = [{"id": f"{q}-{i}", "contents": f'"{q}"\ndoc {i}{text}'} for i in range(topk)]
                result.append([{"document": d, "score": 10.0 - i} for i, d in enumerate(docs)])
        if self.mode == "wrong_length":
            result = result[:-1]
        return web.json_response({"result": result})


@pytest.fixture()
def fake() -> Iterator[FakeRetriever]:
    server = FakeRetriever()

    async def start() -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/retrieve", server.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        server.release, server.arrived = asyncio.Event(), asyncio.Event()
        return runner

    runner = runtime.run(start())
    try:
        yield server
    finally:
        if server.release is not None:
            runtime.get_loop().call_soon_threadsafe(server.release.set)  # a held handler ends, so cleanup does not wait
        runtime.run(runner.cleanup())


def run(coro: Any) -> Any:
    return runtime.run(coro, timeout=120)


async def _search_all(backend: HTTPBackend, asks: list[tuple[str, int]]) -> list[Any]:
    """All searches at once, like the envs of a vector env; each its hits (ids) or its exception."""
    try:
        found = await asyncio.gather(*(backend.search([q], k) for q, k in asks), return_exceptions=True)
    finally:
        await backend.aclose()
    return [r if isinstance(r, BaseException) else [h.document.id for h in r[0]] for r in found]


def test_concurrent_searches_become_one_request_with_the_same_results(fake: FakeRetriever) -> None:
    asks = [(f"entity {i}", 3) for i in range(64)]
    coalesced = run(_search_all(HTTPBackend(fake.url), asks))
    assert len(fake.requests) == 1 and len(fake.requests[0][0]) == 64
    fake.requests.clear()
    single = run(_search_all(HTTPBackend(fake.url, coalesce=False), asks))
    assert len(fake.requests) == 64  # the baseline: one request per search
    assert coalesced == single == [[f"entity {i}-{j}" for j in range(3)] for i in range(64)]


def test_identical_queries_are_searched_once_with_the_largest_topk(fake: FakeRetriever) -> None:
    asks = [(f"entity {i % 8}", 1 + i % 5) for i in range(40)]
    coalesced = run(_search_all(HTTPBackend(fake.url), asks))
    [(queries, topk)] = fake.requests
    assert sorted(queries) == sorted({q for q, _ in asks}) and topk == 5
    fake.requests.clear()
    assert coalesced == run(_search_all(HTTPBackend(fake.url, coalesce=False), asks))
    assert [len(r) for r in coalesced] == [k for _, k in asks]


def test_max_batch_bounds_every_request(fake: FakeRetriever) -> None:
    found = run(_search_all(HTTPBackend(fake.url, max_batch=10), [(f"e{i}", 2) for i in range(64)]))
    assert sorted((len(q) for q, _ in fake.requests), reverse=True) == [10] * 6 + [4]  # sent at once, any order
    assert found == [[f"e{i}-0", f"e{i}-1"] for i in range(64)]
    with pytest.raises(ValueError, match="max_batch must be an integer between 1 and 512"):
        HTTPBackend(fake.url, max_batch=513)


def test_a_rejected_query_fails_alone(fake: FakeRetriever) -> None:
    asks = [(f"entity {i}", 3) for i in range(16)]
    asks[5] = ("BAD one", 3)
    asks[11] = ("MALFORMED one", 3)
    found = run(_search_all(HTTPBackend(fake.url), asks))
    assert isinstance(found[5], ToolError) and str(found[5]) == "search rejected: queries.0: not allowed"
    assert isinstance(found[11], ToolError) and "sent an unexpected response" in str(found[11])
    assert all(r == [f"entity {i}-{j}" for j in range(3)] for i, r in enumerate(found) if i not in (5, 11))
    # split in halves until the bad query stood alone: a handful of requests, not one per search
    assert len(fake.requests) < 16 and fake.requests[0][0] == [q for q, _ in asks]
    # the message a search sees is the one it saw with one request per search
    fake.requests.clear()
    single = run(_search_all(HTTPBackend(fake.url, coalesce=False), asks))
    assert str(single[5]) == str(found[5]) and str(single[11]) == str(found[11])


def test_a_large_reply_is_read_whole_and_an_oversized_one_fails_only_its_query(fake: FakeRetriever) -> None:
    # 64 x 3 documents of 2 kB: a 400 kB reply arrives in many chunks and is read whole
    found = run(_search_all(HTTPBackend(fake.url), [(f"LONG {i}", 3) for i in range(64)]))
    assert found == [[f"LONG {i}-{j}" for j in range(3)] for i in range(64)]
    # a cap of 5 kB per query: the batch's reply (one query's 60 kB in it) is over its 40 kB, so it is split
    # until that query stands alone, over its own cap, as it would be with one request per search
    fake.requests.clear()
    asks = [(f"e{i}", 3) for i in range(8)]
    asks[2] = ("HUGE one", 3)
    found = run(_search_all(HTTPBackend(fake.url, max_response_bytes=5_000), asks))
    assert isinstance(found[2], ToolError) and "sent an unexpected response" in str(found[2])
    assert all(r == [f"e{i}-{j}" for j in range(3)] for i, r in enumerate(found) if i != 2)
    assert 1 < len(fake.requests) < 8


def test_a_search_past_its_deadline_drops_out_without_breaking_its_batch(fake: FakeRetriever) -> None:
    fake.mode = "hold"

    async def scenario() -> tuple[list[Any], Any]:
        assert fake.release is not None and fake.arrived is not None
        backend = HTTPBackend(fake.url)
        try:

            async def search(i: int) -> Any:
                if i != 3:
                    return await backend.search([f"e{i}"], 2)
                async with asyncio.timeout(0.05):  # this one has a short deadline of its own
                    return await backend.search([f"e{i}"], 2)

            tasks = [asyncio.create_task(search(i)) for i in range(8)]
            tasks[5].cancel()  # and this one's caller gives up before the batch goes out
            await fake.arrived.wait()  # the batch is at the server, which holds it
            await asyncio.wait([tasks[3]])  # until that search's deadline fired
            fake.release.set()
            found = await asyncio.gather(*tasks, return_exceptions=True)
            return found, await backend.search(["after"], 1)  # and the backend still works
        finally:
            await backend.aclose()

    found, after = run(scenario())
    assert isinstance(found[3], TimeoutError) and isinstance(found[5], asyncio.CancelledError)
    assert [[h.document.id for h in r[0]] for i, r in enumerate(found) if i not in (3, 5)] == [
        [f"e{i}-0", f"e{i}-1"] for i in range(8) if i not in (3, 5)
    ]
    assert [h.document.id for h in after[0]] == ["after-0"]
    assert [len(q) for q, _ in fake.requests] == [7, 1]  # e5 was cancelled before the batch went out


def test_vector_env_turn_is_one_request_with_the_uncoalesced_observations(fake: FakeRetriever) -> None:
    def turn(coalesce: bool) -> list[str]:
        venv = ToolVectorEnv(
            env_fns=[lambda: SearchEnv(retriever=fake.url, split="test", coalesce=coalesce) for _ in range(64)]
        )
        try:
            venv.reset(seed=0)
            actions = [f"<search>entity {i % 48}</search>" for i in range(64)]
            obs, *_ = venv.step(actions)
            return list(obs)
        finally:
            venv.close()
            run(venv.envs[0].search_tool.aclose())

    coalesced = turn(True)
    assert [len(q) for q, _ in fake.requests] == [48]
    fake.requests.clear()
    assert coalesced == turn(False) and len(fake.requests) == 64
    assert 'Doc 1(Title: "entity 5") doc 0' in coalesced[5]


@pytest.mark.parametrize(
    ("mode", "kind", "message"),
    [
        ("500", ToolCrashed, "retrieval server answered HTTP 500"),
        ("garbage", ToolError, "sent an unexpected response"),
        ("wrong_length", ToolError, "sent an unexpected response"),
    ],
)
def test_a_failed_request_fails_its_batch_with_todays_errors(
    fake: FakeRetriever, mode: str, kind: type[Exception], message: str
) -> None:
    fake.mode = mode
    found = run(_search_all(HTTPBackend(fake.url), [(f"e{i}", 3) for i in range(8)]))
    assert all(isinstance(r, kind) and message in str(r) for r in found), found
    assert len(fake.requests) == 1
    fake.requests.clear()
    single = run(_search_all(HTTPBackend(fake.url, coalesce=False), [(f"e{i}", 3) for i in range(8)]))
    assert [str(r) for r in single] == [str(r) for r in found]


def test_server_down_fails_the_batch_as_crashed(fake: FakeRetriever) -> None:
    url = fake.url
    down = HTTPBackend(url.rsplit(":", 1)[0] + ":9")  # nothing listens on port 9 (discard) on loopback
    found = run(_search_all(down, [(f"e{i}", 3) for i in range(8)]))
    assert all(isinstance(r, ToolCrashed) and "cannot reach the retrieval server" in str(r) for r in found), found
    assert down.requests == 1  # the batch's one request failed, and no search tried on its own


def test_closing_fails_the_searches_of_a_batch_in_flight_and_later_ones(fake: FakeRetriever) -> None:
    fake.mode = "hold"

    async def scenario() -> tuple[list[Any], Any]:
        assert fake.arrived is not None
        backend = HTTPBackend(fake.url)
        tasks = [asyncio.create_task(backend.search([f"e{i}"], 2)) for i in range(4)]
        await fake.arrived.wait()
        await backend.aclose()
        found = await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await backend.search(["late"], 1)
        except BatcherClosed as e:
            return found, e
        return found, None

    found, late = run(scenario())
    assert all(isinstance(r, BatcherClosed) for r in found), found
    assert isinstance(late, BatcherClosed)


def test_searches_left_on_a_stopped_loop_do_not_block_the_next_loop(fake: FakeRetriever) -> None:
    # searches wait in the batcher on a private loop that stops before their batch goes out; the same backend
    # then serves rlf's loop (its batcher starts afresh there, as the in-process one does)
    from rlf_envs.tools.http import http_session

    run(http_session())  # rlf's shared session exists on rlf's loop, before the private loop could make one
    backend = HTTPBackend(fake.url)
    private = asyncio.new_event_loop()
    try:

        async def strand() -> None:
            stranded = [asyncio.create_task(backend.search([f"e{i}"], 2)) for i in range(4)]
            await asyncio.sleep(0)  # they are waiting in the batcher now; the loop stops before its task runs
            assert backend.batcher is not None and len(backend.batcher._pending) == len(stranded)

        private.run_until_complete(strand())
    finally:
        private.close()
    assert run(_search_all(backend, [("after", 2)])) == [["after-0", "after-1"]]
    assert fake.requests == [(["after"], 2)]


def test_search_env_threads_coalesce_through(fake: FakeRetriever) -> None:
    on = SearchEnv(retriever=fake.url, split="test")
    off = SearchEnv(retriever=fake.url, split="test", coalesce=False)
    small = SearchEnv(retriever=fake.url, split="test", max_batch=7)
    try:
        assert on.search_tool.backend.batcher is not None  # type: ignore[attr-defined]
        assert off.search_tool.backend.batcher is None  # type: ignore[attr-defined]
        assert small.search_tool.backend.max_batch == 7  # type: ignore[attr-defined]
        assert len({id(on.search_tool), id(off.search_tool), id(small.search_tool)}) == 3
        with pytest.raises(ValueError, match="max_batch"):
            SearchEnv(retriever=fake.url, max_batch=0)
    finally:
        for env in (on, off, small):
            run(env.search_tool.aclose())
