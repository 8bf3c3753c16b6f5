"""CLI: `rlf-retrieval build|serve ...` (installed), or `python -m servers.retrieval build|serve ...` in the repo."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from rlf_envs.retrieval import RetrievalError, build_index
from rlf_envs.retrieval._deps import set_threads
from rlf_envs.retrieval.types import FAISS_KINDS
from rlf_envs.runtime import new_event_loop

from .app import SEND_AT


def _parser() -> argparse.ArgumentParser:
    prog = "python -m servers.retrieval" if __package__ == "servers.retrieval" else "rlf-retrieval"
    ap = argparse.ArgumentParser(prog=prog, description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument(
        "-v", "--verbose", action="store_true",
        help="progress bars and INFO logs of rlf and the libraries (bm25s, faiss, sentence-transformers)",
    )

    b = sub.add_parser("build", parents=[verbose], help="build an index directory from a wiki-18-style JSONL corpus")
    b.add_argument("--corpus", type=Path, required=True, help='JSONL, one {"id", "contents": "\\"Title\\"\\ntext"}')
    b.add_argument("--out", type=Path, required=True, help="index directory to create (written atomically)")
    b.add_argument("--kind", choices=("dense", "bm25"), default="dense")
    b.add_argument("--model", default=None, help="local sentence-transformers dir (default: bundled MiniLM)")
    b.add_argument("--e5", action="store_true", help='e5 models: prefix "query: " / "passage: "')
    b.add_argument("--faiss", choices=FAISS_KINDS, default="flat",
                   help="faiss index (dense): flat (exact), ivf, ivfpq (smallest), ivfsq (IVF over 8-bit vectors), "
                   "hnsw, hnswsq (8-bit HNSW)")
    b.add_argument("--nlist", type=int, default=None, help="ivf/ivfpq/ivfsq: number of lists (default 4*sqrt(n))")
    b.add_argument("--nprobe", type=int, default=32, help="ivf/ivfpq/ivfsq: lists probed per query")
    b.add_argument("--pq-m", type=int, default=None, help="ivfpq: bytes per vector (default dims/8; divides dims)")
    b.add_argument("--pq-nbits", type=int, default=8, help="ivfpq: bits per sub-quantizer code")
    b.add_argument("--hnsw-m", type=int, default=32, help="hnsw/hnswsq: graph links per node")
    b.add_argument("--ef-construction", type=int, default=200, help="hnsw/hnswsq: efConstruction")
    b.add_argument("--ef-search", type=int, default=128, help="hnsw/hnswsq: efSearch")
    b.add_argument("--batch-size", type=int, default=128, help="encoder batch size")
    b.add_argument("--device", default=None, help="encoder device (default: cuda if available, else cpu)")
    b.add_argument("--fp16", action="store_true", help="encode passages in fp16 (CUDA only)")
    b.add_argument("--embed-chunk", type=int, default=16384,
                   help="passages per encoder call; progress is saved after each (a re-run resumes there)")
    b.add_argument("--recall-k", type=int, default=10, help="dense: measure recall@k of the index vs exact search")
    b.add_argument("--recall-sample", type=int, default=200, help="dense: queries recall is averaged over")
    b.add_argument("--recall-queries", type=Path, default=None,
                   help='dense: JSONL of {"question": ...} to measure recall on (default: passages\' text)')
    b.add_argument("--embeddings", type=Path, default=None,
                   help="dense: reuse the embeddings.npy a --keep-embeddings build of this corpus + model left")
    b.add_argument("--threads", type=int, default=0, help="CPU threads for encoder + faiss (0: library default)")
    b.add_argument("--keep-embeddings", action="store_true", help="keep embeddings.npy in the index dir")
    b.add_argument("--overwrite", action="store_true",
                   help="replace an existing index directory (and an interrupted build with other options)")
    b.add_argument("--restart", action="store_true", help="discard an interrupted build of --out instead of resuming")

    s = sub.add_parser("serve", parents=[verbose], help="serve an index over HTTP (Search-R1's /retrieve API)")
    s.add_argument("--index", type=Path, required=True)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    s.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on start)")
    s.add_argument("--max-queries", type=int, default=512, help="max queries per request")
    s.add_argument("--max-topk", type=int, default=100)
    s.add_argument("--max-body-bytes", type=int, default=1 << 20)
    s.add_argument("--max-query-chars", type=int, default=4096)
    s.add_argument("--header-timeout-s", type=float, default=30.0,
                   help="close a connection that sends no complete request head within this (slow clients)")
    s.add_argument("--body-timeout-s", type=float, default=30.0, help="answer 408 if a body takes longer")
    s.add_argument("--max-batch", type=int, default=512, help="max queries per micro-batch")
    s.add_argument("--max-wait-ms", type=float, default=2.0, help="max wait for a micro-batch to fill")
    s.add_argument("--send-at", type=int, default=SEND_AT,
                   help="a micro-batch of this many queries is searched at once, without the wait (a coalescing "
                   "trainer's request of 32+ queries does not wait for others)")
    s.add_argument("--inline-below-ms", type=float, default=None,
                   help="search a micro-batch on the event loop, not the worker thread, when recent batches say it "
                        "takes less than this; 0: always on the worker thread (default: 50 for BM25, whose search "
                        "holds the GIL so that a thread only adds hops, 0 for dense)")
    s.add_argument("--workers", type=int, default=1,
                   help="server processes on the port (SO_REUSEPORT), each with its own loop, batcher and index; "
                        "for BM25, whose search holds the GIL (one process uses one core)")
    s.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # set for each of --workers N
    s.add_argument("--device", default=None, help="encoder device (default: cuda if available, else cpu)")
    s.add_argument("--threads", type=int, default=0, help="CPU threads for encoder + faiss (0: library default)")
    gpu = s.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", dest="use_gpu", action="store_true", default=None, help="require faiss on GPU")
    gpu.add_argument("--no-gpu", dest="use_gpu", action="store_false", help="keep faiss on CPU")
    return ap


def configure_logging(verbose: bool) -> None:
    """Quiet by default: warnings and errors only (no bm25s/faiss/sentence-transformers INFO or DEBUG lines,
    no progress bars); `--verbose`: INFO from every library, plus progress bars. The level is set on the
    handler, because some libraries set their own logger's level when imported (bm25s: DEBUG)."""
    level = logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
    for handler in logging.getLogger().handlers:
        handler.setLevel(level)
    if not verbose:
        os.environ.setdefault("TQDM_DISABLE", "1")  # bars drawn by libraries we do not pass show_progress to


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    configure_logging(args.verbose)
    try:
        if args.command == "build":
            set_threads(args.threads)
            m = build_index(
                args.corpus,
                args.out,
                args.kind,
                model=args.model,
                faiss_kind=args.faiss,
                e5=args.e5,
                nlist=args.nlist,
                nprobe=args.nprobe,
                pq_m=args.pq_m,
                pq_nbits=args.pq_nbits,
                hnsw_m=args.hnsw_m,
                ef_construction=args.ef_construction,
                ef_search=args.ef_search,
                device=args.device,
                fp16=args.fp16,
                batch_size=args.batch_size,
                embed_chunk=args.embed_chunk,
                recall_k=args.recall_k,
                recall_sample=args.recall_sample,
                recall_queries=args.recall_queries,
                embeddings=args.embeddings,
                keep_embeddings=args.keep_embeddings,
                overwrite=args.overwrite,
                restart=args.restart,
                show_progress=args.verbose,
            )
            print(f"built {m.kind} index of {m.count} documents in {args.out}")
            if m.recall is not None:
                print(f"recall@{m.recall_k} of {m.faiss} vs exact search: {m.recall:.4f} ({m.recall_queries} queries)")
            return 0
        from .app import Limits, serve

        set_threads(args.threads)

        for name in ("max_queries", "max_topk", "max_body_bytes", "max_query_chars", "max_batch", "workers", "send_at"):
            if getattr(args, name) < 1:
                raise RetrievalError(f"--{name.replace('_', '-')} must be >= 1")
        if args.inline_below_ms is not None and not args.inline_below_ms >= 0:
            raise RetrievalError("--inline-below-ms must be >= 0")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(args, name) > 0:
                raise RetrievalError(f"--{name.replace('_', '-')} must be > 0")
        limits = Limits(args.max_queries, args.max_topk, args.max_body_bytes, args.max_query_chars,
                        args.header_timeout_s, args.body_timeout_s)
        if args.workers > 1:
            from .workers import run_workers

            package = __spec__.parent if __spec__ is not None else "servers.retrieval"
            return run_workers(package, argv, args.workers, args.host, args.port, start_timeout_s=600.0,
                               stop_timeout_s=8.0)
        with asyncio.Runner(loop_factory=new_event_loop) as runner:  # uvloop: a cheaper loop per request
            runner.run(serve(
                args.index,
                args.host,
                args.port,
                limits,
                max_batch=args.max_batch,
                max_wait_s=args.max_wait_ms / 1000,
                send_at=args.send_at,
                device=args.device,
                use_gpu=args.use_gpu,
                inline_below_s=None if args.inline_below_ms is None else args.inline_below_ms / 1000,
                reuse_port=args.reuse_port,
                stop_on_stdin_eof=args.reuse_port,  # a worker of `--workers N`: stdin is the parent's pipe
            ))
        return 0
    except RetrievalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
