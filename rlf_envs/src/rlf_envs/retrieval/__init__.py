"""The retrieval core: build, load and search dense (faiss) and BM25 indexes over a wiki-18-style corpus.

Optional extra: `pip install -e './rlf_envs[search]'`. faiss, bm25s and sentence-transformers (torch)
are imported only when an index is built or loaded, never when this package is imported. Used by
`servers.retrieval` (the Search-R1-compatible HTTP server) and by the Search env's in-process mode.

    from rlf_envs.retrieval import build_index, load_index
    build_index("corpus.jsonl", "idx", kind="bm25")
    hits = load_index("idx").search_batch(["capital of Zorbania"], topk=3)
"""

from rlf_envs.retrieval._deps import DEFAULT_MODEL, resolve_model_dir
from rlf_envs.retrieval.batcher import BatcherClosed, BatcherStats, MicroBatcher
from rlf_envs.retrieval.bm25 import BM25Index
from rlf_envs.retrieval.build import build_index, load_index
from rlf_envs.retrieval.corpus import DocStore, format_hits, iter_corpus
from rlf_envs.retrieval.dense import DenseIndex, Encoder
from rlf_envs.retrieval.types import (
    FORMAT_VERSION,
    Document,
    FaissKind,
    Hit,
    IndexKind,
    IndexManifest,
    RetrievalError,
    Retriever,
)

__all__ = [
    "DEFAULT_MODEL",
    "FORMAT_VERSION",
    "BM25Index",
    "BatcherClosed",
    "BatcherStats",
    "DenseIndex",
    "DocStore",
    "Document",
    "Encoder",
    "FaissKind",
    "Hit",
    "IndexKind",
    "IndexManifest",
    "MicroBatcher",
    "RetrievalError",
    "Retriever",
    "build_index",
    "format_hits",
    "iter_corpus",
    "load_index",
    "resolve_model_dir",
]
