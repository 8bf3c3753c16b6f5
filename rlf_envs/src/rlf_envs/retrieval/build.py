"""Build an index directory from a corpus (resumably, atomically) and load it back as a Retriever.

A build works in `.{out}.partial/` next to `out`: `state.json` (the build's parameters, the corpus'
identity and the finished stages), `index/` (the future index directory) and work files (the
embeddings memmap, BM25 chunk files). Each stage records itself when done, and dense embedding records
its progress after every chunk, so re-running the same build after a crash (or SIGKILL) resumes where it
stopped. A re-run with other parameters or a changed corpus refuses until `restart=True` (`--restart`)
or `overwrite=True`. At the end `index/` is renamed into place: `out` is absent, the old index or the
complete new one, never half-written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rlf_envs.retrieval._deps import DEFAULT_MODEL, require, require_bm25s
from rlf_envs.retrieval.bm25 import BM25Index, build_bm25
from rlf_envs.retrieval.corpus import DocStore, iter_corpus, write_docstore
from rlf_envs.retrieval.dense import (
    E5_PASSAGE_PREFIX,
    E5_QUERY_PREFIX,
    FAISS_NAME,
    DenseIndex,
    Encoder,
    build_faiss,
    default_nlist,
    default_pq_m,
    embed_corpus,
    recall_at_k,
    set_search_params,
)
from rlf_envs.retrieval.types import HNSW_KINDS, IVF_KINDS, FaissKind, IndexKind, IndexManifest, RetrievalError

log = logging.getLogger("rlf.retrieval.build")

EMBEDDINGS_NAME = "embeddings.npy"
STATE_NAME = "state.json"
LOCK_NAME = ".lock"
STATE_VERSION = 1
_HEAD_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class BuildParams:
    """Everything that changes the bytes of the index; a partial build resumes only under equal params."""

    kind: IndexKind
    model: str | None = None
    faiss_kind: FaissKind = "flat"
    query_prefix: str = ""
    passage_prefix: str = ""
    nlist: int | None = None
    nprobe: int = 32
    hnsw_m: int = 32
    ef_construction: int = 200
    ef_search: int = 128
    pq_m: int | None = None
    pq_nbits: int = 8
    device: str | None = None
    fp16: bool = False
    batch_size: int = 128
    embed_chunk: int = 16384  # passages per encoder call and per resume checkpoint
    recall_k: int = 10
    recall_sample: int = 200
    recall_queries: str | None = None  # a JSONL of {"question"} lines; None: a sample of passages
    embeddings: str | None = None  # a .npy [count, dims] from an earlier build (--keep-embeddings): not re-encoded


@dataclass(frozen=True, slots=True)
class CorpusIdentity:
    """Which corpus a partial build read: path, size, mtime and a hash of its first MiB."""

    path: str
    size: int
    mtime_ns: int
    head_sha256: str

    @classmethod
    def of(cls, path: Path) -> CorpusIdentity:
        if not path.is_file():
            raise RetrievalError(f"corpus file {path} does not exist")
        st = path.stat()
        with path.open("rb") as f:
            head = hashlib.sha256(f.read(_HEAD_BYTES)).hexdigest()
        return cls(str(path.resolve()), st.st_size, st.st_mtime_ns, head)


@dataclass(slots=True)
class BuildState:
    """`state.json` of a partial build: what it builds, from what, and how far it got."""

    params: BuildParams
    corpus: CorpusIdentity
    done: list[str] = field(default_factory=list)  # finished stages, in order
    count: int = 0  # documents in the store (after the docstore stage)
    embedded: int = 0  # dense: passages embedded and flushed to the memmap
    results: dict[str, Any] = field(default_factory=dict)  # stage outputs (dims, recall)

    def save(self, work: Path) -> None:
        raw = {"version": STATE_VERSION, **asdict(self)}
        tmp = work / f"{STATE_NAME}.tmp"
        with tmp.open("w") as f:
            json.dump(raw, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, work / STATE_NAME)

    @classmethod
    def load(cls, work: Path) -> BuildState | None:
        """The saved state, or None when there is none or it is unreadable (then the partial build restarts)."""
        try:
            raw = json.loads((work / STATE_NAME).read_text())
            if raw.pop("version") != STATE_VERSION:
                return None
            raw["params"] = BuildParams(**raw["params"])
            raw["corpus"] = CorpusIdentity(**raw["corpus"])
            return cls(**raw)
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def differences(self, params: BuildParams, corpus: CorpusIdentity) -> list[str]:
        """Human-readable differences to a new build request (empty: it may resume)."""
        diffs = [
            f"{f.name}: {getattr(self.params, f.name)!r} -> {getattr(params, f.name)!r}"
            for f in dataclasses.fields(params)
            if getattr(self.params, f.name) != getattr(params, f.name)
        ]
        if self.corpus != corpus:
            diffs.append(f"the corpus changed ({self.corpus.path}, {self.corpus.size} bytes -> {corpus.size} bytes)")
        return diffs


def work_dir_for(out: Path) -> Path:
    """The deterministic partial-build directory of `out` (a hidden sibling)."""
    return out.parent / f".{out.name}.partial"


@contextlib.contextmanager
def _locked(work: Path) -> Iterator[None]:
    """Exclusive use of a partial build directory (two builds of one `out` would corrupt it)."""
    with (work / LOCK_NAME).open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise RetrievalError(f"another build is writing {work}; wait for it or stop it") from e
        yield


def build_index(
    corpus_path: str | Path,
    out_dir: str | Path,
    kind: IndexKind = "dense",
    *,
    model: str | None = None,
    faiss_kind: FaissKind = "flat",
    e5: bool = False,
    query_prefix: str | None = None,
    passage_prefix: str | None = None,
    nlist: int | None = None,
    nprobe: int = 32,
    hnsw_m: int = 32,
    ef_construction: int = 200,
    ef_search: int = 128,
    pq_m: int | None = None,
    pq_nbits: int = 8,
    device: str | None = None,
    fp16: bool = False,
    batch_size: int = 128,
    embed_chunk: int = 16384,
    recall_k: int = 10,
    recall_sample: int = 200,
    recall_queries: str | Path | None = None,
    embeddings: str | Path | None = None,
    keep_embeddings: bool = False,
    overwrite: bool = False,
    restart: bool = False,
    show_progress: bool = True,
) -> IndexManifest:
    """Build a `kind` index of `corpus_path` into `out_dir`, resuming an interrupted build of the same.

    `e5=True` sets the "query: " / "passage: " prefixes e5 models expect. Dense builds measure the
    recall@`recall_k` of the chosen faiss kind against exact search on `recall_sample` queries (lines of
    the `recall_queries` JSONL, or passages' text) and record it in the manifest. `embeddings` reuses the
    passage vectors an earlier build of the same corpus and model kept (`keep_embeddings=True`), e.g. to
    build several faiss kinds from one encoding pass.
    """
    if kind not in ("dense", "bm25"):
        raise RetrievalError(f"kind must be 'dense' or 'bm25', got {kind!r}")
    for name, value in (("embed_chunk", embed_chunk), ("batch_size", batch_size), ("recall_k", recall_k)):
        if value < 1:
            raise RetrievalError(f"{name} must be >= 1, got {value}")
    # the packages the build needs, before anything is written: a missing one must not leave a partial build
    # behind (a later call would "resume" it)
    for module in ("bm25s",) if kind == "bm25" else ("faiss", "sentence_transformers"):
        require_bm25s() if module == "bm25s" else require(module)
    corpus = Path(corpus_path)
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise RetrievalError(f"{out} already exists; pass overwrite=True (--overwrite) to replace it")
    if kind == "dense":
        qp = query_prefix if query_prefix is not None else (E5_QUERY_PREFIX if e5 else "")
        pp = passage_prefix if passage_prefix is not None else (E5_PASSAGE_PREFIX if e5 else "")
        params = BuildParams(
            kind, model, faiss_kind, qp, pp, nlist, nprobe, hnsw_m, ef_construction, ef_search, pq_m, pq_nbits,
            device, fp16, batch_size, embed_chunk, recall_k, recall_sample,
            None if recall_queries is None else str(Path(recall_queries).resolve()),
            None if embeddings is None else str(Path(embeddings).resolve()),
        )
    else:
        params = BuildParams(kind)
    identity = CorpusIdentity.of(corpus)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = work_dir_for(out)
    work.mkdir(exist_ok=True)
    with _locked(work):
        state = _resume_or_start(work, params, identity, restart=restart, overwrite=overwrite)
        resumed = bool(state.done)
        try:
            manifest = _run_stages(state, work, corpus, show_progress)
            index_dir = work / "index"
            if keep_embeddings and kind == "dense" and embeddings is None:
                os.replace(work / EMBEDDINGS_NAME, index_dir / EMBEDDINGS_NAME)
            manifest.write(index_dir)
            _swap_into_place(index_dir, out)
        except BaseException:
            # keep the progress of a build that got somewhere (SIGINT, a full disk, ...) for a re-run
            if not resumed and not state.done:
                _clear(work)
            raise
        _clear(work)
    return manifest


def _resume_or_start(
    work: Path, params: BuildParams, identity: CorpusIdentity, *, restart: bool, overwrite: bool
) -> BuildState:
    """The state to continue from: the saved one when it matches, else a fresh one in an emptied `work`."""
    state = BuildState.load(work)
    if state is not None and not restart:
        diffs = state.differences(params, identity)
        if diffs and not overwrite:
            raise RetrievalError(
                f"{work} holds an interrupted build with other parameters or another corpus ("
                + "; ".join(diffs)
                + "): pass the same options to resume it, or --restart (restart=True) to discard it"
            )
        if not diffs and (work / "index").is_dir():
            log.warning("resuming the build in %s (finished stages: %s)", work, ", ".join(state.done) or "none")
            return state
    _clear(work, keep=True)
    (work / "index").mkdir()
    state = BuildState(params, identity)
    state.save(work)
    return state


def _clear(work: Path, keep: bool = False) -> None:
    """Delete a partial build's files (and, unless `keep`, the directory itself)."""
    for child in work.iterdir():
        if child.name == LOCK_NAME:
            continue
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
    if not keep:
        shutil.rmtree(work, ignore_errors=True)


def _run_stages(state: BuildState, work: Path, corpus: Path, show_progress: bool) -> IndexManifest:
    """Run the stages `state` has not finished yet and return the index's manifest."""
    p = state.params
    index_dir = work / "index"
    if "docstore" not in state.done:
        state.count = write_docstore(iter_corpus(corpus), index_dir)
        if state.count == 0:
            raise RetrievalError(f"corpus {corpus} holds no documents")
        _finish(state, work, "docstore")
    store = DocStore(index_dir)
    try:
        if p.kind == "bm25":
            if "bm25" not in state.done:
                build_bm25(store, index_dir, work_dir=work / "bm25", show_progress=show_progress)
                _finish(state, work, "bm25")
            return IndexManifest(kind="bm25", count=state.count, corpus=str(corpus))
        return _dense_stages(state, work, store, corpus, show_progress)
    finally:
        store.close()


def _finish(state: BuildState, work: Path, stage: str) -> None:
    state.done.append(stage)
    state.save(work)


def _dense_stages(state: BuildState, work: Path, store: DocStore, corpus: Path, show_progress: bool) -> IndexManifest:
    p = state.params
    encoder = Encoder(
        p.model, device=p.device, query_prefix=p.query_prefix, passage_prefix=p.passage_prefix,
        batch_size=p.batch_size, fp16=p.fp16,
    )
    emb_path = work / EMBEDDINGS_NAME if p.embeddings is None else Path(p.embeddings)
    n = state.count
    if p.embeddings is not None:
        shape = np.load(emb_path, mmap_mode="r").shape if emb_path.is_file() else None
        if shape != (n, encoder.dims):
            raise RetrievalError(
                f"--embeddings {emb_path} has shape {shape}, the corpus and model need {(n, encoder.dims)}: pass the "
                "embeddings.npy a --keep-embeddings build of this corpus with this model left"
            )
    elif "embed" not in state.done:
        if state.embedded and emb_path.is_file():
            emb = np.load(emb_path, mmap_mode="r+")
            if emb.shape != (n, encoder.dims):
                raise RetrievalError(f"{emb_path} has shape {emb.shape}, expected {(n, encoder.dims)}: pass --restart")
            log.warning("resuming dense embedding at passage %d of %d", state.embedded, n)
        else:
            state.embedded = 0
            emb = np.lib.format.open_memmap(emb_path, mode="w+", dtype=np.float32, shape=(n, encoder.dims))

        spent, t0 = float(state.results.get("embed_s", 0.0)), time.perf_counter()

        def checkpoint(done: int) -> None:
            state.embedded = done
            state.results["embed_s"] = spent + time.perf_counter() - t0  # summed over resumed runs
            state.save(work)

        texts = (d.contents for d in store.iter_from(state.embedded))
        embed_corpus(encoder, texts, emb, state.embedded, p.embed_chunk, checkpoint, show_progress)
        del emb
        _finish(state, work, "embed")
    emb = np.load(emb_path, mmap_mode="r")
    faiss = require("faiss")
    index_path = work / "index" / FAISS_NAME
    nlist = (p.nlist or default_nlist(n)) if p.faiss_kind in IVF_KINDS else None
    pq_m = (p.pq_m or default_pq_m(encoder.dims)) if p.faiss_kind == "ivfpq" else None
    manifest = IndexManifest(
        kind="dense",
        count=n,
        model=p.model or DEFAULT_MODEL,
        dims=encoder.dims,
        faiss=p.faiss_kind,
        nprobe=p.nprobe if nlist else None,
        ef_search=p.ef_search if p.faiss_kind in HNSW_KINDS else None,
        nlist=nlist,
        hnsw_m=p.hnsw_m if p.faiss_kind in HNSW_KINDS else None,
        pq_m=pq_m,
        pq_nbits=p.pq_nbits if pq_m else None,
        query_prefix=p.query_prefix,
        passage_prefix=p.passage_prefix,
        normalize=encoder.normalize,
        corpus=str(corpus),
    )
    if "faiss" not in state.done:
        index = build_faiss(
            emb, p.faiss_kind, nlist=nlist, hnsw_m=p.hnsw_m, pq_m=pq_m, pq_nbits=p.pq_nbits,
            ef_construction=p.ef_construction,
        )
        faiss.write_index(index, str(index_path))
        _finish(state, work, "faiss")
    else:
        index = faiss.read_index(str(index_path))
    if "recall" not in state.done:
        set_search_params(index, manifest)
        queries = encoder.encode_queries(_recall_queries(p, store))
        state.results["recall"] = recall_at_k(index, emb, queries, p.recall_k)
        state.results["recall_queries"] = len(queries)
        _finish(state, work, "recall")
    if "embed_s" in state.results:
        manifest.extra["embed_seconds"] = f"{state.results['embed_s']:.1f}"
    manifest.recall = state.results["recall"]
    manifest.recall_k = p.recall_k
    manifest.recall_queries = state.results["recall_queries"]
    return manifest


def _recall_queries(p: BuildParams, store: DocStore) -> list[str]:
    """The questions recall is measured on: the first `recall_sample` of a JSONL file (field "question",
    "query" or "contents"), or the first 32 words of `recall_sample` passages sampled with seed 0."""
    if p.recall_queries is not None:
        path = Path(p.recall_queries)
        out: list[str] = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if len(out) >= p.recall_sample:
                    break
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise RetrievalError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
                text = next((row[k] for k in ("question", "query", "contents") if isinstance(row.get(k), str)), None)
                if text is None:
                    raise RetrievalError(f"{path}:{lineno}: needs a string 'question' (or 'query'/'contents')")
                out.append(text)
        if not out:
            raise RetrievalError(f"--recall-queries {path} holds no questions")
        return out
    n = len(store)
    rows = np.sort(np.random.default_rng(0).choice(n, size=min(n, p.recall_sample), replace=False))
    docs = (store[int(i)] for i in rows)
    return [" ".join((d.text or d.contents).split()[:32]) for d in docs]


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`, replacing an existing `out` with only a brief window of absence."""
    if not out.exists():
        tmp.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def load_index(
    directory: str | Path, *, device: str | None = None, use_gpu: bool | None = None, mmap: bool = True
) -> DenseIndex | BM25Index:
    """Open an index directory as a Retriever (its kind comes from the manifest); dense faiss files are
    memory-mapped unless `mmap=False`."""
    d = Path(directory)
    manifest = IndexManifest.read(d)
    if manifest.kind == "bm25":
        return BM25Index(d, manifest)
    return DenseIndex(d, manifest, device=device, use_gpu=use_gpu, mmap=mmap)
