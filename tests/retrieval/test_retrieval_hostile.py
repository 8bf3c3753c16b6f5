"""The retrieval server against hostile clients, over real sockets on 127.0.0.1: pathological JSON, aiohttp's
own protocol errors, slow (slow-loris) clients and clients that hang up mid-request."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from servers.retrieval.process import ServerProcess

pytestmark = pytest.mark.timeout(120)

TIMEOUT_ARGS = ["--header-timeout-s", "1", "--body-timeout-s", "1"]


@pytest.fixture(scope="module")
def server(bm25_index_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(bm25_index_dir, TIMEOUT_ARGS) as srv:
        yield srv
    assert srv.returncode == 0, "".join(srv.stderr_tail)


def _addr(srv: ServerProcess) -> tuple[str, int]:
    host, port = srv.url.removeprefix("http://").split(":")
    return host, int(port)


async def _exchange(srv: ServerProcess, raw: bytes, read_s: float = 10.0) -> bytes:
    """Send raw bytes, read until the server closes (or `read_s`)."""
    reader, writer = await asyncio.open_connection(*_addr(srv))
    try:
        writer.write(raw)
        await writer.drain()
        async with asyncio.timeout(read_s):
            return await reader.read()
    finally:
        writer.close()


def _post_raw(body: bytes) -> bytes:
    return (b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def _status_and_json(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"application/json" in head.lower(), reply[:300]
    return status, json.loads(body)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"queries": ["x"], "topk": ' + b"9" * 5000 + b"}", "4300 digits"),
        (b'{"queries": ["x"], "topk": 3, "pad": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ],
)
async def test_pathological_json_is_a_400_json_error(server: ServerProcess, body: bytes, message: str) -> None:
    status, reply = _status_and_json(await _exchange(server, _post_raw(body)))
    assert status == 400 and message in reply["error"], reply


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"POST /retrieve HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",
        b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
    ],
)
async def test_protocol_errors_come_back_as_json(server: ServerProcess, raw: bytes) -> None:
    status, reply = _status_and_json(await _exchange(server, raw))
    assert 400 <= status < 500 and isinstance(reply.get("error"), str), reply


@pytest.mark.asyncio
async def test_slow_clients_are_timed_out(server: ServerProcess) -> None:
    """Partial request heads (one trickling a byte every 0.3 s) and partial bodies are cut off by the
    configured timeouts (1 s here) instead of staying open for ever."""

    async def slow_head(trickle: bool) -> float:
        t0 = time.monotonic()
        reader, writer = await asyncio.open_connection(*_addr(server))
        try:
            writer.write(b"POST /retrieve HTTP/1.1\r\nHost: x\r\n")
            async with asyncio.timeout(15):
                while True:
                    if trickle:
                        try:
                            writer.write(b"X")
                            await writer.drain()
                        except ConnectionError:
                            break
                    try:
                        data = await asyncio.wait_for(reader.read(4096), 0.3)
                    except TimeoutError:
                        continue
                    except ConnectionError:
                        break
                    if not data:
                        break
            return time.monotonic() - t0
        finally:
            writer.close()

    async def slow_body() -> tuple[float, bytes]:
        t0 = time.monotonic()
        raw = _post_raw(b'{"queries": ["x"], "topk": 3}' + b" " * 100)
        reader, writer = await asyncio.open_connection(*_addr(server))
        try:
            writer.write(raw[: len(raw) - 90])
            async with asyncio.timeout(15):
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                reply = head + await reader.readexactly(length)
            return time.monotonic() - t0, reply
        finally:
            writer.close()

    heads = await asyncio.gather(*(slow_head(trickle=i % 2 == 0) for i in range(40)))
    assert max(heads) < 10, f"a slow client stayed connected {max(heads):.1f}s (header timeout 1 s)"
    elapsed, reply = await slow_body()
    status, body = _status_and_json(reply)
    assert status == 408 and "not received within 1s" in body["error"] and elapsed < 10


@pytest.mark.asyncio
async def test_client_disconnects_are_not_logged_as_errors(server: ServerProcess) -> None:
    async def hang_up() -> None:
        reader, writer = await asyncio.open_connection(*_addr(server))
        raw = _post_raw(b'{"queries": ["Trosto"], "topk": 3}' + b" " * 5000)
        writer.write(raw[:-4000])
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.transport.abort()  # RST mid-body

    await asyncio.gather(*(hang_up() for _ in range(20)))
    await asyncio.sleep(1.5)
    status, reply = _status_and_json(await _exchange(server, _post_raw(b'{"queries": ["Trosto"], "topk": 1}')))
    assert status == 200 and len(reply["result"][0]) == 1
    log = "".join(server.stderr_tail)
    assert "ERROR" not in log and "Traceback" not in log, log[-2000:]
