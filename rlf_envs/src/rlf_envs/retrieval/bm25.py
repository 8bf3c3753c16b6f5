"""BM25 over a corpus, backed by `bm25s` (sparse precomputed scores; lowercase, English stopwords)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from rlf_envs.retrieval._deps import require
from rlf_envs.retrieval.corpus import DocStore
from rlf_envs.retrieval.types import Document, Hit, IndexManifest, RetrievalError

BM25_DIR = "bm25"
_SPLIT = re.compile(r"(?u)\b\w\w+\b")  # bm25s' default splitter


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

    def __init__(self, directory: str | Path, manifest: IndexManifest | None = None) -> None:
        bm25s = require("bm25s")
        self.directory = Path(directory)
        self.manifest = manifest or IndexManifest.read(self.directory)
        if self.manifest.kind != "bm25":
            raise RetrievalError(f"{self.directory} holds a {self.manifest.kind} index, not bm25")
        self.docs = DocStore(self.directory)
        self._bm25: Any = bm25s.BM25.load(str(self.directory / BM25_DIR), load_vocab=True, mmap=False)
        self._vocab: dict[str, int] = dict(self._bm25.vocab_dict)
        from bm25s.stopwords import STOPWORDS_EN

        self._stopwords = frozenset(STOPWORDS_EN)
        if len(self.docs) != self.manifest.count:
            raise RetrievalError(
                f"{self.directory}: manifest says {self.manifest.count} docs, store has {len(self.docs)}"
            )

    def __len__(self) -> int:
        return len(self.docs)

    def _query_ids(self, query: str) -> list[int]:
        return [self._vocab[w] for w in _SPLIT.findall(query.lower()) if w in self._vocab and w not in self._stopwords]

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
        m = self._bm25.scores
        data, indptr, indices = m["data"], m["indptr"], m["indices"]
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
        docs that contain a query word whenever they fill the top-k with positive scores."""
        ids = self._query_ids(query)
        posted = self._posted_scores(ids) if ids else None
        if posted is not None:
            docs, vals = posted
            keep = vals != 0
            docs, vals = docs[keep], vals[keep]
            if len(docs) >= k:
                sub, top = stable_topk(vals, k)  # ties by position = by doc index (docs ascend)
                if top[-1] > 0:
                    return docs[sub], top
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


def build_bm25(
    docs: Iterator[Document] | list[Document], out: Path, *, work_dir: Path | None = None, show_progress: bool = True
) -> None:
    """Tokenise and index `docs`, saving the bm25s index under `out/bm25`.

    `work_dir` is the build's private scratch directory for resumable intermediate files (it survives a
    crash and is deleted after the build); this in-memory build does not use it."""
    bm25s = require("bm25s")
    texts = [d.contents for d in docs]
    if not texts:
        raise RetrievalError("the corpus is empty")
    tokens = bm25s.tokenize(texts, stopwords="en", show_progress=show_progress)
    model = bm25s.BM25()
    model.index(tokens, show_progress=show_progress)
    model.save(str(out / BM25_DIR), show_progress=False)
