"""Streaming BM25 build: identical to bm25s' in-memory build, bounded memory, resumable after SIGKILL,
served memory-mapped."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from repo_paths import REPO

from rlf_envs.retrieval import BM25Index, Document, RetrievalError, build_index, iter_corpus, load_index
from rlf_envs.retrieval.bm25_build import DATA_NAME, INDICES_NAME, INDPTR_NAME, PARAMS_NAME, VOCAB_NAME, build_bm25
from rlf_envs.retrieval.corpus import write_docstore
from rlf_envs.retrieval.types import IndexManifest

ROOT = REPO
CORPUS = ROOT / "rlf_envs" / "src" / "rlf_envs" / "data" / "search" / "corpus.jsonl"
ARRAYS = (DATA_NAME, INDICES_NAME, INDPTR_NAME)

# documents that exercise bm25s' tokenisation: empty, stopwords only, Unicode case folding (final sigma,
# dotted I, ß), digits and underscores (\w), one-letter words (dropped), repeats (tf > 1)
EDGE_DOCS = [
    "",
    "the of and a an",
    '"ΟΔΟΣ"\nΣΊΣΥΦΟΣ σίσυφος ΟΔΟΣ. İstanbul ISTANBUL Straße STRASSE',
    "x y z 1 22 333 a_b __init__ foo_ _bar",
    "repeat repeat repeat Repeat REPEAT once",
    "Zorbania capital is Vell; vell, VELL! the capital.",
]


def _reference(texts: list[str], save_to: Path) -> None:
    """The index the previous rlf build wrote: bm25s' tokenize + BM25.index over all texts in memory."""
    import bm25s

    model = bm25s.BM25()
    model.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
    model.save(str(save_to), show_progress=False)


def _assert_same_index(got: Path, ref: Path) -> None:
    for name in ARRAYS:
        a, b = np.load(got / name), np.load(ref / name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert json.loads((got / VOCAB_NAME).read_text()) == json.loads((ref / VOCAB_NAME).read_text())
    assert json.loads((got / PARAMS_NAME).read_text()) == json.loads((ref / PARAMS_NAME).read_text())


def _docs(texts: list[str]) -> list[Document]:
    return [Document(id=str(i), contents=t) for i, t in enumerate(texts)]


@pytest.mark.parametrize(("chunk_docs", "merge_postings"), [(1, 500), (7, 1), (64, 100_000), (10_000, 3)])
def test_streaming_build_writes_bm25s_index_bit_for_bit(tmp_path: Path, chunk_docs: int, merge_postings: int) -> None:
    """Chunked tokenisation + term-block merge give exactly bm25s' arrays, vocabulary and parameters, for
    chunks of one doc to one chunk, and blocks of one posting (every term overflows) to one block."""
    texts = EDGE_DOCS + [d.contents for d in iter_corpus(CORPUS)][:150]
    stats = build_bm25(
        _docs(texts), tmp_path, show_progress=False, chunk_docs=chunk_docs, merge_postings=merge_postings
    )
    _reference(texts, tmp_path / "ref")
    _assert_same_index(tmp_path / "bm25", tmp_path / "ref")
    assert stats.docs == len(texts) and stats.chunks_tokenised == -(-len(texts) // chunk_docs)
    assert stats.postings == len(np.load(tmp_path / "bm25" / DATA_NAME))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bm25-work")]  # own temp work dir removed


_WORDS = st.sampled_from(["the", "Alpha", "alpha", "beta", "ΣΟΦΊΑ", "σοφία", "x", "42", "a_b", "of", "Gamma"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    texts=st.lists(st.lists(_WORDS, max_size=12).map(" ".join), min_size=1, max_size=25),
    chunk_docs=st.integers(1, 9),
    merge_postings=st.integers(1, 30),
)
def test_streaming_build_matches_bm25s_on_random_corpora(
    tmp_path: Path, texts: list[str], chunk_docs: int, merge_postings: int
) -> None:
    texts = [*texts, "alpha beta"]  # bm25s cannot index a corpus without a single term
    out = tmp_path / f"case-{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    build_bm25(_docs(texts), out, show_progress=False, chunk_docs=chunk_docs, merge_postings=merge_postings)
    _reference(texts, out / "ref")
    _assert_same_index(out / "bm25", out / "ref")


def test_index_built_by_rlf_searches_like_one_built_by_plain_bm25s(tmp_path: Path) -> None:
    """On the shipped corpus: an index directory whose bm25/ was written by plain bm25s (the old build) and
    the one `build_index` writes now give the same hits and scores, memory-mapped or not."""
    new = tmp_path / "new"
    build_index(CORPUS, new, kind="bm25", show_progress=False)
    old = tmp_path / "old"
    old.mkdir()
    count = write_docstore(iter_corpus(CORPUS), old)
    IndexManifest(kind="bm25", count=count, corpus=str(CORPUS)).write(old)
    _reference([d.contents for d in iter_corpus(CORPUS)], old / "bm25")
    docs = [d.contents for d in iter_corpus(CORPUS)]
    rng = np.random.default_rng(3)
    words = " ".join(docs[:80]).split()
    queries = [d.split("\n", 1)[0].strip('"') for d in docs[:60]] + ["the of and", "zzqx", "", "Where was it?"]
    queries += [" ".join(rng.choice(words, size=int(rng.integers(1, 7)))) for _ in range(80)]
    a, b = load_index(new), BM25Index(old, mmap=False)
    try:
        assert isinstance(a, BM25Index)
        for k in (1, 5, 20):
            assert a.search_batch(queries, k) == b.search_batch(queries, k)
    finally:
        a.close()
        b.close()


def test_fewer_hits_than_k_match_a_full_ranking(bm25_index_dir: Path) -> None:
    """Rare and unknown words (fewer than k docs score, or none): the top-k is the scoring docs, then
    the lowest-index zero-score docs, exactly as ranking every document's score; also for k > N."""
    from rlf_envs.retrieval.bm25 import stable_topk

    index = load_index(bm25_index_dir)
    assert isinstance(index, BM25Index)
    try:
        titles = [index.docs[i].title for i in range(0, len(index), 7)]
        queries = [*titles, "zzqx unknownword", "", "the of and", f"{titles[0]} {titles[1]} qqq"]
        for k in (3, 10, 40, len(index), len(index) + 50):
            for q in queries:
                idx, vals = stable_topk(index.scores(q), k)
                got, scores = index._topk(q, k)
                assert got.tolist() == idx.tolist() and scores.tolist() == vals.tolist(), (q, k)
                assert scores.dtype == vals.dtype
    finally:
        index.close()


def test_served_index_is_memory_mapped(bm25_index_dir: Path) -> None:
    index = load_index(bm25_index_dir)
    try:
        assert isinstance(index, BM25Index)
        for name in ("data", "indices", "indptr"):
            assert isinstance(index._bm25.scores[name], np.memmap), name
        for view, name in zip(index._postings, ("data", "indptr", "indices"), strict=True):
            assert np.shares_memory(view, index._bm25.scores[name]), name  # the search path reads the map
        ram = BM25Index(bm25_index_dir, mmap=False)
        assert not isinstance(ram._bm25.scores["data"], np.memmap)
        queries = ["capital", "Where was the painter born?", "river of the north"]
        assert index.search_batch(queries, 5) == ram.search_batch(queries, 5)
        ram.close()
    finally:
        index.close()


# -- resume ------------------------------------------------------------------------------------------------


def _chunk_stamps(work: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(work)): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in sorted(work.glob("chunk-*/*"))
        if p.is_file()
    }


def test_rerun_reuses_chunks_and_rejects_another_corpus(tmp_path: Path) -> None:
    docs = list(iter_corpus(CORPUS))
    work = tmp_path / "work"
    first = build_bm25(docs, tmp_path / "a", work_dir=work, show_progress=False, chunk_docs=100)
    assert (first.chunks_tokenised, first.chunks_reused) == (5, 0)
    stamps = _chunk_stamps(work)
    (work / "chunk-000003.tmp-999").mkdir()  # what a crash while writing a chunk leaves
    again = build_bm25(docs, tmp_path / "b", work_dir=work, show_progress=False, chunk_docs=100)
    assert (again.chunks_tokenised, again.chunks_reused) == (0, 5)
    assert _chunk_stamps(work) == stamps  # not rewritten
    assert not (work / "chunk-000003.tmp-999").exists()
    _assert_same_index(tmp_path / "b" / "bm25", tmp_path / "a" / "bm25")

    changed = [*docs[:250], Document(id=docs[250].id, contents=docs[250].contents + " extra"), *docs[251:]]
    with pytest.raises(RetrievalError, match="other documents"):
        build_bm25(changed, tmp_path / "c", work_dir=work, show_progress=False, chunk_docs=100)
    with pytest.raises(RetrievalError, match="corpus ends"):
        build_bm25(docs[:200], tmp_path / "c", work_dir=work, show_progress=False, chunk_docs=100)
    with pytest.raises(RetrievalError, match="other settings"):
        build_bm25(docs, tmp_path / "c", work_dir=work, show_progress=False, chunk_docs=50)
    with pytest.raises(RetrievalError, match="empty"):
        build_bm25([], tmp_path / "c", work_dir=tmp_path / "w2", show_progress=False)


_KILLABLE = textwrap.dedent(
    """
    import sys, threading
    from pathlib import Path
    from rlf_envs.retrieval import iter_corpus
    from rlf_envs.retrieval.bm25_build import build_bm25

    corpus, out, work, stop_after = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])

    def docs():
        for i, d in enumerate(iter_corpus(corpus)):
            if i == stop_after:  # mid-chunk: park here until killed
                print("parked", flush=True)
                threading.Event().wait()
            yield d

    build_bm25(docs(), out, work_dir=work, show_progress=False, chunk_docs=60)
    """
)


def test_build_resumes_after_sigkill(tmp_path: Path) -> None:
    """A build killed with SIGKILL in the middle of a chunk (a real subprocess) leaves its complete
    chunks; the re-run tokenises only the rest and writes the same index as an uninterrupted build."""
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLABLE, str(CORPUS), str(out), str(work), "250"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "parked"  # docs 0..249 read: chunks 0-3 written, 4 pending
        deadline = time.monotonic() + 120
        while len(list(work.glob("chunk-00000[0-3]"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        if proc.stdout is not None:
            proc.stdout.close()
    assert sorted(p.name for p in work.glob("chunk-*")) == [f"chunk-{k:06d}" for k in range(4)]
    stamps = _chunk_stamps(work)
    resumed = build_bm25(list(iter_corpus(CORPUS)), out, work_dir=work, show_progress=False, chunk_docs=60)
    assert (resumed.chunks_reused, resumed.chunks_tokenised) == (4, 4)  # 450 docs = 8 chunks of 60
    assert {k: v for k, v in _chunk_stamps(work).items() if k in stamps} == stamps
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    build_bm25(iter_corpus(CORPUS), fresh, show_progress=False, chunk_docs=60)
    _assert_same_index(out / "bm25", fresh / "bm25")
    shutil.rmtree(work)


# -- bounded memory ----------------------------------------------------------------------------------------

_MEASURE = textwrap.dedent(
    """
    import json, resource, sys
    from pathlib import Path
    import numpy as np
    import bm25s, bm25s.stopwords
    from rlf_envs.retrieval import iter_corpus
    from rlf_envs.retrieval.bm25_build import build_bm25

    corpus, out, chunk_docs = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])

    def status(key):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise KeyError(key)

    try:  # reset the peak-RSS mark (VmHWM) to the current RSS, so the peak is the build's own
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    base = status("VmRSS")
    if not reset and resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > base + 4096:
        raise SystemExit("cannot reset the peak RSS and the start-up peak would hide the build's")
    build_bm25(iter_corpus(corpus), out, show_progress=False, chunk_docs=chunk_docs, merge_postings=20_000)
    peak = status("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth_kib": peak - base}))
    """
)


def _build_growth_mib(corpus: Path, out: Path, chunk_docs: int) -> float:
    out.mkdir()
    res = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(corpus), str(out), str(chunk_docs)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return float(json.loads(res.stdout.strip().splitlines()[-1])["growth_kib"]) / 1024


def test_build_memory_does_not_grow_with_the_corpus(tmp_path: Path) -> None:
    """Peak RSS growth of a build (in a fresh subprocess, peak measured from just before the build) of 4N
    passages is about that of N passages when streaming in chunks of 250 docs; the same build of 4N in
    one chunk (what holding the corpus in memory costs) shows the measurement sees the difference."""
    from rlf_envs.data.wiki.generate import WikiGenerator, WikiShape

    n = 2500
    gen = WikiGenerator(WikiShape(vocab=5000))
    corpora = {}
    for size in (n, 4 * n):
        corpora[size] = tmp_path / f"wiki-{size}.jsonl"
        with corpora[size].open("w") as f:
            for p in gen.passages(0, size):
                f.write(json.dumps(p) + "\n")
    small = _build_growth_mib(corpora[n], tmp_path / "small", chunk_docs=250)
    large = _build_growth_mib(corpora[4 * n], tmp_path / "large", chunk_docs=250)
    whole = _build_growth_mib(corpora[4 * n], tmp_path / "whole", chunk_docs=4 * n)
    report = f"growth: N={small:.1f} MiB, 4N={large:.1f} MiB, 4N in one chunk={whole:.1f} MiB"
    assert whole - large > 25, report  # holding 10,000 passages' tokens is visible
    assert large - small < 3, report  # streaming: 7,500 more passages cost nothing (holding just their
    # Documents would add ~6 MiB; measured differences of a correct build: -0.3..0 MiB)
