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
from hypothesis import given, settings
from hypothesis import strategies as st

from rlf_envs.retrieval import BM25Index, load_index
from rlf_envs.retrieval.types import Document, Hit
from servers.retrieval.app import Limits, RetrieveRequest, encode_result, parse_request, well_typed_request
from servers.retrieval.process import ROOT, ServerProcess

pytestmark = pytest.mark.timeout(600)  # a hang guard, generous for a loaded machine

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


# JSON values of the types a client may put in each field, right or wrong
_JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30), st.floats(allow_nan=False),
    st.text(max_size=5),
)
_JSON = st.recursive(_JSON_SCALARS, lambda inner: st.lists(inner, max_size=3), max_leaves=6)
_FIELD = st.one_of(_JSON, st.lists(st.text(max_size=5), max_size=3), st.lists(st.one_of(st.text(), _JSON), max_size=3))


@settings(max_examples=400, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["queries", "topk", "return_scores", "extra"]), _FIELD, max_size=4
    )
)
def test_well_typed_fast_path_agrees_with_pydantic(raw: dict) -> None:
    """Requests skip pydantic only when its strict validation would accept them, with the same values."""
    fast = well_typed_request(raw)
    try:
        strict = RetrieveRequest.model_validate(raw)
    except ValueError:
        assert fast is None, raw
        return
    if fast is not None:
        assert fast == strict and fast.model_dump() == strict.model_dump(), raw


def test_encode_result_is_search_r1_json() -> None:
    """The orjson body decodes to exactly what the stdlib encoder produced: Search-R1's shape, every character
    (quotes, newlines, control characters, non-ASCII, surrogate-free astral) and every float score kept."""
    docs = [Document("1", '"T\u00e9"\nline\twith "quotes" \x01 \u2028 \U0001f600'), Document("x y", "")]
    results = [[Hit(docs[0], 12.345678901234567), Hit(docs[1], -0.0)], [], [Hit(docs[1], 1e-7)]]
    with_scores = json.loads(encode_result(results, return_scores=True))
    assert with_scores == {"result": [[h.to_dict() for h in hits] for hits in results]}
    assert with_scores["result"][0][0]["score"] == 12.345678901234567
    assert json.loads(encode_result(results, return_scores=False)) == {
        "result": [[{"id": h.document.id, "contents": h.document.contents} for h in hits] for hits in results]
    }


@pytest.mark.asyncio
async def test_oversize_chunked_body_in_one_packet(server: ServerProcess) -> None:
    """A chunked body (no Content-Length) that arrives whole with its head is still held to the body limit."""
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"queries": ["Trosto"], "pad": "x" * 5000}).encode()
    raw = (b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(body):x}".encode() + b"\r\n" + body + b"\r\n0\r\n\r\n")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(raw)
        await writer.drain()
        async with asyncio.timeout(20):
            reply = await reader.read()
    finally:
        writer.close()
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), reply[:300]
    assert "more than the limit of 4096 bytes" in json.loads(payload)["error"]


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


async def _spread_requests(url: str, n: int) -> tuple[set[int], list[list[dict]]]:
    """`n` requests, each on a new connection: the worker pids that answered /health, and the results."""
    pids: set[int] = set()
    results: list[list[dict]] = []
    connector = aiohttp.TCPConnector(force_close=True)  # a new connection (source port) each time
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as s:
        for i in range(n):
            async with s.get(url + "/health") as r:
                pids.add((await r.json())["pid"])
            body = {"queries": [f"Trosto {i}"], "topk": 2, "return_scores": True}
            async with s.post(url + "/retrieve", json=body) as r:
                assert r.status == 200
                results.append((await r.json())["result"][0])
    return pids, results


def test_workers_share_one_port_and_stop_with_the_parent(index_dir: Path, local: BM25Index) -> None:
    """`--workers 2`: two processes answer on one port (SO_REUSEPORT) with the same results as in-process
    search; SIGTERM stops both; a parent killed outright takes its workers with it (their stdin closes)."""
    import psutil

    with ServerProcess(index_dir, ["--workers", "2"]) as srv:
        assert srv.proc is not None
        workers = psutil.Process(srv.proc.pid).children()
        assert len(workers) == 2
        pids, results = asyncio.run(_spread_requests(srv.url, 40))
        assert pids == {w.pid for w in workers}  # both answered (40 connections all on one: p = 2^-39)
        for i, got in enumerate(results):
            want = local.search_batch([f"Trosto {i}"], 2)[0]
            assert got == [h.to_dict() for h in want]
    assert srv.returncode == 0, "".join(srv.stderr_tail)
    for w in workers:
        assert not w.is_running() or w.status() == psutil.STATUS_ZOMBIE

    srv = ServerProcess(index_dir, ["--workers", "2"]).start()
    try:
        assert srv.proc is not None
        workers = psutil.Process(srv.proc.pid).children()
        srv.stop(signal.SIGKILL)
        _, alive = psutil.wait_procs(workers, timeout=60)
        assert not [w for w in alive if w.status() != psutil.STATUS_ZOMBIE]
    finally:
        srv.stop(signal.SIGKILL)


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
