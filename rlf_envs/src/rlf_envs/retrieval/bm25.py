"""BM25 over a corpus, in `bm25s`' index format (sparse precomputed scores; lowercase, English stopwords).

The index is built by `bm25_build.build_bm25` (streaming, bounded memory, resumable) and served
memory-mapped: the postings stay in the page cache, not in the server's private memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from rlf_envs.retrieval._deps import require_bm25s
from rlf_envs.retrieval.bm25_build import BM25_DIR, VOCAB_NAME, build_bm25, english_stopwords, split_words
from rlf_envs.retrieval.corpus import DocStore
from rlf_envs.retrieval.types import Hit, IndexManifest, RetrievalError

__all__ = ["BM25_DIR", "BM25Index", "build_bm25", "stable_topk"]


def stable_topk(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices and values of the k best scores, ties broken by lower index.

    Unlike a bare argpartition this is deterministic and prefix-consistent: the top-3 is the first
    three of the top-10, so a batcher may search once with the largest k and truncate.
    """
    n = scores.shape[0]
    k = min(k, n)
    if k <= 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=scores.dtype)
    if k < n:
        kth = np.partition(scores, n - k)[n - k]
        candidates = np.flatnonzero(scores >= kth)
    else:
        candidates = np.arange(n)
    order = np.lexsort((candidates, -scores[candidates]))[:k]
    idx = candidates[order]
    return idx, scores[idx]


class BM25Index:
    """A BM25 retriever over an index directory built by `build_index(kind="bm25")`."""

    def __init__(self, directory: str | Path, manifest: IndexManifest | None = None, *, mmap: bool = True) -> None:
        """`mmap=True` (default) maps the postings (score matrix) from disk, so they cost page cache, shared
        and reclaimable, rather than this process's memory; `mmap=False` reads them into memory."""
        bm25s = require_bm25s()
        self.directory = Path(directory)
        self.manifest = manifest or IndexManifest.read(self.directory)
        if self.manifest.kind != "bm25":
            raise RetrievalError(f"{self.directory} holds a {self.manifest.kind} index, not bm25")
        self.docs = DocStore(self.directory)
        bm25_dir = self.directory / BM25_DIR
        # the vocabulary is read here once (bm25s' load_vocab would also build a set of every term id, which
        # nothing uses)
        self._bm25: Any = bm25s.BM25.load(str(bm25_dir), load_vocab=False, mmap=mmap)
        self._vocab: dict[str, int] = json.loads((bm25_dir / VOCAB_NAME).read_text(encoding="utf-8"))
        self._stopwords = frozenset(english_stopwords())
        m = self._bm25.scores
        # plain ndarray views of the (memory-mapped) arrays: slicing an np.memmap costs a Python-level
        # __array_finalize__ per slice, ~20% of a search at 1M passages
        self._postings = (np.asarray(m["data"]), np.asarray(m["indptr"]), np.asarray(m["indices"]))
        if len(self.docs) != self.manifest.count:
            raise RetrievalError(
                f"{self.directory}: manifest says {self.manifest.count} docs, store has {len(self.docs)}"
            )

    def __len__(self) -> int:
        return len(self.docs)

    def _query_ids(self, query: str) -> list[int]:
        return [self._vocab[w] for w in split_words(query) if w in self._vocab and w not in self._stopwords]

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every document for `query` (zeros when no query word is in the vocabulary)."""
        return self._dense_scores(self._query_ids(query))

    def _dense_scores(self, ids: list[int]) -> np.ndarray:
        if not ids:
            return np.zeros(len(self.docs), dtype=np.float32)
        return np.asarray(self._bm25.get_scores_from_ids(ids))

    def _posted_scores(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """(ascending doc indices, their scores) for the docs in the query words' posting lists, summed in
        query-word order in the index dtype exactly as bm25s sums its dense array, so the values are
        bit-identical; every other doc scores exactly 0. None when every doc may score (BM25L/BM25+)."""
        if getattr(self._bm25, "nonoccurrence_array", None) is not None:
            return None
        data, indptr, indices = self._postings
        spans = [(int(indptr[i]), int(indptr[i + 1])) for i in ids]
        if len(spans) == 1:
            a, b = spans[0]
            docs = indices[a:b]
            if len(docs) < 2 or bool(np.all(docs[1:] > docs[:-1])):  # sorted by doc, as bm25s writes them
                return docs, data[a:b]  # 0 + x == x: the same values as the dense sum
        flat_docs = np.concatenate([indices[a:b] for a, b in spans])
        flat_vals = np.concatenate([data[a:b] for a, b in spans])
        docs, inverse = np.unique(flat_docs, return_inverse=True)
        vals = np.zeros(len(docs), dtype=np.dtype(self._bm25.dtype))
        np.add.at(vals, inverse, flat_vals)
        return docs, vals

    def _topk(self, query: str, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Same indices, values and tie order as `stable_topk(self.scores(query), k)`, ranking only the
        docs that contain a query word. When fewer than k docs score (rare or unknown words: a policy
        can send those at will), the rest of the top-k are the lowest-index docs scoring exactly 0, as in
        the full ranking, without sorting all N of them (30 ms per query at 1M passages)."""
        ids = self._query_ids(query)
        if ids:
            posted = self._posted_scores(ids)
        else:  # no known word: every doc scores 0
            posted = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.dtype(self._bm25.dtype))
        if posted is not None:
            docs, vals = posted
            keep = vals != 0
            docs, vals = docs[keep], vals[keep]
            if len(docs) >= k:
                sub, top = stable_topk(vals, k)  # ties by position = by doc index (docs ascend)
                if top[-1] > 0:
                    return docs[sub], top
            elif not bool((vals < 0).any()):  # every doc not in `docs` scores exactly 0, below them
                k = min(k, len(self.docs))
                order = np.lexsort((docs, -vals))
                zeros = np.setdiff1d(np.arange(k), docs)[: k - len(docs)]
                zero_vals = np.zeros(len(zeros), dtype=vals.dtype)
                return np.concatenate([docs[order], zeros]), np.concatenate([vals[order], zero_vals])
        return stable_topk(self._dense_scores(ids), k)

    def search_batch(self, queries: list[str], topk: int) -> list[list[Hit]]:
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        out: list[list[Hit]] = []
        for q in queries:
            idx, vals = self._topk(q, topk)
            out.append([Hit(self.docs[int(i)], float(v)) for i, v in zip(idx, vals, strict=True)])
        return out

    def close(self) -> None:
        self.docs.close()
