"""Streaming, resumable BM25 build that writes bm25s' on-disk index with memory bounded by the chunk size.

bm25s' own `tokenize` + `BM25.index` hold every token of the corpus in Python lists (wiki-18: 21M
passages, ~2G tokens). This builds the same index in two stages:

1. **Tokenise** the documents `chunk_docs` at a time with bm25s' tokenisation (lowercase, its splitter
   `(?u)\\b\\w\\w+\\b`, its English stopwords, vocabulary ids in order of first occurrence) and write
   each chunk's postings `(term, doc, tf)` sorted by term, its doc lengths and its new words to
   `work_dir/chunk-NNNNNN/` (renamed into place when complete). A re-run with the same `work_dir`
   reuses the chunks already there (after checking they came from the same documents) and tokenises
   only the rest, so a crash costs at most one chunk.
2. **Merge** the chunks into bm25s' CSC score matrix (`data` float32 scores, `indices` int32 doc ids,
   `indptr` int64, one column per term), one block of terms at a time: a block holds at most
   `merge_postings` postings (or one term's whole posting list if that is longer), filled from every
   chunk's slice for those terms and appended to the output files.

Scores are computed with bm25s' formula (`method="lucene"`, k1=1.5, b=0.75) in the same float64
operations, rounded to float32 the same way, so `data`, `indices`, `indptr` and the vocabulary equal
what `bm25s.BM25().index(bm25s.tokenize(texts, stopwords="en"))` produces, and `bm25s.BM25.load` reads
the result. Memory: the vocabulary (a dict and a few O(vocab) arrays), one chunk, one merge block.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import itertools
import json
import math
import os
import re
import shutil
import tempfile
import time
from array import array
from collections.abc import Iterable, Iterator, Sized
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from rlf_envs.retrieval._deps import require_bm25s
from rlf_envs.retrieval.types import Document, RetrievalError

BM25_DIR = "bm25"
SPLIT = re.compile(r"(?u)\b\w\w+\b")  # bm25s' default token pattern (scikit-learn's)

# bm25s' file names (BM25.save / BM25.load defaults)
DATA_NAME = "data.csc.index.npy"
INDICES_NAME = "indices.csc.index.npy"
INDPTR_NAME = "indptr.csc.index.npy"
VOCAB_NAME = "vocab.index.json"
PARAMS_NAME = "params.index.json"

WORK_FORMAT = 1
_META = "meta.json"
_CHUNK_FILES = ("terms.npy", "tptr.npy", "docs.npy", "tfs.npy", "doclen.npy", "words.json")


def english_stopwords() -> tuple[str, ...]:
    """bm25s' English stopword list (what `bm25s.tokenize(stopwords="en")` removes)."""
    return tuple(require_bm25s("bm25s.stopwords").STOPWORDS_EN)


def split_words(text: str) -> list[str]:
    """bm25s' tokenisation before stopword removal: lowercase, then its token pattern."""
    return SPLIT.findall(text.lower())


@dataclass(frozen=True, slots=True)
class BM25Params:
    """The BM25 variant written to `params.index.json` (bm25s' defaults; the only one rlf builds)."""

    k1: float = 1.5
    b: float = 0.75
    delta: float = 0.5  # stored for bm25s; unused by the lucene variant
    method: str = "lucene"
    idf_method: str = "lucene"
    dtype: str = "float32"
    int_dtype: str = "int32"


@dataclass(frozen=True, slots=True)
class BM25BuildStats:
    """What a build did: sizes of the index, and how many chunks it tokenised vs reused from `work_dir`."""

    docs: int
    vocab: int
    postings: int
    chunks_tokenised: int
    chunks_reused: int
    merge_blocks: int
    tokenise_seconds: float
    merge_seconds: float


class _Vocabulary(dict[str, int]):
    """Token -> raw id, stopwords first (raw ids below `n_stop`); unseen tokens get the next id on lookup,
    so `[v[t] for t in words]` tokenises at dict speed. Term id = raw id - n_stop."""

    def __init__(self, stopwords: Iterable[str]) -> None:
        super().__init__()
        for w in stopwords:
            self.setdefault(w, len(self))
        self.n_stop = len(self)
        self.new: list[str] = []

    def __missing__(self, key: str) -> int:
        i = len(self)
        self[key] = i
        self.new.append(key)
        return i

    def add_known(self, words: list[str]) -> None:
        """Re-register words of a reused chunk (resume), in their original order."""
        for w in words:
            if w in self:
                raise RetrievalError(f"work_dir is inconsistent: word {w!r} is new in two chunks; delete it")
            self[w] = len(self)

    @property
    def n_terms(self) -> int:
        return len(self) - self.n_stop


def _fingerprint(docs: list[Document]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for d in docs:
        h.update(d.id.encode("utf-8"))
        h.update(b"\x00")
        h.update(d.contents.encode("utf-8"))
        h.update(b"\x01")
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class _ChunkInfo:
    first_doc: int
    n_docs: int
    fingerprint: str
    n_terms: int  # distinct terms in the chunk
    n_postings: int


def _chunk_dir(work: Path, k: int) -> Path:
    return work / f"chunk-{k:06d}"


def _tokenise_chunk(docs: list[Document], first_doc: int, vocab: _Vocabulary, target: Path) -> _ChunkInfo:
    """Tokenise `docs` (global indices from `first_doc`) and write the chunk directory atomically."""
    vocab.new = []
    raw = array("q")
    lens = np.empty(len(docs), dtype=np.int64)
    for i, d in enumerate(docs):
        ids = [vocab[w] for w in split_words(d.contents)]
        raw.extend(ids)
        lens[i] = len(ids)
    ids_arr = np.frombuffer(raw, dtype=np.int64) if len(raw) else np.empty(0, dtype=np.int64)
    local_doc = np.repeat(np.arange(len(docs), dtype=np.int64), lens)
    keep = ids_arr >= vocab.n_stop
    term = ids_arr[keep] - vocab.n_stop
    local_doc = local_doc[keep]
    doclen = np.bincount(local_doc, minlength=len(docs)).astype(np.int32)
    keys, tfs = np.unique(term * len(docs) + local_doc, return_counts=True)  # sorted by (term, doc)
    p_term, p_doc = np.divmod(keys, len(docs))
    terms, starts = np.unique(p_term, return_index=True)
    tptr = np.append(starts, len(keys)).astype(np.int64)
    info = _ChunkInfo(first_doc, len(docs), _fingerprint(docs), len(terms), len(keys))
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    np.save(tmp / "terms.npy", terms.astype(np.int32))
    np.save(tmp / "tptr.npy", tptr)
    np.save(tmp / "docs.npy", (p_doc + first_doc).astype(np.int32))
    np.save(tmp / "tfs.npy", tfs.astype(np.int32))
    np.save(tmp / "doclen.npy", doclen)
    (tmp / "words.json").write_text(json.dumps(vocab.new, ensure_ascii=False), encoding="utf-8")
    (tmp / "info.json").write_text(json.dumps(asdict(info)))
    _fsync_dir_files(tmp)
    tmp.rename(target)
    vocab.new = []
    return info


def _fsync_dir_files(d: Path) -> None:
    for p in d.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _read_info(d: Path) -> _ChunkInfo:
    try:
        raw = json.loads((d / "info.json").read_text())
        info = _ChunkInfo(**raw)
    except (OSError, ValueError, TypeError) as e:
        raise RetrievalError(f"{d} is not a complete BM25 chunk ({e}); delete the work_dir and rebuild") from e
    missing = [n for n in _CHUNK_FILES if not (d / n).is_file()]
    if missing:
        raise RetrievalError(f"{d} lacks {missing}; delete the work_dir and rebuild")
    return info


def _load(d: Path, name: str, a: int | None = None, b: int | None = None) -> np.ndarray:
    """A copy of `name`'s elements [a:b], read through a short-lived memory map (unmapped on return, so
    the pages read do not stay in this process's RSS)."""
    mm = np.load(d / name, mmap_mode="r")
    try:
        return np.array(mm[a:b])
    finally:
        del mm


def _progress(total: int | None, desc: str, enabled: bool, unit: str = "doc") -> Any:
    """A tqdm bar when tqdm is installed and `enabled`; otherwise a silent stand-in."""
    if enabled:
        with contextlib.suppress(ImportError):
            return importlib.import_module("tqdm").tqdm(total=total, desc=desc, unit=unit)

    class _Silent:
        def update(self, n: int = 1) -> None:
            pass

        def close(self) -> None:
            pass

    return _Silent()


def _prepare_work_dir(work: Path, chunk_docs: int, params: BM25Params) -> list[Path]:
    """Check (or create) the work_dir's metadata; drop partial chunks; return the complete chunks in order."""
    work.mkdir(parents=True, exist_ok=True)
    meta = {"format": WORK_FORMAT, "chunk_docs": chunk_docs, "params": asdict(params), "tokenizer": "bm25s-en"}
    meta_path = work / _META
    if meta_path.is_file():
        try:
            old = json.loads(meta_path.read_text())
        except ValueError as e:
            raise RetrievalError(f"{meta_path} is unreadable ({e}); delete {work} and rebuild") from e
        if old != meta:
            raise RetrievalError(
                f"{work} holds BM25 chunks built with other settings ({old}, now {meta}); "
                f"delete it or rebuild with the same settings"
            )
    else:
        meta_path.write_text(json.dumps(meta, sort_keys=True))
    for p in work.glob("chunk-*.tmp-*"):  # a crash while writing a chunk
        shutil.rmtree(p, ignore_errors=True)
    chunks: list[Path] = []
    while _chunk_dir(work, len(chunks)).is_dir():
        chunks.append(_chunk_dir(work, len(chunks)))
    stray = sorted(p.name for p in work.glob("chunk-*") if p.is_dir() and p not in chunks)
    if stray:
        raise RetrievalError(f"{work} holds chunks out of sequence ({stray[:3]}...); delete it and rebuild")
    return chunks


def _tokenise_all(
    docs: Iterable[Document],
    work: Path,
    vocab: _Vocabulary,
    chunk_docs: int,
    params: BM25Params,
    total: int | None,
    show_progress: bool,
) -> tuple[list[_ChunkInfo], int]:
    """Stage 1: every chunk of `docs` in `work`; returns their infos and how many were reused."""
    existing = _prepare_work_dir(work, chunk_docs, params)
    infos: list[_ChunkInfo] = []
    bar = _progress(total, "BM25 tokenise", show_progress)
    try:
        it = iter(docs)
        n_docs = 0
        for k in itertools.count():  # one chunk per iteration, until the documents end
            pending = _take(it, chunk_docs)
            if not pending:
                break
            if k < len(existing):
                info = _read_info(existing[k])
                if (info.first_doc, info.n_docs, info.fingerprint) != (n_docs, len(pending), _fingerprint(pending)):
                    raise RetrievalError(
                        f"{existing[k]} was built from other documents than docs {n_docs}.."
                        f"{n_docs + len(pending) - 1} of this corpus; delete {work} to rebuild from scratch"
                    )
                vocab.add_known(json.loads((existing[k] / "words.json").read_text(encoding="utf-8")))
            else:
                info = _tokenise_chunk(pending, n_docs, vocab, _chunk_dir(work, k))
            infos.append(info)
            n_docs += len(pending)
            bar.update(len(pending))
            if len(pending) < chunk_docs:
                break
    finally:
        bar.close()
    if len(infos) < len(existing):
        raise RetrievalError(
            f"{work} holds {len(existing)} chunks but the corpus ends after {len(infos)}: it was built from "
            f"another corpus; delete it to rebuild"
        )
    return infos, min(len(existing), len(infos))


def _take(it: Iterator[Document], n: int) -> list[Document]:
    out: list[Document] = []
    for d in it:
        out.append(d)
        if len(out) == n:
            break
    return out


def _idf(df: np.ndarray, n_docs: int) -> np.ndarray:
    """bm25s' lucene idf, log(1 + (N - df + 0.5) / (df + 0.5)), in Python floats as bm25s computes it
    (math.log, not numpy's, so the float32 values match bit for bit), once per distinct df."""
    values, inverse = np.unique(df, return_inverse=True)
    idf_of = np.array([math.log(1 + (n_docs - v + 0.5) / (v + 0.5)) if v else 0.0 for v in values.tolist()])
    return idf_of[inverse].astype(np.float32)


def _open_npy(path: Path, dtype: np.dtype[Any], n: int) -> BinaryIO:
    f = path.open("wb")
    np.lib.format.write_array_header_1_0(
        f, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (n,)}
    )
    return f


def _merge(
    work: Path,
    infos: list[_ChunkInfo],
    n_terms: int,
    out: Path,
    params: BM25Params,
    merge_postings: int,
    show_progress: bool,
) -> int:
    """Stage 2: the chunks' postings -> bm25s' CSC arrays in `out`. Returns the number of term blocks."""
    chunks = [_chunk_dir(work, k) for k in range(len(infos))]
    df = np.zeros(n_terms, dtype=np.int64)
    total_len = 0
    for c in chunks:
        terms, tptr = _load(c, "terms.npy"), _load(c, "tptr.npy")
        df[terms] += np.diff(tptr)
        total_len += int(_load(c, "doclen.npy").sum(dtype=np.int64))
    n_docs = sum(i.n_docs for i in infos)
    indptr = np.zeros(n_terms + 1, dtype=np.int64)
    np.cumsum(df, out=indptr[1:])
    nnz = int(indptr[-1])
    idf = _idf(df, n_docs)
    del df
    avg_len = total_len / n_docs  # == numpy's mean of the integer lengths (exact sum below 2**53)
    k1, b = params.k1, params.b
    np.save(out / INDPTR_NAME, indptr)

    # term blocks [t0, t1): at most merge_postings postings each (a longer single term is a block alone)
    bounds = [0]
    while bounds[-1] < n_terms:
        t0 = bounds[-1]
        t1 = int(np.searchsorted(indptr, indptr[t0] + merge_postings, side="right")) - 1
        bounds.append(min(max(t1, t0 + 1), n_terms))
    bar = _progress(len(bounds) - 1, "BM25 merge", show_progress, unit="block")
    data_f = _open_npy(out / DATA_NAME, np.dtype(np.float32), nnz)
    idx_f = _open_npy(out / INDICES_NAME, np.dtype(np.int32), nnz)
    try:
        for t0, t1 in itertools.pairwise(bounds):
            base = int(indptr[t0])
            size = int(indptr[t1]) - base
            data = np.empty(size, dtype=np.float32)
            indices = np.empty(size, dtype=np.int32)
            head = indptr[t0:t1] - base  # next free slot of each term in the block
            filled = 0
            for c, info in zip(chunks, infos, strict=True):
                terms_mm = np.load(c / "terms.npy", mmap_mode="r")
                lo, hi = (int(x) for x in np.searchsorted(terms_mm, [t0, t1]))
                if lo == hi:
                    del terms_mm
                    continue
                terms = np.array(terms_mm[lo:hi], dtype=np.int64)
                del terms_mm
                tptr = _load(c, "tptr.npy", lo, hi + 1)
                a, z = int(tptr[0]), int(tptr[-1])
                docs = _load(c, "docs.npy", a, z)
                tf = _load(c, "tfs.npy", a, z).astype(np.float64)
                # bm25s (_score_tfc_robertson): tf / (k1 * ((1 - b) + b * l_d / l_avg) + tf), float64;
                # times the float32 idf, rounded to float32
                doclen = _load(c, "doclen.npy").astype(np.float64)
                denom = k1 * ((1 - b) + b * doclen / avg_len)
                counts = np.diff(tptr)
                term_of = np.repeat(terms, counts)
                tfc = tf / (denom[docs - info.first_doc] + tf)
                scores = (idf[term_of].astype(np.float64) * tfc).astype(np.float32)
                pos = np.repeat(head[terms - t0] - (tptr[:-1] - a), counts) + np.arange(z - a)
                data[pos] = scores
                indices[pos] = docs
                head[terms - t0] += counts
                filled += z - a
            if filled != size:
                raise RetrievalError(f"BM25 merge: block {t0}..{t1} got {filled} postings, expected {size}")
            data.tofile(data_f)
            indices.tofile(idx_f)
            bar.update(1)
        for f in (data_f, idx_f):
            f.flush()
            os.fsync(f.fileno())
    finally:
        data_f.close()
        idx_f.close()
        bar.close()
    return len(bounds) - 1


def _write_vocab(work: Path, n_chunks: int, path: Path) -> int:
    """bm25s' vocab.index.json: every term -> its id (first-occurrence order), then "" -> len (bm25s'
    empty token, added by BM25.index). Streams the words chunk by chunk."""
    n = 0
    with path.open("w", encoding="utf-8") as f:
        f.write("{")
        for k in range(n_chunks):
            for w in json.loads((_chunk_dir(work, k) / "words.json").read_text(encoding="utf-8")):
                f.write(f"{',' if n else ''}{json.dumps(w, ensure_ascii=False)}: {n}")
                n += 1
        f.write(f'{"," if n else ""}"": {n}}}')
    return n


def build_bm25(
    docs: Iterable[Document],
    out: Path,
    *,
    work_dir: Path | None = None,
    show_progress: bool = True,
    chunk_docs: int = 20_000,
    merge_postings: int = 32_000_000,
    total: int | None = None,
    params: BM25Params | None = None,
) -> BM25BuildStats:
    """Index `docs` into `out/bm25` (bm25s' format), streaming with bounded memory.

    `work_dir` holds the tokenised chunks; pass a persistent one to make the build resumable (a re-run
    after a crash reuses its complete chunks; it is left in place for the caller to remove). Without
    one a temporary directory under `out` is used and removed. Memory: about `chunk_docs` documents'
    tokens (~100 MB at 20,000 wiki passages), a merge block of `merge_postings` postings at 8 bytes
    each plus scratch, and the vocabulary.
    """
    if chunk_docs < 1 or merge_postings < 1:
        raise RetrievalError(f"chunk_docs and merge_postings must be >= 1, got {chunk_docs}, {merge_postings}")
    params = params or BM25Params()
    out = Path(out)
    if total is None and isinstance(docs, Sized):
        total = len(docs)
    own_work = work_dir is None
    work = Path(tempfile.mkdtemp(prefix=".bm25-work-", dir=out)) if work_dir is None else Path(work_dir)
    try:
        t0 = time.perf_counter()
        vocab = _Vocabulary(english_stopwords())
        infos, reused = _tokenise_all(docs, work, vocab, chunk_docs, params, total, show_progress)
        if not infos:
            raise RetrievalError("the corpus is empty")
        n_terms = vocab.n_terms
        t1 = time.perf_counter()
        del vocab  # the merge needs only O(vocab) arrays, not the dict
        target = out / BM25_DIR
        target.mkdir(parents=True, exist_ok=True)
        blocks = _merge(work, infos, n_terms, target, params, merge_postings, show_progress)
        if _write_vocab(work, len(infos), target / VOCAB_NAME) != n_terms:
            raise RetrievalError(f"{work}: the chunks' words do not add up to the vocabulary; delete it and rebuild")
        bm25s = require_bm25s()
        meta = {**asdict(params), "num_docs": sum(i.n_docs for i in infos), "version": bm25s.__version__}
        meta["backend"] = "numpy"
        (target / PARAMS_NAME).write_text(json.dumps(meta, indent=4))
        return BM25BuildStats(
            docs=sum(i.n_docs for i in infos),
            vocab=n_terms,
            postings=sum(i.n_postings for i in infos),
            chunks_tokenised=len(infos) - reused,
            chunks_reused=reused,
            merge_blocks=blocks,
            tokenise_seconds=t1 - t0,
            merge_seconds=time.perf_counter() - t1,
        )
    finally:
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
