"""Model judge: score answers with any OpenAI-compatible chat-completions endpoint (vLLM, SGLang, ...).

Requests go through the official `openai` async client (`pip install -e './rlf_envs[judge]'`), which does the
HTTP, the per-attempt timeout, the bounded retries with backoff on 5xx / 429 / timeouts / connection
errors (honouring Retry-After) and the typed response. On top of it the judge keeps: a semaphore for
concurrency, an overall deadline per verdict, an LRU cache keyed by a hash of (model, messages, sampling
params), de-duplication of identical in-flight requests, and the fallback score: any failure yields it
and is counted in `JudgeStats` (per HTTP attempt, counted by a transport wrapper); nothing hangs or raises.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import math
import os
import re
import string
from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlf_envs.errors import RlfError
from rlf_envs.extras import require
from rlf_envs.rewards.common import ConfiguredVerifier
from rlf_envs.rewards.config import BuildContext, VerifierConfig, register_verifier
from rlf_envs.types import Score, Task, Trajectory

log = logging.getLogger(__name__)

DEFAULT_SYSTEM = (
    "You are a strict grader. Decide whether the candidate answer is correct given the reference answers. "
    "Reply with a score between 0 and 1 inside <score></score> tags, e.g. <score>1</score>."
)
DEFAULT_TEMPLATE = (
    "Question:\n{question}\n\nReference answer(s):\n{gold}\n\nCandidate answer:\n{answer}\n\n"
    "Is the candidate answer correct? Reply with <score>1</score> if it is, <score>0</score> if it is not."
)
_FIELDS = frozenset({"question", "answer", "gold"})
_SCORE_TAG = re.compile(r"<score>\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*</score>", re.IGNORECASE)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_JSON_OBJ = re.compile(r"\{[^{}]*\}")


class EndpointConfig(VerifierConfig):
    """The OpenAI-compatible endpoint a model judge calls (the per-trajectory `judge` and the `group_judge`). The API
    key is read from the environment variable named by `api_key_env` (never put keys in config)."""

    base_url: str = Field(description="e.g. http://127.0.0.1:8000/v1 (POSTs to <base_url>/chat/completions)")
    model: str = Field(min_length=1)
    api_key_env: str | None = Field(None, description="NAME of the environment variable holding the API key")

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.match(r"https?://[^/\s]+", v):
            raise ValueError("must be an http(s) URL such as http://127.0.0.1:8000/v1")
        return v.rstrip("/")

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError(
                "must be the NAME of an environment variable holding the key (e.g. OPENAI_API_KEY), not the key"
            )
        return v


@register_verifier
class JudgeConfig(EndpointConfig):
    """A model judge on an OpenAI-compatible endpoint. The API key is read from the environment
    variable named by `api_key_env` (never put keys in config)."""

    type: Literal["judge"] = "judge"
    system_prompt: str | None = DEFAULT_SYSTEM
    prompt_template: str = DEFAULT_TEMPLATE
    score_min: float = 0.0
    score_max: float = 1.0
    temperature: float = Field(0.0, ge=0)
    max_tokens: int = Field(256, ge=1)
    extra_body: dict[str, Any] = Field(default_factory=dict, description="merged into the request JSON")
    timeout_s: float = Field(30.0, gt=0, description="deadline per HTTP attempt")
    max_retries: int = Field(2, ge=0, le=10, description="retries by the openai client (5xx, 429, timeouts)")
    backoff_s: float = Field(
        0.5, ge=0, description="deprecated, unused: the openai client backs off itself (0.5 s doubling, max 8 s)"
    )
    max_concurrency: int = Field(16, ge=1)
    cache_size: int = Field(10_000, ge=0)
    retry_on_parse_error: bool = False
    max_response_bytes: int = Field(1_000_000, ge=1024)

    @field_validator("prompt_template")
    @classmethod
    def _template(cls, v: str) -> str:
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(v) if f is not None}
        except ValueError as e:
            raise ValueError(f"bad template ({e}); write literal braces as {{{{ and }}}}") from None
        bad = names - _FIELDS
        if bad:
            raise ValueError(
                f"unknown placeholder(s) {sorted(bad)}; use {{question}}, {{answer}}, {{gold}} "
                "and write literal braces as {{ and }}"
            )
        if "answer" not in names:
            raise ValueError("the template must contain {answer}")
        return v

    @model_validator(mode="after")
    def _range(self) -> JudgeConfig:
        if not self.score_max > self.score_min:
            raise ValueError(f"score_max ({self.score_max}) must be > score_min ({self.score_min})")
        return self

    def build(self, ctx: BuildContext) -> ModelJudge:
        return ModelJudge(self)


@dataclass(slots=True)
class JudgeStats:
    """Counters for a judge's lifetime (log them with `as_dict`)."""

    calls: int = 0  # score() calls that needed a verdict
    cache_hits: int = 0
    deduplicated: int = 0  # joined an identical in-flight request
    requests: int = 0  # HTTP attempts
    retries: int = 0
    successes: int = 0
    failures: int = 0  # verdicts replaced by the fallback
    timeouts: int = 0
    http_errors: int = 0
    connection_errors: int = 0
    parse_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class JudgeFailure(RlfError):
    """The judge produced no usable score (after retries)."""


def parse_judge_score(content: str) -> float | None:
    """Extract a score from `<score>x</score>` (last one wins) or a JSON object with a "score" key."""
    text = _THINK.sub("", content)
    tags = _SCORE_TAG.findall(text)
    if tags:
        v = float(tags[-1])
        return v if math.isfinite(v) else None
    candidates = [text.strip(), *_JSON_OBJ.findall(text)]
    for c in candidates:
        try:
            obj = json.loads(c)
        except (json.JSONDecodeError, RecursionError):
            continue
        if isinstance(obj, dict) and "score" in obj:
            s = obj["score"]
            if isinstance(s, bool):
                continue
            try:
                v = float(s)
            except (TypeError, ValueError):
                continue
            if math.isfinite(v):
                return v
    return None


_ATTEMPTS: ContextVar[list[int] | None] = ContextVar("rlf_judge_attempts", default=None)


def _counting_transport(stats: JudgeStats, max_bytes: int) -> Any:
    """An httpx2 transport that counts every HTTP attempt the openai client makes (requests, timeouts,
    connection and HTTP errors) and refuses bodies over `max_bytes` (a transport error: not retried
    by openai as a status would be, so it fails fast)."""
    httpx2 = require("httpx2", "the model judge")

    class CountingTransport(httpx2.AsyncBaseTransport):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            self.inner = httpx2.AsyncHTTPTransport()

        async def handle_async_request(self, request: Any) -> Any:
            stats.requests += 1
            attempts = _ATTEMPTS.get()
            if attempts is not None:
                attempts[0] += 1
            try:
                response = await self.inner.handle_async_request(request)
            except httpx2.TimeoutException:
                stats.timeouts += 1
                raise
            except httpx2.TransportError:
                stats.connection_errors += 1
                raise
            if response.status_code >= 400:
                stats.http_errors += 1
            size = response.headers.get("content-length")
            if size is not None and size.isdigit() and int(size) > max_bytes:
                await response.aclose()
                raise JudgeFailure(f"response larger than {max_bytes} bytes")
            return response

        async def aclose(self) -> None:
            await self.inner.aclose()

    return CountingTransport()


class ModelJudge(ConfiguredVerifier[JudgeConfig]):
    """LLM-as-judge verifier. Use `async with` or call `aclose()` to release the HTTP client."""

    config_cls = JudgeConfig

    def __init__(self, config: JudgeConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._openai = require("openai", "the model judge")
        self.stats = JudgeStats()
        self._cache: OrderedDict[str, float] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[float]] = {}
        self._session: Any = None  # the openai.AsyncOpenAI client of the current event loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sem: asyncio.Semaphore | None = None

    async def __aenter__(self) -> ModelJudge:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for fut in list(self._inflight.values()):
            fut.cancel()
        self._inflight.clear()
        if self._session is not None:
            await self._session.close()
        self._session = None

    # ---------------------------------------------------------------------------------------- requests

    def messages(self, trajectory: Trajectory, task: Task) -> list[dict[str, str]]:
        golds = task.gold_answers
        gold = "\n".join(f"- {g}" for g in golds) if golds else "(none given)"
        user = self.cfg.prompt_template.format(question=task.question, answer=trajectory.answer or "", gold=gold)
        msgs = [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []
        return [*msgs, {"role": "user", "content": user}]

    def _body(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        c = self.cfg
        return {
            **c.extra_body,
            "model": c.model,
            "messages": messages,
            "temperature": c.temperature,
            "max_tokens": c.max_tokens,
        }

    @staticmethod
    def cache_key(body: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

    def _ensure_session(self) -> tuple[Any, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop:
            # A client is bound to its loop; a new loop (e.g. a new asyncio.run) needs a new one.
            c = self.cfg
            httpx2 = require("httpx2", "the model judge")
            http = httpx2.AsyncClient(
                transport=_counting_transport(self.stats, c.max_response_bytes),
                limits=httpx2.Limits(max_connections=c.max_concurrency),
            )
            key = os.environ.get(c.api_key_env) if c.api_key_env else None
            self._session = self._openai.AsyncOpenAI(
                base_url=c.base_url, api_key=key or "unused", max_retries=c.max_retries, timeout=c.timeout_s,
                http_client=http,
            )
            self._loop = loop
            self._sem = asyncio.Semaphore(c.max_concurrency)
            self._inflight.clear()
        assert self._sem is not None
        return self._session, self._sem

    def _deadline_s(self) -> float:
        """Bound on one verdict: every attempt's timeout plus openai's backoff (at most 8 s a retry)."""
        c = self.cfg
        return c.timeout_s * (c.max_retries + 1) + 8.0 * c.max_retries + 1.0

    async def _request(self, body: dict[str, Any]) -> float:
        c = self.cfg
        client, sem = self._ensure_session()
        openai = self._openai
        request = {k: v for k, v in body.items() if k in ("model", "messages", "temperature", "max_tokens")}
        extra = {k: v for k, v in body.items() if k not in request}
        last = "no attempt"
        for attempt in range(c.max_retries + 1 if c.retry_on_parse_error else 1):
            attempts = [0]
            token = _ATTEMPTS.set(attempts)
            try:
                async with sem, asyncio.timeout(self._deadline_s()):
                    response = await client.chat.completions.create(**request, extra_body=extra or None)
            except TimeoutError:
                last = f"no verdict within the deadline of {self._deadline_s():g}s"
                raise JudgeFailure(last) from None
            except openai.APITimeoutError:
                raise JudgeFailure(f"timed out after {c.timeout_s}s ({attempts[0]} attempts)") from None
            except openai.APIConnectionError as e:
                cause = e.__cause__
                if isinstance(cause, JudgeFailure):
                    raise cause from None
                raise JudgeFailure(f"connection error: {cause or e!r}") from None
            except openai.APIStatusError as e:
                raise JudgeFailure(f"HTTP {e.status_code}: {str(e.message)[:300]}") from None
            except JudgeFailure:
                raise
            except (openai.OpenAIError, ValueError, TypeError) as e:  # a body that is not a chat completion
                self.stats.parse_errors += 1
                raise JudgeFailure(f"unreadable judge response: {e!r}"[:300]) from None
            finally:
                _ATTEMPTS.reset(token)
                self.stats.retries += max(0, attempts[0] - 1)
            if attempt:
                self.stats.retries += 1
            value = self._parse_response(response)
            if value is not None:
                return value
            self.stats.parse_errors += 1
            last = f"no score in judge output: {self._content(response)[:200]!r}"
        raise JudgeFailure(last)

    @staticmethod
    def _content(response: Any) -> str:
        try:
            content = response.choices[0].message.content
        except (AttributeError, IndexError, TypeError):
            return ""
        return content if isinstance(content, str) else ""

    def _parse_response(self, response: Any) -> float | None:
        content = self._content(response)
        if not content:
            return None
        s = parse_judge_score(content)
        if s is None or not self.cfg.score_min <= s <= self.cfg.score_max:
            return None
        return (s - self.cfg.score_min) / (self.cfg.score_max - self.cfg.score_min)

    def _forget(self, key: str, fut: asyncio.Future[float]) -> None:
        if self._inflight.get(key) is fut:
            del self._inflight[key]

    async def _verdict(self, body: dict[str, Any]) -> tuple[float, bool]:
        key = self.cache_key(body)
        if key in self._cache:
            self._cache.move_to_end(key)
            self.stats.cache_hits += 1
            return self._cache[key], True
        self._ensure_session()
        fut = self._inflight.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._request(body))
            self._inflight[key] = fut
            fut.add_done_callback(functools.partial(self._forget, key))
        else:
            self.stats.deduplicated += 1
        value = await asyncio.shield(fut)
        if self.cfg.cache_size:
            self._cache[key] = value
            while len(self._cache) > self.cfg.cache_size:
                self._cache.popitem(last=False)
        return value, False

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        if trajectory.answer is None:
            return self.result(0.0, {"no_answer": 1.0})
        self.stats.calls += 1
        body = self._body(self.messages(trajectory, task))
        try:
            value, cached = await self._verdict(body)
        except JudgeFailure as e:
            self.stats.failures += 1
            log.warning("judge %s failed on task %s: %s; scoring fallback %s", self.name, task.id, e, self.fallback)
            return self.result(self.fallback, {"failed": 1.0})
        self.stats.successes += 1
        return self.result(value, {"cache_hit": float(cached)})
