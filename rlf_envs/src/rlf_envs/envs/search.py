"""`rlf/Search-v0`: question answering with a `search(query, topk)` tool, Search-R1 style.

The tool is backed either by a retrieval server (`retriever="http://127.0.0.1:8000"`, Search-R1's
`/retrieve` API, e.g. `python -m servers.retrieval serve`) or by an in-process index
(`retriever="inprocess"`, zero setup: by default a BM25 index of the shipped invented-world corpus,
built once into a cache directory). Results are shown like Search-R1 shows them:
`Doc 1(Title: "X") text`. Reward: exact match against the task's answers (ToolEnv's default).

In-process BM25 search (the default) needs `pip install -e './rlf_envs[bm25]'`, a dense in-process index
`./rlf_envs[search]`; the HTTP mode needs nothing extra.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from rlf_envs import runtime
from rlf_envs.env.tool_env import ToolEnv
from rlf_envs.tools.base import InvalidArguments, Tool, ToolCrashed, ToolError, ToolSpec
from rlf_envs.types import Task

DEFAULT_TOPK = 3
MAX_TOPK = 10
SEARCH_DESCRIPTION = (
    "Search the knowledge corpus. Returns the top documents for the query as "
    "'Doc i(Title: ...) text' lines. Search for the name of the entity you need facts about."
)


class SearchBackend(Protocol):
    async def search(self, queries: list[str], topk: int) -> list[list[Any]]: ...

    async def aclose(self) -> None: ...


def _render(hits: Sequence[Any]) -> str:
    from rlf_envs.retrieval.corpus import format_hits

    return format_hits(list(hits)).rstrip("\n") if hits else "No results."


# -- backends ---------------------------------------------------------------------------------------


class InProcessBackend:
    """An index loaded in this process; concurrent searches are micro-batched (one encode + one search).

    Every caller is a task on rlf's loop, so a batch goes out as soon as the loop has no more
    requests to add (`flush_when_idle`); `max_wait_s` only bounds that. Batches that search in under
    3 ms (BM25 on a small corpus) run on the loop, slower ones (dense) on the batcher's thread."""

    def __init__(self, index_dir: str | Path, max_wait_s: float = 0.002) -> None:
        from rlf_envs.retrieval import MicroBatcher, load_index

        self.index = load_index(index_dir)
        self.batcher = MicroBatcher(self.index, max_wait_s=max_wait_s, flush_when_idle=True, inline_below_s=0.003)
        runtime.register_closer(self)  # stop the batcher task on rlf's loop at interpreter exit

    async def search(self, queries: list[str], topk: int) -> list[list[Any]]:
        return await self.batcher.search(queries, topk)

    async def aclose(self) -> None:
        runtime.unregister_closer(self)
        await self.batcher.aclose()
        self.index.close()


#: the most distinct queries one coalesced /retrieve request carries (rlf's server accepts 512)
MAX_BATCH = 512
#: a coalesced request's reply may be `max_response_bytes` per query, up to this in all (a larger one is split)
MAX_BATCH_RESPONSE_BYTES = 64 << 20
#: statuses with which a server may refuse a whole request for one bad query (rlf: 400; FastAPI, as in
#: Search-R1's server: 422; a proxy: 413): such a batch is split until the bad query stands alone
_SPLIT_STATUSES = frozenset({400, 413, 422})


class _SplitBatch(Exception):
    """A batch refused (or answered too large) as a whole; `error` is what a query alone gets for it."""

    def __init__(self, error: ToolError) -> None:
        super().__init__(str(error))
        self.error = error


class HTTPBackend:
    """A Search-R1-compatible retrieval server (`POST {url}/retrieve`), via rlf's shared aiohttp session.

    With `coalesce` (the default) the searches in flight on rlf's loop go out as one request per batch of at most
    `max_batch` distinct queries, sent as soon as the loop has nothing more to add (`MicroBatcher` with
    `flush_when_idle`). Identical queries are searched once, with the largest topk asked of them, and each
    caller gets its own topk's prefix: this assumes the server's top-k lists are prefix-consistent (top-3 is
    the start of top-5), as rlf's BM25 and faiss indexes are. Each caller keeps its own deadline (a cancelled
    caller just drops out); a request keeps `timeout_s`. A batch the server refuses as a whole (HTTP 400/413/422)
    or answers with more than its byte cap is split in halves until the bad query stands alone, so only that
    one gets the error; a malformed result fails only its query. `coalesce=False`: one request per search."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 10.0,
        max_response_bytes: int = 8 << 20,
        coalesce: bool = True,
        max_batch: int = 256,
    ) -> None:
        from rlf_envs.retrieval.batcher import MicroBatcher

        if not url.startswith(("http://", "https://")):
            raise ValueError(f"retriever must be 'inprocess' or an http(s):// URL, got {url!r}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 1 <= max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch must be an integer between 1 and {MAX_BATCH} queries, got {max_batch!r}")
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout_s = timeout_s
        self.max_response_bytes = max_response_bytes
        self.max_batch = max_batch
        self.requests = 0  # HTTP requests sent (for tests and benchmarks)
        self.batcher: MicroBatcher | None = None
        if coalesce:
            self.batcher = MicroBatcher(self, max_batch=max_batch, max_wait_s=0.005, flush_when_idle=True)
            runtime.register_closer(self)  # stop the batcher task on rlf's loop at interpreter exit

    async def search(self, queries: list[str], topk: int) -> list[list[Any]]:
        if self.batcher is not None:
            return await self.batcher.search(queries, topk)
        try:
            outcome = await self._request(queries, topk)
        except _SplitBatch as e:
            raise e.error from None
        hits: list[list[Any]] = []
        for r in outcome:
            if isinstance(r, Exception):
                raise r
            hits.append(r)
        return hits

    async def asearch_batch(self, queries: list[str], topks: list[int]) -> list[list[Any] | Exception]:
        """One request per `max_batch` distinct queries (the batcher's `RemoteRetriever` side)."""
        n = self.max_batch
        parts = [self._search_splitting(queries[i : i + n], topks[i : i + n]) for i in range(0, len(queries), n)]
        return [r for part in await asyncio.gather(*parts) for r in part]

    async def _search_splitting(self, queries: list[str], topks: list[int]) -> list[list[Any] | Exception]:
        try:
            return await self._request(queries, max(topks))
        except _SplitBatch as e:
            if len(queries) == 1:
                return [e.error]
        mid = len(queries) // 2
        first, second = await asyncio.gather(
            self._search_splitting(queries[:mid], topks[:mid]), self._search_splitting(queries[mid:], topks[mid:])
        )
        return first + second

    async def _request(self, queries: list[str], topk: int) -> list[list[Any] | Exception]:
        """One POST: each query's hits or its own error. Connection errors and 5xx raise ToolCrashed, the request's
        deadline TimeoutError, a reply that is not a result list per query ToolError (all for every query); a
        whole-request refusal raises _SplitBatch (its error is what a query alone gets)."""
        from rlf_envs.retrieval.types import Document, Hit
        from rlf_envs.tools.http import http_session, read_capped

        session = await http_session()
        payload = {"queries": queries, "topk": topk, "return_scores": True}
        cap = min(self.max_response_bytes * len(queries), max(self.max_response_bytes, MAX_BATCH_RESPONSE_BYTES))
        self.requests += 1
        try:
            async with (
                asyncio.timeout(self.timeout_s),
                session.post(self.url, json=payload) as resp,
            ):
                body = await read_capped(resp, cap)
                status = resp.status
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            raise ToolCrashed(f"cannot reach the retrieval server at {self.url}: {type(e).__name__}") from None
        except TimeoutError:  # our request deadline (the caller's own deadline cancels instead)
            raise TimeoutError(
                f"Error: the retrieval server at {self.url} did not answer within {self.timeout_s:g}s."
            ) from None
        if status >= 500:
            raise ToolCrashed(f"retrieval server answered HTTP {status}")
        unexpected = ToolError(f"the retrieval server at {self.url} sent an unexpected response")
        try:
            data = json.loads(body) if len(body) <= cap else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            data = None
        if status >= 400:
            why = data.get("error") if isinstance(data, dict) else body[:300].decode("utf-8", "replace")
            rejected = ToolError(f"search rejected: {why}")
            if status in _SPLIT_STATUSES:
                raise _SplitBatch(rejected)
            raise rejected
        if len(body) > cap:
            raise _SplitBatch(unexpected)
        result = data.get("result") if isinstance(data, dict) else None
        if not isinstance(result, list) or len(result) != len(queries):  # one result list per query expected
            raise unexpected
        out: list[list[Any] | Exception] = []
        for hs in result:
            try:
                out.append([Hit(Document(str(h["document"]["id"]), str(h["document"]["contents"])), float(h["score"]))
                            for h in hs])
            except (TypeError, KeyError, ValueError):
                out.append(unexpected)
        return out

    async def aclose(self) -> None:
        """Stops the batcher; the session is rlf's shared one (closed by rlf_envs.close_all)."""
        if self.batcher is not None:
            runtime.unregister_closer(self)
            await self.batcher.aclose()


# -- the tool ---------------------------------------------------------------------------------------


class SearchTool(Tool):
    """`search(query: str, topk: int = 3)` over a backend; idempotent (safe to retry)."""

    idempotent = True
    validates_arguments = True  # `call` checks query/topk itself: the caller skips JSON-Schema validation

    def __init__(self, backend: SearchBackend, default_topk: int = DEFAULT_TOPK, max_topk: int = MAX_TOPK) -> None:
        if not 1 <= default_topk <= max_topk:
            raise ValueError(f"topk must be between 1 and {max_topk}, got {default_topk}")
        self.backend = backend
        self.default_topk = default_topk
        self.max_topk = max_topk
        self.spec = ToolSpec(
            name="search",
            description=SEARCH_DESCRIPTION,
            parameters={
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "what to search for, e.g. an entity name"},
                    "topk": {
                        "type": "integer",
                        "minimum": 1,
                        "maximum": max_topk,
                        "default": default_topk,
                        "description": "number of documents to return",
                    },
                },
                "required": ["query"],
            },
        )

    async def call(self, arguments: dict[str, Any]) -> str:
        query = arguments.get("query")
        if not isinstance(query, str) or not query.strip():
            raise InvalidArguments("'query' must be a non-empty string")
        topk = arguments.get("topk", self.default_topk)
        if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= self.max_topk:
            raise InvalidArguments(f"'topk' must be an integer between 1 and {self.max_topk}, got {topk!r}")
        [hits] = await self.backend.search([query.strip()], topk)
        return _render(hits)

    async def aclose(self) -> None:
        with _TOOLS_LOCK:
            for k, v in list(_TOOLS.items()):
                if v is self:
                    del _TOOLS[k]
        await self.backend.aclose()


_TOOLS: dict[tuple[Any, ...], SearchTool] = {}
_TOOLS_LOCK = threading.Lock()


def search_tool(
    retriever: str = "inprocess",
    index_dir: str | Path | None = None,
    topk: int = DEFAULT_TOPK,
    max_topk: int = MAX_TOPK,
    request_timeout_s: float = 10.0,
    coalesce: bool = True,
    max_batch: int = 256,
) -> SearchTool:
    """The process-wide search tool for this configuration (envs share it, so an index is loaded once and the
    searches of all envs can share HTTP requests)."""
    if retriever == "inprocess":
        path = Path(index_dir) if index_dir is not None else default_index_dir()
        key: tuple[Any, ...] = ("inprocess", str(path.resolve()), topk, max_topk)
    else:
        if index_dir is not None:
            raise ValueError("index_dir applies only to retriever='inprocess' (the server loads its own index)")
        key = ("http", retriever, topk, max_topk, request_timeout_s, bool(coalesce), max_batch)
    with _TOOLS_LOCK:
        tool = _TOOLS.get(key)
        if tool is None:
            backend: SearchBackend = (
                InProcessBackend(key[1])
                if retriever == "inprocess"
                else HTTPBackend(retriever, request_timeout_s, coalesce=coalesce, max_batch=max_batch)
            )
            tool = _TOOLS[key] = SearchTool(backend, topk, max_topk)
        return tool


def default_index_dir(world: str = "default") -> Path:
    """A BM25 index of the shipped corpus (or of `world`'s corpus) in rlf's cache dir (`$RLF_CACHE_DIR`, else
    ~/.cache/rlf), built once."""
    from rlf_envs.data.search import CORPUS_PATH
    from rlf_envs.data.search.generate import world_dir
    from rlf_envs.extras import require
    from rlf_envs.retrieval import FORMAT_VERSION, RetrievalError, build_index
    from rlf_envs.retrieval._deps import BM25S_BLOCKED, blocked_imports

    with blocked_imports(BM25S_BLOCKED):  # bm25s without jax (see rlf_envs.retrieval._deps)
        require("bm25s", "rlf/Search-v0's in-process BM25 search (retriever='inprocess', the default)")
    corpus = CORPUS_PATH if world == "default" else world_dir(world) / "corpus.jsonl"
    digest = hashlib.sha256(corpus.read_bytes()).hexdigest()[:12]
    cache = Path(os.environ.get("RLF_CACHE_DIR") or Path.home() / ".cache" / "rlf")
    out = cache / f"search-bm25-v{FORMAT_VERSION}-{digest}"
    if not (out / "manifest.json").is_file():
        try:
            build_index(corpus, out, kind="bm25", show_progress=False)
        except RetrievalError:
            if not (out / "manifest.json").is_file():  # not a lost race with another process: a real error
                raise
    return out


def search_tasks(split: str = "train", world: str = "default") -> list[Task]:
    """The invented-world questions of `split` ("train" or "test"): the shipped ones, or `world`'s
    ("quickstart": a larger generated world, see `rlf_envs.data.search.generate`)."""
    from rlf_envs.data.search import split_path
    from rlf_envs.tasks import load_jsonl

    if world == "default":
        return load_jsonl(split_path(split))
    return list(_world_tasks(world, split))


_WORLD_TASKS: dict[tuple[str, str], tuple[Task, ...]] = {}


def _world_tasks(world: str, split: str) -> tuple[Task, ...]:
    """A generated world's tasks, loaded once per process (many envs share them)."""
    from rlf_envs.data.search.generate import world_dir
    from rlf_envs.tasks import load_jsonl

    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    with _TOOLS_LOCK:
        if (world, split) not in _WORLD_TASKS:
            _WORLD_TASKS[(world, split)] = tuple(load_jsonl(world_dir(world) / f"{split}.jsonl"))
        return _WORLD_TASKS[(world, split)]


class SearchEnv(ToolEnv):
    """Question answering with a `search` tool.

    Args:
        retriever: "inprocess" (index in this process) or the URL of a retrieval server.
        index_dir: in-process index directory (default: BM25 over the shipped corpus, cached).
        split: "train" or "test" questions of the shipped data (ignored when `tasks` is given).
        topk: documents per search when the policy does not say (Search-R1 uses 3).
        format: "search_r1" (`<search>`/`<information>`/`<answer>` tags) or "qwen3" (tool calls).
        max_topk: the largest topk the policy may ask for.
        request_timeout_s: deadline of one HTTP request to the retrieval server.
        coalesce: (HTTP) gather the searches in flight across all envs of the process into one `/retrieve`
            request per batch (Search-R1's API takes a list of queries), sent as soon as rlf's loop has no more
            to add; identical queries are searched once with the largest topk asked (assumes the server's
            top-k lists are prefix-consistent, as rlf's are). Each search keeps its own deadline and its own
            error: a query the server refuses is split out of its batch. False: one request per search.
        max_batch: (HTTP, coalescing) the most distinct queries in one request, 1 to 512 (rlf's server limit).
        world: "default" (the shipped data) or "quickstart" (a larger generated world for training tiny
            policies: 3,200 people, 9,000 train / 200 test questions, test people unseen in train; built
            once into rlf's cache dir). Chooses the questions and, in-process, the default index.
        **kwargs: passed to ToolEnv (tasks, verifier, max_turns, tokenizer, extra tools, ...).
    """

    def __init__(
        self,
        retriever: str = "inprocess",
        index_dir: str | Path | None = None,
        split: str = "train",
        topk: int = DEFAULT_TOPK,
        format: Any = "search_r1",
        max_topk: int = MAX_TOPK,
        request_timeout_s: float = 10.0,
        world: str = "default",
        coalesce: bool = True,
        max_batch: int = 256,
        **kwargs: Any,
    ) -> None:
        from rlf_envs.data.search.generate import WORLDS

        if world not in WORLDS:
            raise ValueError(f"world must be one of {WORLDS}, got {world!r}")
        if world != "default" and retriever == "inprocess" and index_dir is None:
            index_dir = default_index_dir(world)
        if format not in ("search_r1", "qwen3", "hermes") and not hasattr(format, "parse"):
            raise ValueError(f"format must be 'search_r1' or 'qwen3', got {format!r}")
        self.search_tool = search_tool(retriever, index_dir, topk, max_topk, request_timeout_s, coalesce, max_batch)
        extra_tools = list(kwargs.pop("tools", ()))
        if kwargs.get("tasks") is None:
            kwargs["tasks"] = search_tasks(split, world)
        super().__init__(tools=[self.search_tool, *extra_tools], format=format, **kwargs)
