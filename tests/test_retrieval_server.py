"""The retrieval server as a real subprocess on loopback: Search-R1 API, bad inputs, load, signals, CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from rlf_envs.retrieval import BM25Index, load_index
from servers.retrieval.app import Limits, RetrieveRequest, parse_request
from servers.retrieval.process import ROOT, ServerProcess

pytestmark = [pytest.mark.retrieval, pytest.mark.timeout(600)]  # a hang guard, generous for a loaded machine

CORPUS = ROOT / "rlf_envs" / "src" / "rlf_envs" / "data" / "search" / "corpus.jsonl"
TEST_QUESTIONS = ROOT / "rlf_envs" / "src" / "rlf_envs" / "data" / "search" / "test.jsonl"
LIMIT_ARGS = ["--max-queries", "8", "--max-topk", "10", "--max-body-bytes", "4096", "--max-query-chars", "200"]


@pytest.fixture(scope="module")
def index_dir(bm25_index_dir: Path) -> Path:
    return bm25_index_dir


@pytest.fixture(scope="module")
def server(index_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(index_dir, LIMIT_ARGS) as srv:
        yield srv
    assert srv.returncode == 0, "".join(srv.stderr_tail)


@pytest.fixture(scope="module")
def local(index_dir: Path) -> BM25Index:
    index = load_index(index_dir)
    assert isinstance(index, BM25Index)
    return index


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
        yield s


async def _post(http: aiohttp.ClientSession, url: str, body: object | bytes) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url + "/retrieve", data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


# -- happy path --------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_search_r1_request_with_scores(server: ServerProcess, http: aiohttp.ClientSession) -> None:
    assert server.url.startswith("http://127.0.0.1:")
    queries = ["What is the capital of Dolamia?", "Trosto"]
    status, body = await _post(http, server.url, {"queries": queries, "topk": 3, "return_scores": True})
    assert status == 200
    assert list(body) == ["result"] and len(body["result"]) == 2
    for hits in body["result"]:
        assert len(hits) == 3
        for h in hits:
            assert set(h) == {"document", "score"} and set(h["document"]) == {"id", "contents"}
            assert isinstance(h["score"], float)
    assert body["result"][0][0]["document"]["contents"].startswith('"Dolamia"\n')
    assert body["result"][1][0]["document"]["contents"].startswith('"Trosto"\n')


@pytest.mark.asyncio
async def test_without_scores_returns_documents_only(server: ServerProcess, http: aiohttp.ClientSession) -> None:
    status, body = await _post(http, server.url, {"queries": ["Trosto"], "topk": 2, "return_scores": False})
    assert status == 200
    [hits] = body["result"]
    assert len(hits) == 2 and all(set(d) == {"id", "contents"} for d in hits)
    # defaults: topk=3, return_scores=false (Search-R1's server defaults)
    status, body = await _post(http, server.url, {"queries": ["Trosto"]})
    assert status == 200 and len(body["result"][0]) == 3 and "score" not in body["result"][0][0]


@pytest.mark.asyncio
async def test_matches_in_process_search(server: ServerProcess, local: BM25Index, http: aiohttp.ClientSession) -> None:
    queries = ["Who is the mayor of Trosto?", "In which year was Dolamia founded?", "poet born in 1800"]
    status, body = await _post(http, server.url, {"queries": queries, "topk": 5, "return_scores": True})
    assert status == 200
    want = local.search_batch(queries, 5)
    assert body["result"] == [[h.to_dict() for h in hits] for hits in want]


@pytest.mark.asyncio
async def test_health(server: ServerProcess, http: aiohttp.ClientSession) -> None:
    async with http.get(server.url + "/health") as r:
        assert r.status == 200
        body = await r.json()
    assert body["status"] == "ok" and body["kind"] == "bm25" and body["count"] == 450


# -- bad input ---------------------------------------------------------------------------------------


BAD_BODIES: list[tuple[object | bytes, str]] = [
    (b"{not json", "malformed JSON"),
    (b"", "body: empty"),
    (b"\xff\xfe", "malformed JSON"),
    ([1, 2], "must be a JSON object"),
    ("just a string", "must be a JSON object"),
    ({"topk": 3}, "queries: Field required"),
    ({"queries": "Trosto"}, "queries: Input should be a valid list"),
    ({"queries": ["ok", 3]}, "queries.1: Input should be a valid string"),
    ({"queries": [None]}, "queries.0: Input should be a valid string"),
    ({"queries": ["ok"], "topk": "3"}, "topk: Input should be a valid integer"),
    ({"queries": ["ok"], "topk": 2.5}, "topk: Input should be a valid integer"),
    ({"queries": ["ok"], "topk": True}, "topk: Input should be a valid integer"),
    ({"queries": ["ok"], "return_scores": "yes"}, "return_scores: Input should be a valid boolean"),
    ({"queries": []}, "queries: must hold at least one query"),
    ({"queries": ["q"] * 9}, "queries: at most 8 queries per request, got 9"),
    ({"queries": ["ok", "  "]}, "queries.1: empty query"),
    ({"queries": ["x" * 201]}, "queries.0: 201 characters exceeds the limit of 200"),
    ({"queries": ["ok"], "topk": 0}, "topk: must be between 1 and 10, got 0"),
    ({"queries": ["ok"], "topk": -1}, "topk: must be between 1 and 10, got -1"),
    ({"queries": ["ok"], "topk": 11}, "topk: must be between 1 and 10, got 11"),
    (json.dumps({"queries": ["a" * 100] * 5, "pad": "x" * 5000}).encode(), "exceeds the limit of 4096 bytes"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("body", "message"), BAD_BODIES)
async def test_bad_requests_get_400_json(
    server: ServerProcess, http: aiohttp.ClientSession, body: object | bytes, message: str
) -> None:
    status, reply = await _post(http, server.url, body)
    assert status == 400
    assert list(reply) == ["error"]
    assert message in reply["error"]


@pytest.mark.asyncio
async def test_oversize_chunked_body_without_length(server: ServerProcess, http: aiohttp.ClientSession) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"queries": ["'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"]}'

    async with http.post(server.url + "/retrieve", data=chunks()) as r:
        assert r.status == 400
        assert "more than the limit of 4096 bytes" in (await r.json())["error"]


@pytest.mark.asyncio
async def test_unknown_route_and_method_are_json(server: ServerProcess, http: aiohttp.ClientSession) -> None:
    async with http.get(server.url + "/nope") as r:
        assert r.status == 404 and "error" in await r.json()
    async with http.get(server.url + "/retrieve") as r:
        assert r.status == 405 and "error" in await r.json()


@pytest.mark.asyncio
async def test_server_survives_bad_input(server: ServerProcess, http: aiohttp.ClientSession) -> None:
    for body, _ in BAD_BODIES[:5]:
        await _post(http, server.url, body)
    status, _ = await _post(http, server.url, {"queries": ["Trosto"]})
    assert status == 200


def test_parse_request_unit() -> None:
    limits = Limits(max_queries=2, max_topk=5)
    assert parse_request(b'{"queries": ["a"], "extra": 1}', limits) == RetrieveRequest(queries=["a"])


# -- concurrency -------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_concurrent_load_zero_errors_identical_results(
    server: ServerProcess, local: BM25Index, http: aiohttp.ClientSession
) -> None:
    questions = [json.loads(line)["question"] for line in TEST_QUESTIONS.read_text().splitlines()]
    clients, per_client = 64, 6
    work = [
        (questions[(c * per_client + i) % len(questions)], 1 + (c + i) % 5)
        for c in range(clients)
        for i in range(per_client)
    ]
    results: dict[int, object] = {}
    errors: list[str] = []
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as s:

        async def client(c: int) -> None:
            for i in range(per_client):
                j = c * per_client + i
                q, k = work[j]
                async with s.post(
                    server.url + "/retrieve", json={"queries": [q], "topk": k, "return_scores": True}
                ) as r:
                    if r.status != 200:
                        errors.append(f"{r.status}: {await r.text()}")
                        continue
                    results[j] = (await r.json())["result"][0]

        await asyncio.gather(*(client(c) for c in range(clients)))
    assert errors == []
    assert len(results) == len(work)
    for j, (q, k) in enumerate(work):
        assert results[j] == [h.to_dict() for h in local.search_batch([q], k)[0]], (q, k)
    async with http.get(server.url + "/health") as r:
        health = await r.json()
    assert health["batches"] < health["queries"]  # requests were coalesced into micro-batches


# -- lifecycle and CLI -------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_clean_shutdown_on_signal(index_dir: Path, sig: int) -> None:
    import urllib.request

    srv = ServerProcess(index_dir).start()
    try:
        req = urllib.request.Request(
            srv.url + "/retrieve", data=b'{"queries": ["Trosto"]}', headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
        code = srv.stop(sig)
    finally:
        srv.stop(signal.SIGKILL)
    assert code == 0, "".join(srv.stderr_tail)
    assert any("shutting down" in line for line in srv.stderr_tail)
    assert not any("Traceback" in line for line in srv.stderr_tail), "".join(srv.stderr_tail)


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "rlf_envs" / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "servers.retrieval", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def test_cli_build_and_errors(tmp_path: Path) -> None:
    out = tmp_path / "idx"
    r = _cli("build", "--corpus", str(CORPUS), "--out", str(out), "--kind", "bm25")
    assert r.returncode == 0, r.stderr
    assert "built bm25 index of 450 documents" in r.stdout
    r = _cli("build", "--corpus", str(CORPUS), "--out", str(out), "--kind", "bm25")
    assert r.returncode == 2 and "already exists" in r.stderr
    r = _cli("serve", "--index", str(tmp_path / "missing"))
    assert r.returncode == 2 and "not an index directory" in r.stderr
    r = _cli("serve", "--index", str(out), "--max-topk", "0")
    assert r.returncode == 2 and "--max-topk must be >= 1" in r.stderr
    r = _cli("build", "--corpus", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "x"), "--kind", "bm25")
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_port_in_use_is_reported(index_dir: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _cli("serve", "--index", str(index_dir), "--port", str(port), timeout=300)
    assert r.returncode == 1 and "error" in r.stderr
