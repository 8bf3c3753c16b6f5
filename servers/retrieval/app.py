"""The aiohttp application: `POST /retrieve` (Search-R1's API) and `GET /health`, over a MicroBatcher."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from pydantic import BaseModel, ConfigDict, ValidationError

from rlf_envs.retrieval import MicroBatcher, Retriever, load_index
from rlf_envs.retrieval.batcher import BatcherClosed
from rlf_envs.retrieval.types import Hit

log = logging.getLogger("rlf.retrieval.server")


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-request limits; anything beyond gets a 400 JSON error naming the field."""

    max_queries: int = 512
    max_topk: int = 100
    max_body_bytes: int = 1 << 20
    max_query_chars: int = 4096
    #: a connection must send a whole request head within this of opening or of its previous response
    header_timeout_s: float = 30.0
    #: a request body must arrive within this of its head
    body_timeout_s: float = 30.0


class RetrieveRequest(BaseModel):
    """Search-R1's request body. Types are strict: `"topk": "3"` or `"queries": "x"` is an error."""

    model_config = ConfigDict(strict=True, extra="ignore")

    queries: list[str]
    topk: int = 3
    return_scores: bool = False


class BadRequest(Exception):
    """A client error, answered with `status` (400 by default) and `{"error": message}`."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


#: micro-batches expected to take less than this are searched on the event loop. BM25's search is Python and
#: small numpy calls that hold the GIL: a worker thread would add two thread hops per batch and no parallelism.
#: Dense search (torch, faiss) releases the GIL, so the loop keeps parsing requests while a batch is encoded.
INLINE_BELOW_S: dict[str, float] = {"bm25": 0.05, "dense": 0.0}

#: a micro-batch of this many queries goes without waiting for more (default of `serve --send-at`)
SEND_AT = 32

BATCHER = web.AppKey("batcher", MicroBatcher)
RETRIEVER = web.AppKey("retriever", Retriever)  # type: ignore[type-abstract]
LIMITS = web.AppKey("limits", Limits)
INFO: web.AppKey[dict[str, Any]] = web.AppKey("info", dict)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every failure becomes a JSON `{"error": ...}` body (404/405 included), never an HTML page."""
    try:
        return await handler(request)
    except BadRequest as e:
        return _error(e.status, str(e))
    except ConnectionError:  # the client went away (e.g. mid-body): nothing to log; the reply goes nowhere
        log.debug("client %s disconnected", request.remote)
        return _error(400, "the client disconnected")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(e.status, e.reason or str(e))
    except BatcherClosed:
        return _error(503, "the server is shutting down")
    except Exception as e:
        log.exception("retrieval failed")
        return _error(500, f"retrieval failed: {type(e).__name__}: {e}")


async def _read_body(request: web.Request, limit: int, timeout_s: float = 30.0) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise BadRequest(f"body: {request.content_length} bytes exceeds the limit of {limit} bytes")
    content = request.content
    if content.is_eof():  # the whole body came with the head (a small request): no timer, no read loop
        body = content.read_nowait()
        if len(body) > limit:  # a chunked body has no Content-Length to check above
            raise BadRequest(f"body: more than the limit of {limit} bytes")
        return body
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                chunk = await request.content.read(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > limit:
                    raise BadRequest(f"body: more than the limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise BadRequest(f"body: not received within {timeout_s:g}s", status=408) from None
    return b"".join(chunks)


def well_typed_request(raw: dict[str, Any]) -> RetrieveRequest | None:
    """The request, without pydantic's per-request cost, when every field already has exactly the type that
    RetrieveRequest's strict validation accepts (JSON decoding makes only exact list/str/int/bool); None
    otherwise, and the caller validates with pydantic for its error message. Values are checked later."""
    queries = raw.get("queries")
    topk = raw.get("topk", 3)
    scores = raw.get("return_scores", False)
    if type(queries) is not list or type(topk) is not int or type(scores) is not bool:
        return None
    if not all(type(q) is str for q in queries):
        return None
    return RetrieveRequest.model_construct(queries=queries, topk=topk, return_scores=scores)


def encode_result(results: list[list[Hit]], return_scores: bool) -> bytes:
    """Search-R1's response body: `{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}`, or
    documents only without scores. orjson: the stdlib encoder cost ~40x more, as much as a BM25 search."""
    if return_scores:
        payload: list[list[Any]] = [[h.to_dict() for h in hits] for hits in results]
    else:
        payload = [[h.document.to_dict() for h in hits] for hits in results]
    return orjson.dumps({"result": payload})


def parse_request(body: bytes, limits: Limits) -> RetrieveRequest:
    """Validate a /retrieve body; raises BadRequest with a field-specific message."""
    if not body.strip():
        raise BadRequest('body: empty; send JSON like {"queries": ["..."], "topk": 3, "return_scores": true}')
    try:
        raw = json.loads(body)
    except RecursionError:
        raise BadRequest("body: JSON nested too deeply") from None
    except ValueError as e:  # malformed JSON, bad UTF-8, an integer of more than 4,300 digits
        raise BadRequest(f"body: malformed JSON ({str(e)[:200]})") from None
    if not isinstance(raw, dict):
        raise BadRequest(f"body: must be a JSON object, got {type(raw).__name__}")
    req = well_typed_request(raw)
    if req is None:  # a field of the wrong type: pydantic finds it and words the message
        try:
            req = RetrieveRequest.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(p) for p in first["loc"]) or "body"
            raise BadRequest(f"{loc}: {first['msg']}") from e
    if not req.queries:
        raise BadRequest("queries: must hold at least one query")
    if len(req.queries) > limits.max_queries:
        raise BadRequest(f"queries: at most {limits.max_queries} queries per request, got {len(req.queries)}")
    for i, q in enumerate(req.queries):
        if not q.strip():
            raise BadRequest(f"queries.{i}: empty query")
        if len(q) > limits.max_query_chars:
            raise BadRequest(f"queries.{i}: {len(q)} characters exceeds the limit of {limits.max_query_chars}")
    if not 1 <= req.topk <= limits.max_topk:
        raise BadRequest(f"topk: must be between 1 and {limits.max_topk}, got {req.topk}")
    return req


async def _retrieve(request: web.Request) -> web.Response:
    app = request.app
    limits = app[LIMITS]
    req = parse_request(await _read_body(request, limits.max_body_bytes, limits.body_timeout_s), limits)
    results = await app[BATCHER].search(req.queries, req.topk)
    return web.Response(body=encode_result(results, req.return_scores), content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    stats = request.app[BATCHER].stats
    info: dict[str, Any] = request.app[INFO]
    body: dict[str, Any] = {"status": "ok", **info}
    body.update(
        count=len(request.app[RETRIEVER]),
        batches=stats.batches,
        queries=stats.queries,
        unique_queries=stats.unique_queries,  # searched after de-duplicating each batch
        mean_batch_queries=round(stats.mean_batch_queries, 2),
    )
    return web.json_response(body)


def make_app(
    retriever: Retriever,
    limits: Limits | None = None,
    max_batch: int = 512,
    max_wait_s: float = 0.002,
    info: dict[str, Any] | None = None,
    inline_below_s: float = 0.0,
    send_at: int | None = SEND_AT,
) -> web.Application:
    """The server app over any Retriever. The batcher is closed on app cleanup. A micro-batch of `send_at` queries
    or more is searched without waiting `max_wait_s` for more (a coalescing client's request goes at once)."""
    limits = limits or Limits()
    # body reading is bounded by our own limit (to answer 400 JSON, not aiohttp's 413 page)
    app = web.Application(middlewares=[_json_errors], client_max_size=limits.max_body_bytes + 1)
    app[RETRIEVER] = retriever
    app[LIMITS] = limits
    app[BATCHER] = MicroBatcher(
        retriever, max_batch=max_batch, max_wait_s=max_wait_s, inline_below_s=inline_below_s, send_at=send_at
    )
    app[INFO] = info or {}
    app.router.add_post("/retrieve", _retrieve)
    app.router.add_get("/health", _health)

    async def _close(app: web.Application) -> None:
        await app[BATCHER].aclose()

    app.on_cleanup.append(_close)
    return app


class _JSONRequestHandler(RequestHandler):
    """aiohttp's connection handler, answering its own protocol errors (bad request line, oversize headers,
    ...) as `{"error": ...}` JSON like every other error, and logging them at debug level, not as ERROR."""

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if status >= 500:
            self.logger.error("error handling a request from %s", request.remote, exc_info=exc)
        else:
            self.logger.debug("bad request from %s: %s", request.remote, message or exc)
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already started; cannot send the error")
        text = message or (str(exc) if exc is not None and status < 500 else HTTPStatus(status).phrase)
        resp = web.json_response({"error": text[:500]}, status=status)
        resp.force_close()
        return resp


class _JSONServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JSONRequestHandler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JSONServer  # same state, our connection handler
        return server


def make_runner(app: web.Application, limits: Limits, shutdown_timeout_s: float = 5.0) -> web.AppRunner:
    """The app's runner: protocol errors as JSON; a connection that sends no complete request head within
    `limits.header_timeout_s` (of opening, or of its previous response) is closed (slow-loris clients)."""
    return _Runner(
        app,
        handle_signals=False,
        access_log=None,
        shutdown_timeout=shutdown_timeout_s,
        keepalive_timeout=limits.header_timeout_s,
        lingering_time=2.0,  # after an early error reply, read a slow client's unread body for at most this
    )


def _set_on_eof(stream: Any, loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    with contextlib.suppress(OSError, ValueError):
        while stream.read(4096):
            pass
    with contextlib.suppress(RuntimeError):  # the loop is already closed: the server stopped anyway
        loop.call_soon_threadsafe(event.set)


async def serve(
    index_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    limits: Limits | None = None,
    max_batch: int = 512,
    max_wait_s: float = 0.002,
    device: str | None = None,
    use_gpu: bool | None = None,
    shutdown_timeout_s: float = 5.0,
    inline_below_s: float | None = None,
    send_at: int | None = SEND_AT,
    reuse_port: bool = False,
    stop_on_stdin_eof: bool = False,
) -> None:
    """Load the index, listen, and run until SIGTERM/SIGINT; then stop accepting, drain and exit.

    `reuse_port`: bind with SO_REUSEPORT, beside the other workers of `serve --workers N` (the kernel spreads
    connections over them). `stop_on_stdin_eof`: also stop when stdin closes (a worker whose parent died)."""
    retriever = await asyncio.to_thread(load_index, index_dir, device=device, use_gpu=use_gpu)
    manifest = retriever.manifest
    info = {"kind": manifest.kind, "model": manifest.model, "faiss": manifest.faiss, "pid": os.getpid()}
    limits = limits or Limits()
    if inline_below_s is None:
        inline_below_s = INLINE_BELOW_S.get(manifest.kind, 0.0)
    app = make_app(retriever, limits, max_batch=max_batch, max_wait_s=max_wait_s, info=info,
                   inline_below_s=inline_below_s, send_at=send_at)
    runner = make_runner(app, limits, shutdown_timeout_s)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    try:
        await runner.setup()
        await web.TCPSite(runner, host, port, reuse_port=reuse_port or None).start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if stop_on_stdin_eof:
            threading.Thread(target=_set_on_eof, args=(sys.stdin.buffer, loop, stop), daemon=True).start()
        bound = runner.addresses[0]
        print(
            f"rlf retrieval server listening on http://{host}:{bound[1]} ({manifest.kind}, {len(retriever)} docs)",
            flush=True,
        )
        await stop.wait()
        print("rlf retrieval server: shutting down", file=sys.stderr, flush=True)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, RuntimeError):
                loop.remove_signal_handler(sig)
        await runner.cleanup()
        retriever.close()
