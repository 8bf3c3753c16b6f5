"""Dense retrieval: a sentence-transformers encoder plus a faiss inner-product index.

faiss index types: `flat` (exact, the default), `ivf` (IVF-Flat, for millions of passages) and
`hnsw` (graph, no training). When faiss was built with GPUs (faiss-gpu-cu12) and one is visible,
flat and IVF indexes are moved to the GPU(s) at load time.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from rlf_envs.retrieval._deps import DEFAULT_MODEL, offline_env, require, resolve_model_dir
from rlf_envs.retrieval.corpus import DocStore
from rlf_envs.retrieval.types import FaissKind, Hit, IndexManifest, RetrievalError

FAISS_NAME = "index.faiss"
E5_QUERY_PREFIX = "query: "
E5_PASSAGE_PREFIX = "passage: "


_MODELS: dict[tuple[str, str], tuple[Any, threading.Lock]] = {}
_MODELS_LOCK = threading.Lock()


def _load_model(st: Any, path: Path, device: str) -> tuple[Any, threading.Lock]:
    """One loaded model per (directory, device) per process, with the lock that serialises its use."""
    key = (str(path), device)
    with _MODELS_LOCK:
        if key not in _MODELS:
            try:
                model = st.SentenceTransformer(str(path), device=device, local_files_only=True)
            except Exception as e:
                raise RetrievalError(f"could not load a sentence-transformers model from {path}: {e}") from e
            _MODELS[key] = (model, threading.Lock())
        return _MODELS[key]


class Encoder:
    """A sentence-transformers model loaded from a local directory, strictly offline."""

    def __init__(
        self,
        model: str | None = None,
        device: str | None = None,
        query_prefix: str = "",
        passage_prefix: str = "",
        normalize: bool = True,
        batch_size: int = 128,
    ) -> None:
        offline_env()
        path = resolve_model_dir(model)
        st = require("sentence_transformers")
        if device is None:
            torch = require("torch")
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model, self._lock = _load_model(st, path, device)
        self.name = DEFAULT_MODEL if model is None else model
        self.path = path
        self.query_prefix = query_prefix
        self.passage_prefix = passage_prefix
        self.normalize = normalize
        self.batch_size = batch_size
        get_dims = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        dims = get_dims()
        if not dims:
            dims = int(self._encode(["probe"]).shape[1])
        self.dims = int(dims)

    def _encode(self, texts: list[str]) -> np.ndarray:
        with self._lock:
            vecs = self.model.encode(
                texts,
                batch_size=self.batch_size,
                normalize_embeddings=self.normalize,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        return np.ascontiguousarray(vecs, dtype=np.float32)

    def encode_queries(self, queries: list[str]) -> np.ndarray:
        return self._encode([self.query_prefix + q for q in queries])

    def encode_passages(self, passages: list[str]) -> np.ndarray:
        return self._encode([self.passage_prefix + p for p in passages])


def _num_gpus(faiss: Any) -> int:
    get = getattr(faiss, "get_num_gpus", None)
    return int(get()) if get is not None else 0


def build_faiss(
    embeddings: np.ndarray, kind: FaissKind, nlist: int | None = None, hnsw_m: int = 32, add_chunk: int = 65536
) -> Any:
    """A CPU faiss inner-product index over `embeddings` (float32, shape [n, d])."""
    faiss = require("faiss")
    n, d = embeddings.shape
    if kind == "flat":
        index = faiss.IndexFlatIP(d)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 200
    elif kind == "ivf":
        nlist = nlist or max(1, min(65536, int(4 * math.sqrt(n))))
        if n < nlist:
            raise RetrievalError(f"ivf needs at least nlist={nlist} passages to train, the corpus has {n}: use flat")
        quantizer = faiss.IndexFlatIP(d)
        index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
        rng = np.random.default_rng(0)
        sample = embeddings[np.sort(rng.choice(n, size=min(n, max(nlist * 64, 10000)), replace=False))]
        index.train(np.ascontiguousarray(sample))
    else:
        raise RetrievalError(f"unknown faiss index type {kind!r}; choose flat, ivf or hnsw")
    for start in range(0, n, add_chunk):
        index.add(np.ascontiguousarray(embeddings[start : start + add_chunk]))
    return index


class DenseIndex:
    """A dense retriever over an index directory built by `build_index(kind="dense")`."""

    def __init__(
        self,
        directory: str | Path,
        manifest: IndexManifest | None = None,
        device: str | None = None,
        use_gpu: bool | None = None,
        encoder: Encoder | None = None,
    ) -> None:
        faiss = require("faiss")
        self.directory = Path(directory)
        self.manifest = m = manifest or IndexManifest.read(self.directory)
        if m.kind != "dense":
            raise RetrievalError(f"{self.directory} holds a {m.kind} index, not dense")
        self.docs = DocStore(self.directory)
        self.encoder = encoder or Encoder(
            m.model, device=device, query_prefix=m.query_prefix, passage_prefix=m.passage_prefix, normalize=m.normalize
        )
        if m.dims is not None and self.encoder.dims != m.dims:
            raise RetrievalError(
                f"{self.directory}: index has {m.dims} dims, model {m.model} gives {self.encoder.dims}"
            )
        index = faiss.read_index(str(self.directory / FAISS_NAME))
        if index.ntotal != len(self.docs):
            raise RetrievalError(f"{self.directory}: faiss holds {index.ntotal} vectors, store has {len(self.docs)}")
        if m.faiss == "ivf" and m.nprobe:
            index.nprobe = m.nprobe
        if m.faiss == "hnsw" and m.ef_search:
            index.hnsw.efSearch = m.ef_search
        gpus = _num_gpus(faiss)
        if use_gpu and gpus == 0:
            raise RetrievalError("use_gpu=True but faiss sees no GPU (install faiss-gpu-cu12 on a CUDA machine)")
        self.on_gpu = bool(gpus and (use_gpu is None or use_gpu) and m.faiss in ("flat", "ivf"))
        if self.on_gpu:
            index = faiss.index_cpu_to_all_gpus(index)
        self.index: Any = index

    def __len__(self) -> int:
        return len(self.docs)

    def search_vectors(self, vectors: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray]:
        """Raw faiss search: (scores [n, k], ids [n, k]); -1 ids mark missing results."""
        k = min(topk, len(self.docs))
        return self.index.search(np.ascontiguousarray(vectors, dtype=np.float32), k)

    def search_batch(self, queries: list[str], topk: int) -> list[list[Hit]]:
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        if not queries:
            return []
        scores, ids = self.search_vectors(self.encoder.encode_queries(queries), topk)
        out: list[list[Hit]] = []
        for row_s, row_i in zip(scores, ids, strict=True):
            pairs = sorted(
                ((float(s), int(i)) for s, i in zip(row_s, row_i, strict=True) if i >= 0), key=lambda p: (-p[0], p[1])
            )
            out.append([Hit(self.docs[i], s) for s, i in pairs])
        return out

    def close(self) -> None:
        self.docs.close()


def embed_corpus(
    encoder: Encoder, texts: Iterable[str], count: int, out_path: Path, chunk: int = 4096, show_progress: bool = True
) -> np.ndarray:
    """Embed `count` passages into a float32 .npy memmap at `out_path`, with a progress bar."""
    tqdm = require("tqdm").tqdm
    arr = np.lib.format.open_memmap(out_path, mode="w+", dtype=np.float32, shape=(count, encoder.dims))
    pos = 0
    buf: list[str] = []
    with tqdm(total=count, desc="embedding passages", unit="doc", disable=not show_progress) as bar:
        for text in texts:
            buf.append(text)
            if len(buf) == chunk:
                arr[pos : pos + len(buf)] = encoder.encode_passages(buf)
                pos += len(buf)
                bar.update(len(buf))
                buf = []
        if buf:
            arr[pos : pos + len(buf)] = encoder.encode_passages(buf)
            pos += len(buf)
            bar.update(len(buf))
    if pos != count:
        raise RetrievalError(f"expected {count} passages, embedded {pos}")
    arr.flush()
    return arr
