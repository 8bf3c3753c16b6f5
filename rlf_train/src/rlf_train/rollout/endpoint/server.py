"""The OpenAI-compatible policy endpoint: `POST /v1/chat/completions`, `GET /v1/models` (aiohttp).

A session is named by the base URL (`http://host:port/sessions/<id>/v1`) or by its API key on the plain
`/v1` paths; both are what every OpenAI client lets a user set. What it does and refuses:

- messages are rendered with the training format's exact renderer and extended token-exactly
  (`rlf_train.rollout.endpoint.sessions`); tool calls are parsed from the generated tokens by rlf's format parser
  (a malformed call comes back as plain content, never as an error);
- `stream: true` answers with server-sent events (content and tool-call deltas, a usage chunk when asked);
- `n` > 1 is refused (400): each sample of a group is its own session;
- `max_tokens` / `max_completion_tokens` are honoured up to the training config's
  `rollout.max_new_tokens_per_turn` (the default when the request gives none) and the episode's
  `rollout.max_total_tokens`;
- sampling settings (temperature, top_p, seed, penalties, stop, ...) come from the training config: the
  agent's are recorded per session (`Session.ignored`) and not applied, since the update's importance
  ratios assume the configured sampling distribution;
- a request repeated verbatim in a session (an SDK retry after a timeout or a dropped connection) gets the
  first answer back and is recorded once;
- bodies over `max_body_bytes` are refused (413), as is any request to an unknown, closed or timed-out session
  (JSON errors in OpenAI's shape: `{"error": {"message", "type", "code"}}`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from rlf_envs.formats.chat import ChatMessage, ChatToolCall, Reply
from rlf_train.rollout.endpoint.engine import EngineFront
from rlf_train.rollout.endpoint.sessions import EndpointError, Session, SessionStore, request_key, tools_key
from rlf_train.rollout.seeds import mix_seed

log = logging.getLogger(__name__)

MODEL_NAME = "rlf-policy"
#: request fields that set sampling: recorded, not applied (the training config's settings are)
SAMPLING_FIELDS = ("temperature", "top_p", "seed", "stop", "frequency_penalty", "presence_penalty",
                   "logit_bias", "top_k", "min_p", "repetition_penalty")


class _Msg(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatRequest(BaseModel):
    """The part of OpenAI's chat-completions request the endpoint reads (other fields are accepted)."""

    model_config = ConfigDict(extra="allow")
    messages: list[_Msg]
    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None


def _error(status: int, code: str, message: str, etype: str = "invalid_request_error",
           param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": etype, "code": code, "param": param}},
                             status=status)


#: a JSON escape of a UTF-16 surrogate; only a body holding one can parse to text that is not Unicode
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def _parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 in OpenAI's shape: not UTF-8, not JSON, nested too deeply
    for the parser, not an object, or holding a lone surrogate (`"\\ud800"`: what a raw client sends for a
    file name decoded with `surrogateescape`; it is no Unicode text, so no tokenizer takes it)."""
    try:
        text = raw.decode("utf-8")
        body = json.loads(text)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        raise EndpointError(400, "invalid_json", f"the body is not JSON: {e}") from None
    except RecursionError:
        raise EndpointError(400, "invalid_json", "the body is nested too deeply to parse") from None
    if not isinstance(body, dict):
        raise EndpointError(400, "invalid_json", "the body must be a JSON object")
    if _SURROGATE_ESCAPE.search(text):  # rare (non-BMP text escaped as pairs): check it is all valid text
        where = _lone_surrogate(body)
        if where is not None:
            raise EndpointError(400, "invalid_unicode", f"{where} holds a lone UTF-16 surrogate (\\ud800-\\udfff "
                                                       "without its pair), which is not Unicode text; send valid "
                                                       "UTF-8 (e.g. decode file names with errors='replace')")
    return body


def _lone_surrogate(obj: Any) -> str | None:
    """Where the first string (key or value) holding a lone surrogate is, e.g. `messages[0].content`."""
    stack: list[tuple[Any, str]] = [(obj, "body")]
    while stack:
        x, where = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(x, dict):
            for k, v in x.items():
                key_where = where + "." + (k if k.isidentifier() else repr(k)) if where != "body" else str(k)
                stack.append((k, f"a key of {where}"))
                stack.append((v, key_where))
        elif isinstance(x, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(x))
    return None


def _text(content: str | list[dict[str, Any]] | None, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for p in content:
        if p.get("type") != "text" or not isinstance(p.get("text"), str):
            raise EndpointError(400, "unsupported_content", f"{where}: only text content parts are supported "
                                                           f"(got type {p.get('type')!r})")
        parts.append(p["text"])
    return "".join(parts)


MAX_MESSAGES = 4096  # per request (matching a conversation is linear in it; the body is bounded too)


def to_messages(req: ChatRequest) -> tuple[ChatMessage, ...]:
    if len(req.messages) > MAX_MESSAGES:
        raise EndpointError(400, "too_many_messages", f"{len(req.messages)} messages; the endpoint takes at most "
                                                     f"{MAX_MESSAGES} per request")
    out = []
    for i, m in enumerate(req.messages):
        role = "system" if m.role == "developer" else m.role
        if role not in ("system", "user", "assistant", "tool"):
            raise EndpointError(400, "invalid_role", f"messages[{i}].role {m.role!r}: use system, developer, user, "
                                                    "assistant or tool")
        calls = []
        for j, c in enumerate(m.tool_calls or []):
            fn = c.get("function") or {}
            name, args = (fn.get("name"), fn.get("arguments", "{}")) if isinstance(fn, dict) else (None, None)
            if not isinstance(name, str) or not isinstance(args, str | dict):
                raise EndpointError(400, "invalid_tool_call", f"messages[{i}].tool_calls[{j}] needs function.name "
                                                             "(a string) and function.arguments (a JSON string)")
            args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            calls.append(ChatToolCall(str(c.get("id", "")), name, args_text))
        out.append(ChatMessage(role, _text(m.content, f"messages[{i}].content"), tuple(calls),  # type: ignore[arg-type]
                               m.tool_call_id, m.reasoning_content))
    if not out:
        raise EndpointError(400, "empty_messages", "messages is empty")
    return tuple(out)


def _tools(req: ChatRequest) -> list[dict[str, Any]]:
    tools = req.tools or []
    for i, t in enumerate(tools):
        fn = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise EndpointError(400, "invalid_tools", f"tools[{i}] must be {{'type': 'function', 'function': "
                                                     "{'name': ..., 'parameters': {...}}}")
    return tools


@dataclass(frozen=True)
class Completion:
    """One generated call, as recorded (what a retry of the same request gets back)."""

    id: str
    created: int
    reply: Reply
    finish: str
    n_prompt: int
    ids: list[int]
    logprobs: list[float]


class PolicyServer:
    """The aiohttp app over an `EngineFront` and a `SessionStore`; `start()` binds it (loopback by default)."""

    def __init__(self, engine: EngineFront, decode: Callable[[list[int]], str], *, host: str = "127.0.0.1",
                 port: int = 0, max_body_bytes: int = 4 << 20) -> None:
        self.engine = engine
        self.decode = decode
        self.sessions = SessionStore()
        self.host, self.port = host, port
        self.max_body_bytes = max_body_bytes
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=[self._errors])
        self.app.add_routes([
            web.get("/v1/models", self.models), web.get("/sessions/{sid}/v1/models", self.models),
            web.post("/v1/chat/completions", self.chat), web.post("/sessions/{sid}/v1/chat/completions", self.chat),
            web.get("/health", self.health),
        ])
        self._runner: web.AppRunner | None = None
        self.requests = 0
        engine.expected = lambda: len(self.sessions.by_id)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def base_url(self, s: Session) -> str:
        return f"{self.url}/sessions/{s.id}/v1"

    async def start(self) -> None:
        await self.engine.start()
        # an ended run does not wait for handlers in flight (their sessions are closed; nothing of theirs is kept)
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=1024)
        await site.start()
        if self.port == 0:
            self.port = self._runner.addresses[0][1]

    async def close(self) -> None:
        for s in list(self.sessions.by_id.values()):
            self.sessions.remove(s)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.engine.close()

    @web.middleware
    async def _errors(self, request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        try:
            return await handler(request)
        except EndpointError as e:
            return _error(e.status, e.code, e.message, param=e.param)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, "request_too_large", f"the request body is over {self.max_body_bytes} bytes")
        except web.HTTPException as e:
            return _error(e.status, "http_error", e.reason)
        except RecursionError:  # a value nested too deeply for a renderer or serialiser (the parser took it)
            return _error(400, "invalid_request", "the request holds a value nested too deeply")
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # ours (or the engine's): a 500 in OpenAI's shape, logged, and the server goes on
            log.exception("the policy endpoint failed on %s", request.path)
            return _error(500, "server_error", f"the policy endpoint failed: {type(e).__name__}: {e}",
                          etype="server_error")

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "sessions": len(self.sessions.by_id)})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "rlf"}]})

    def _session(self, request: web.Request) -> Session:
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        return self.sessions.find(request.match_info.get("sid"), key)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        session.check_open()
        body = _parse_body(await request.read())
        try:
            req = ChatRequest.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            raise EndpointError(400, "invalid_request", f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
        if req.n is not None and req.n < 1:
            raise EndpointError(400, "invalid_value", f"n={req.n}: n must be at least 1", param="n")
        if (req.n or 1) != 1:
            raise EndpointError(400, "n_not_supported", f"n={req.n}: the endpoint returns one choice; run one "
                                                       "session per sample (the trainer runs a group of sessions)")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise EndpointError(400, "invalid_max_tokens", f"max_tokens must be >= 1, got {max_tokens}")
        messages, tools = to_messages(req), _tools(req)
        for f in SAMPLING_FIELDS:
            if body.get(f) is not None:
                session.ignored[f] += 1
        self.requests += 1
        tkey = tools_key(tools)
        key = request_key(messages, tkey, max_tokens)
        fut = session.replies.get(key)
        if fut is None or (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            fut = asyncio.ensure_future(self._complete(session, messages, tools, tkey, max_tokens))
            session.replies[key] = fut
            while len(session.replies) > 16:
                session.replies.popitem(last=False)
        else:
            session.retries += 1
        done = await asyncio.shield(fut)
        payload = self._payload(done, with_logprobs=bool(req.logprobs))
        if req.stream:
            return await self._stream(request, payload, req)
        return web.json_response(payload)

    async def _complete(self, session: Session, messages: tuple[ChatMessage, ...], tools: list[dict[str, Any]],
                        tkey: str, max_tokens: int | None) -> Completion:
        """Match, generate, record: one call of a session (runs to the end even if the client goes away, so
        a retry finds its answer)."""
        async with session.lock:
            prep = session.prepare(messages, tools, tkey, max_tokens)
            seed = None if session.seed is None else mix_seed(session.seed, session.calls)  # this call's own
        try:
            gen, version = await self.engine.generate(prep.prompt, prep.max_tokens, seed)
        except BaseException:
            session.abandon(prep)
            raise
        ids = [int(x) for x in gen.ids]
        text = self.decode(ids)
        finish = gen.finish_reason if gen.finish_reason in ("stop", "length") else (
            "length" if len(ids) >= prep.max_tokens else "stop")
        async with session.lock:
            if session.closed:
                session.abandon(prep)
                raise EndpointError(410, "session_closed", f"session {session.id} ended while this call ran; "
                                                          "its answer is not recorded")
            reply = session.commit(prep, ids, gen.logprobs, version, finish, text)
        lps = [float(x) for x in gen.logprobs] if gen.logprobs is not None else [0.0] * len(ids)
        return Completion(f"chatcmpl-{session.id}-{session.calls}", int(time.time()), reply, finish, len(prep.prompt),
                          ids, lps)

    def _payload(self, c: Completion, with_logprobs: bool) -> dict[str, Any]:
        """The response body; with `with_logprobs`, one entry per generated token (what the policy sampled
        with: the behaviour log-probs the update uses)."""
        reply, finish = c.reply, c.finish
        msg: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
        if reply.reasoning is not None:
            msg["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            msg["tool_calls"] = [{"id": t.id, "type": "function", "function": {"name": t.name,
                                                                                "arguments": t.arguments}}
                                 for t in reply.tool_calls]
            if finish == "stop":
                finish = "tool_calls"
        logprobs = {"content": [{"token": self.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                                for t, lp in zip(c.ids, c.logprobs, strict=True)]} if with_logprobs else None
        n = len(c.ids)
        return {"id": c.id, "object": "chat.completion", "created": c.created, "model": MODEL_NAME,
                "choices": [{"index": 0, "message": msg, "finish_reason": finish, "logprobs": logprobs}],
                "usage": {"prompt_tokens": c.n_prompt, "completion_tokens": n, "total_tokens": c.n_prompt + n}}

    async def _stream(self, request: web.Request, payload: dict[str, Any], req: ChatRequest) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        choice = payload["choices"][0]
        msg = choice["message"]
        base = {"id": payload["id"], "object": "chat.completion.chunk", "created": payload["created"],
                "model": payload["model"]}

        usage = bool((req.stream_options or {}).get("include_usage"))

        async def send(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> None:
            chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}
            if usage:  # OpenAI's shape: every chunk has `usage` (null but in the last, choice-less, chunk)
                chunk["usage"] = None
            await resp.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())

        await send({"role": "assistant", "content": ""})
        if msg.get("reasoning_content") is not None:
            await send({"reasoning_content": msg["reasoning_content"]})
        if msg.get("content"):
            await send({"content": msg["content"]}, logprobs=choice["logprobs"] if req.logprobs else None)
        for k, c in enumerate(msg.get("tool_calls") or []):
            await send({"tool_calls": [{"index": k, "id": c["id"], "type": "function",
                                        "function": {"name": c["function"]["name"], "arguments": ""}}]})
            await send({"tool_calls": [{"index": k, "function": {"arguments": c["function"]["arguments"]}}]})
        await send({}, choice["finish_reason"])
        if usage:
            await resp.write(f"data: {json.dumps({**base, 'choices': [], 'usage': payload['usage']})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
