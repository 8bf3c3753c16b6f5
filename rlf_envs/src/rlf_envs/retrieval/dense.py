"""Dense retrieval: a sentence-transformers encoder plus a faiss inner-product index.

faiss index types: `flat` (exact, the default), `ivf` (IVF-Flat), `ivfpq` (IVF with product-quantized
codes: `pq_m` bytes per vector, the smallest kind for tens of millions of passages), `ivfsq` (IVF over 8-bit
scalar-quantized vectors: 4x smaller than flat, far better recall than PQ at 1M), `hnsw` (graph over
full vectors, no training) and `hnswsq` (graph over 8-bit scalar-quantized vectors, 4x smaller). Vectors
stream from a .npy memmap: training uses a bounded sample, adding goes chunk by chunk. At load time the
index file is memory-mapped (faiss >= 1.10 `IO_FLAG_MMAP_IFC`: flat codes, HNSW storage and IVF lists);
when faiss was built with GPUs (faiss-gpu-cu12) and one is visible, flat and IVF kinds go to the GPU(s).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from rlf_envs.retrieval._deps import DEFAULT_MODEL, offline_env, require, resolve_model_dir
from rlf_envs.retrieval.corpus import DocStore
from rlf_envs.retrieval.types import HNSW_KINDS, IVF_KINDS, FaissKind, Hit, IndexManifest, RetrievalError

log = logging.getLogger("rlf.retrieval.dense")

FAISS_NAME = "index.faiss"
E5_QUERY_PREFIX = "query: "
E5_PASSAGE_PREFIX = "passage: "


_MODELS: dict[tuple[str, str, bool], tuple[Any, threading.Lock]] = {}
_MODELS_LOCK = threading.Lock()


def _load_model(st: Any, path: Path, device: str, fp16: bool) -> tuple[Any, threading.Lock]:
    """One loaded model per (directory, device, fp16) per process, with the lock that serialises its use."""
    key = (str(path), device, fp16)
    with _MODELS_LOCK:
        if key not in _MODELS:
            try:
                model = st.SentenceTransformer(str(path), device=device, local_files_only=True)
            except Exception as e:
                raise RetrievalError(f"could not load a sentence-transformers model from {path}: {e}") from e
            if fp16:
                model.half()
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
        fp16: bool = False,
    ) -> None:
        offline_env()
        path = resolve_model_dir(model)
        st = require("sentence_transformers")
        if device is None:
            torch = require("torch")
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if fp16 and not device.startswith("cuda"):
            raise RetrievalError(f"fp16 encoding needs a CUDA device, got device={device!r}: drop --fp16")
        self.model, self._lock = _load_model(st, path, device, fp16)
        self.device = device
        self.fp16 = fp16
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


#: at most this many vectors train an IVF / PQ / SQ index (a bounded sample of the memmap: ~770 MB at 384 dims)
MAX_TRAIN = 500_000
GPU_KINDS = ("flat", "ivf", "ivfpq", "ivfsq")  # kinds faiss can move to a GPU (HNSW has no GPU version)


def default_nlist(n: int) -> int:
    """4 * sqrt(n) inverted lists (1M passages: 4000), at most 65536."""
    return max(1, min(65536, int(4 * math.sqrt(n))))


def default_pq_m(dims: int) -> int:
    """dims / 8 bytes per vector (384 dims: 48 B, 32x smaller than float32), rounded to a divisor of dims."""
    m = max(1, dims // 8)
    while dims % m:
        m -= 1
    return m


def build_faiss(
    embeddings: np.ndarray,
    kind: FaissKind,
    nlist: int | None = None,
    hnsw_m: int = 32,
    add_chunk: int = 65536,
    *,
    pq_m: int | None = None,
    pq_nbits: int = 8,
    ef_construction: int = 200,
    max_train: int = MAX_TRAIN,
) -> Any:
    """A CPU faiss inner-product index over `embeddings` (float32 [n, d]; a .npy memmap is never read whole).

    Trainable kinds train on at most `max_train` rows sampled evenly at random (seed 0); vectors are
    added `add_chunk` rows at a time.
    """
    faiss = require("faiss")
    n, d = embeddings.shape
    metric = faiss.METRIC_INNER_PRODUCT
    if kind == "flat":
        index = faiss.IndexFlatIP(d)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, hnsw_m, metric)
    elif kind == "hnswsq":
        index = faiss.IndexHNSWSQ(d, faiss.ScalarQuantizer.QT_8bit, hnsw_m, metric)
    elif kind in IVF_KINDS:
        nlist = nlist or default_nlist(n)
        if n < nlist:
            raise RetrievalError(f"{kind} needs at least nlist={nlist} passages to train, the corpus has {n}: use flat")
        quantizer = faiss.IndexFlatIP(d)
        if kind == "ivf":
            index = faiss.IndexIVFFlat(quantizer, d, nlist, metric)
        elif kind == "ivfsq":
            index = faiss.IndexIVFScalarQuantizer(quantizer, d, nlist, faiss.ScalarQuantizer.QT_8bit, metric)
        else:
            m = pq_m or default_pq_m(d)
            if d % m:
                raise RetrievalError(f"--pq-m {m} must divide the embedding size {d}")
            if not 1 <= pq_nbits <= 16:
                raise RetrievalError(f"--pq-nbits must be in 1..16, got {pq_nbits}")
            if n < 2**pq_nbits:
                raise RetrievalError(
                    f"ivfpq with pq_nbits={pq_nbits} needs at least {2**pq_nbits} passages to train, the corpus has "
                    f"{n}: lower --pq-nbits or use flat"
                )
            index = faiss.IndexIVFPQ(quantizer, d, nlist, m, pq_nbits, metric)
    else:
        raise RetrievalError(f"unknown faiss index type {kind!r}; choose flat, ivf, ivfpq, ivfsq, hnsw or hnswsq")
    if kind in HNSW_KINDS:
        index.hnsw.efConstruction = ef_construction
    if not index.is_trained:
        floor = 10_000 if nlist is None else max(10_000, 64 * nlist)
        size = min(n, floor, max_train)
        rows = np.sort(np.random.default_rng(0).choice(n, size=size, replace=False))
        index.train(np.ascontiguousarray(embeddings[rows], dtype=np.float32))
    for start in range(0, n, add_chunk):
        index.add(np.ascontiguousarray(embeddings[start : start + add_chunk], dtype=np.float32))
    return index


def set_search_params(index: Any, manifest: IndexManifest) -> None:
    """Apply the manifest's query-time knobs (nprobe, efSearch) to a loaded CPU index."""
    if manifest.faiss in IVF_KINDS and manifest.nprobe:
        index.nprobe = manifest.nprobe
    if manifest.faiss in HNSW_KINDS and manifest.ef_search:
        index.hnsw.efSearch = manifest.ef_search


def read_faiss(path: Path, mmap: bool = True) -> Any:
    """Read an index file; with `mmap`, its vectors/codes stay in the page cache instead of private RAM.

    faiss >= 1.10 maps flat codes, HNSW storage and IVF lists with `IO_FLAG_MMAP_IFC` (the HNSW graph
    itself is still read into memory); older faiss maps only IVF lists (`IO_FLAG_MMAP`).
    """
    faiss = require("faiss")
    flags = 0
    if mmap:
        flags = getattr(faiss, "IO_FLAG_MMAP_IFC", None) or faiss.IO_FLAG_MMAP
        flags |= faiss.IO_FLAG_READ_ONLY
    try:
        return faiss.read_index(str(path), flags)
    except RuntimeError as e:
        raise RetrievalError(f"could not read the faiss index {path}: {e}") from e


class DenseIndex:
    """A dense retriever over an index directory built by `build_index(kind="dense")`."""

    def __init__(
        self,
        directory: str | Path,
        manifest: IndexManifest | None = None,
        device: str | None = None,
        use_gpu: bool | None = None,
        encoder: Encoder | None = None,
        mmap: bool = True,
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
        gpus = _num_gpus(faiss)
        if use_gpu and gpus == 0:
            raise RetrievalError("use_gpu=True but faiss sees no GPU (install faiss-gpu-cu12 on a CUDA machine)")
        if use_gpu and m.faiss not in GPU_KINDS:
            raise RetrievalError(f"faiss has no GPU version of {m.faiss!r} indexes: serve with --no-gpu")
        self.on_gpu = bool(gpus and (use_gpu is None or use_gpu) and m.faiss in GPU_KINDS)
        # a GPU copy lives in GPU memory; mapping the file would only add page cache
        index = read_faiss(self.directory / FAISS_NAME, mmap=mmap and not self.on_gpu)
        if index.ntotal != len(self.docs):
            raise RetrievalError(f"{self.directory}: faiss holds {index.ntotal} vectors, store has {len(self.docs)}")
        set_search_params(index, m)
        if self.on_gpu:
            co = faiss.GpuMultipleClonerOptions()
            co.useFloat16 = m.faiss == "ivfpq"  # IVF-PQ lookup tables in fp16: needed for large pq_m
            index = faiss.index_cpu_to_all_gpus(index, co)
            if m.faiss in IVF_KINDS and m.nprobe:
                faiss.GpuParameterSpace().set_index_parameter(index, "nprobe", m.nprobe)
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
    encoder: Encoder,
    texts: Iterator[str],
    out: np.ndarray,
    start: int = 0,
    chunk: int = 4096,
    on_chunk: Callable[[int], None] | None = None,
    show_progress: bool = True,
) -> None:
    """Embed passages `start`, `start + 1`, ... (`texts` yields them from `start` on) into rows of the
    memmap `out`, `chunk` passages per encoder call. After each chunk the rows are flushed to disk and
    `on_chunk(rows_done)` records the progress, so a killed build resumes at the last finished chunk.
    Chunks are aligned to multiples of `chunk`, so a resumed build encodes exactly the batches an
    uninterrupted one would (sentence-transformers sorts each call's texts by length into batches)."""
    tqdm = require("tqdm").tqdm
    count = out.shape[0]
    pos = start
    with tqdm(total=count, initial=start, desc="embedding passages", unit="doc", disable=not show_progress) as bar:
        while pos < count:
            buf = [t for _, t in zip(range(min(chunk, count - pos)), texts, strict=False)]
            if not buf:
                break
            out[pos : pos + len(buf)] = encoder.encode_passages(buf)
            pos += len(buf)
            if isinstance(out, np.memmap):
                out.flush()
            if on_chunk is not None:
                on_chunk(pos)
            bar.update(len(buf))
    if pos != count:
        raise RetrievalError(f"expected {count} passages, embedded {pos}")


def exact_topk(embeddings: np.ndarray, queries: np.ndarray, k: int, chunk: int = 65536) -> np.ndarray:
    """Ids [q, k] of the k largest inner products per query, best first, scanning `embeddings` (a memmap)
    chunk by chunk: memory is one chunk of vectors and scores, never the whole matrix."""
    n = embeddings.shape[0]
    k = min(k, n)
    best_s = np.empty((len(queries), 0), dtype=np.float32)
    best_i = np.empty((len(queries), 0), dtype=np.int64)
    for start in range(0, n, chunk):
        s = queries @ np.asarray(embeddings[start : start + chunk], dtype=np.float32).T
        kk = min(k, s.shape[1])
        part = np.argpartition(-s, kk - 1, axis=1)[:, :kk]  # this chunk's k best, unordered
        best_s = np.concatenate([best_s, np.take_along_axis(s, part, axis=1)], axis=1)
        best_i = np.concatenate([best_i, part + start], axis=1)
        keep = np.argsort(-best_s, axis=1, kind="stable")[:, :k]
        best_s = np.take_along_axis(best_s, keep, axis=1)
        best_i = np.take_along_axis(best_i, keep, axis=1)
    return best_i


def recall_at_k(index: Any, embeddings: np.ndarray, queries: np.ndarray, k: int) -> float:
    """Mean fraction of the exact top-k (brute force over `embeddings`) that `index` also returns in its top-k."""
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    exact = exact_topk(embeddings, queries, k)
    _, approx = index.search(queries, exact.shape[1])
    hits = [len(set(a.tolist()) & set(e.tolist())) / len(e) for a, e in zip(approx, exact, strict=True)]
    return float(np.mean(hits)) if hits else 1.0
