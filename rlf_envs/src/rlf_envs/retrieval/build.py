"""Build an index directory from a corpus (atomically) and load it back as a Retriever."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from rlf_envs.retrieval._deps import DEFAULT_MODEL, require
from rlf_envs.retrieval.bm25 import BM25Index, build_bm25
from rlf_envs.retrieval.corpus import DocStore, iter_corpus, write_docstore
from rlf_envs.retrieval.dense import (
    E5_PASSAGE_PREFIX,
    E5_QUERY_PREFIX,
    FAISS_NAME,
    DenseIndex,
    Encoder,
    build_faiss,
    embed_corpus,
)
from rlf_envs.retrieval.types import FaissKind, IndexKind, IndexManifest, RetrievalError

EMBEDDINGS_NAME = "embeddings.npy"


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
    ef_search: int = 128,
    device: str | None = None,
    batch_size: int = 128,
    keep_embeddings: bool = False,
    overwrite: bool = False,
    show_progress: bool = True,
) -> IndexManifest:
    """Build a `kind` index of `corpus_path` into `out_dir`.

    Everything is written into a temporary sibling directory first and renamed into place at the
    end, so `out_dir` is either absent, the old index, or the complete new one — never half-written.
    `e5=True` sets the "query: " / "passage: " prefixes e5 models expect.
    """
    if kind not in ("dense", "bm25"):
        raise RetrievalError(f"kind must be 'dense' or 'bm25', got {kind!r}")
    corpus = Path(corpus_path)
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise RetrievalError(f"{out} already exists; pass overwrite=True (--overwrite) to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        count = write_docstore(iter_corpus(corpus), tmp)
        if count == 0:
            raise RetrievalError(f"corpus {corpus} holds no documents")
        store = DocStore(tmp)
        try:
            if kind == "bm25":
                build_bm25(store, tmp, show_progress=show_progress)
                manifest = IndexManifest(kind="bm25", count=count, corpus=str(corpus))
            else:
                qp = query_prefix if query_prefix is not None else (E5_QUERY_PREFIX if e5 else "")
                pp = passage_prefix if passage_prefix is not None else (E5_PASSAGE_PREFIX if e5 else "")
                encoder = Encoder(model, device=device, query_prefix=qp, passage_prefix=pp, batch_size=batch_size)
                emb_path = tmp / EMBEDDINGS_NAME
                emb = embed_corpus(encoder, (d.contents for d in store), count, emb_path, show_progress=show_progress)
                index = build_faiss(emb, faiss_kind, nlist=nlist, hnsw_m=hnsw_m)
                require("faiss").write_index(index, str(tmp / FAISS_NAME))
                del emb
                if not keep_embeddings:
                    emb_path.unlink()
                manifest = IndexManifest(
                    kind="dense",
                    count=count,
                    model=model or DEFAULT_MODEL,
                    dims=encoder.dims,
                    faiss=faiss_kind,
                    nprobe=nprobe if faiss_kind == "ivf" else None,
                    ef_search=ef_search if faiss_kind == "hnsw" else None,
                    query_prefix=qp,
                    passage_prefix=pp,
                    normalize=encoder.normalize,
                    corpus=str(corpus),
                )
        finally:
            store.close()
        manifest.write(tmp)
        _swap_into_place(tmp, out)
        return manifest
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`, replacing an existing `out` with only a brief window of absence."""
    if not out.exists():
        tmp.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def load_index(
    directory: str | Path, *, device: str | None = None, use_gpu: bool | None = None
) -> DenseIndex | BM25Index:
    """Open an index directory as a Retriever (its kind comes from the manifest)."""
    d = Path(directory)
    manifest = IndexManifest.read(d)
    if manifest.kind == "bm25":
        return BM25Index(d, manifest)
    return DenseIndex(d, manifest, device=device, use_gpu=use_gpu)
