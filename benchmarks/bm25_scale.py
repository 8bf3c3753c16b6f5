"""BM25 at wiki scale: streaming build vs bm25s' in-memory build, and memory-mapped serving.

    python -m rlf_envs.data.wiki.generate --passages 1000000 --out wiki-1m.jsonl --queries 2000
    python benchmarks/bm25_scale.py --corpus wiki-1m.jsonl --queries wiki-1m.queries.jsonl \\
        --work /tmp/bm25-scale [--no-old] [--json out/bm25_scale.json]

Each stage runs in its own subprocess so its peak RSS (ru_maxrss) is its own:

- `bm25`: rlf's streaming `build_bm25` (chunked tokenisation into a work dir, term-block merge);
- `old`: the previous in-memory build (`bm25s.tokenize` over a list of all texts, `BM25.index`, save),
  the same-run baseline; its arrays are compared with the streaming build's (must be equal);
- `docstore`: the index's document store (not BM25-specific; every index kind writes it);
- `serve`: load a `BM25Index` memory-mapped (load time, RSS split into anonymous and file-backed), then
  the queries one at a time and in batches of 64 (QPS, p50/p99), against the same index read into
  memory (`mmap=False`) and against bm25s' own `BM25.retrieve`, with the top-10 compared to bm25s'.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "rlf_envs" / "src")]

import numpy as np  # noqa: E402


def _status_kib() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(val.split()[0])
    return out


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _stage_bm25(a: argparse.Namespace) -> dict[str, Any]:
    from rlf_envs.retrieval.bm25_build import build_bm25
    from rlf_envs.retrieval.corpus import iter_corpus

    idx = Path(a.work) / "idx"
    idx.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    stats = build_bm25(iter_corpus(a.corpus), idx, work_dir=Path(a.work) / "bm25-work", show_progress=False)
    return {"seconds": time.perf_counter() - t, "peak_rss_mib": _peak_mib(), "stats": asdict(stats)}


def _stage_old(a: argparse.Namespace) -> dict[str, Any]:
    import bm25s

    from rlf_envs.retrieval.corpus import iter_corpus

    t = time.perf_counter()
    texts = [d.contents for d in iter_corpus(a.corpus)]
    tokens = bm25s.tokenize(texts, stopwords="en", show_progress=False)
    model = bm25s.BM25()
    model.index(tokens, show_progress=False)
    model.save(str(Path(a.work) / "old-bm25"), show_progress=False)
    return {"seconds": time.perf_counter() - t, "peak_rss_mib": _peak_mib()}


def _stage_docstore(a: argparse.Namespace) -> dict[str, Any]:
    from rlf_envs.retrieval.corpus import iter_corpus, write_docstore
    from rlf_envs.retrieval.types import IndexManifest

    idx = Path(a.work) / "idx"
    t = time.perf_counter()
    count = write_docstore(iter_corpus(a.corpus), idx)
    IndexManifest(kind="bm25", count=count, corpus=str(a.corpus)).write(idx)
    return {"seconds": time.perf_counter() - t, "peak_rss_mib": _peak_mib(), "docs": count}


def _latencies(fn: Any, batches: list[list[str]]) -> tuple[float, list[float]]:
    lat = []
    t0 = time.perf_counter()
    for b in batches:
        t = time.perf_counter()
        fn(b)
        lat.append(time.perf_counter() - t)
    return time.perf_counter() - t0, lat


def _summary(n_queries: int, total: float, lat: list[float]) -> dict[str, float]:
    ms = np.asarray(lat) * 1000
    return {
        "qps": n_queries / total,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
    }


def _stage_serve(a: argparse.Namespace) -> dict[str, Any]:
    import bm25s

    from rlf_envs.retrieval.bm25 import BM25Index

    queries = [json.loads(line)["question"] for line in Path(a.queries).read_text().splitlines() if line.strip()]
    single = [[q] for q in queries]
    batched = [queries[i : i + 64] for i in range(0, len(queries), 64)]
    before = _status_kib()
    t = time.perf_counter()
    index = BM25Index(Path(a.work) / "idx")
    out: dict[str, Any] = {"load_seconds": time.perf_counter() - t, "queries": len(queries)}
    loaded = _status_kib()
    out["rss_after_load_mib"] = {k: v / 1024 for k, v in loaded.items()}
    out["rss_load_delta_mib"] = (loaded["VmRSS"] - before["VmRSS"]) / 1024
    k = 10
    total, lat = _latencies(lambda b: index.search_batch(b, k), single)
    out["mmap_single_cold"] = _summary(len(queries), total, lat)  # first touch of the maps, empty doc cache
    total, lat = _latencies(lambda b: index.search_batch(b, k), single)
    out["mmap_single"] = _summary(len(queries), total, lat)
    total, lat = _latencies(lambda b: index.search_batch(b, k), batched)
    out["mmap_batch64"] = {**_summary(len(queries), total, lat), "note": "p50/p99 per batch of 64"}
    out["rss_after_queries_mib"] = {k2: v / 1024 for k2, v in _status_kib().items()}
    ours = index.search_batch(queries, k)
    index.close()

    t = time.perf_counter()
    ram = BM25Index(Path(a.work) / "idx", mmap=False)
    out["ram_load_seconds"] = time.perf_counter() - t
    total, lat = _latencies(lambda b: ram.search_batch(b, k), single)
    out["ram_single_cold"] = _summary(len(queries), total, lat)  # same passes as mmap: hit-doc cache warms
    total, lat = _latencies(lambda b: ram.search_batch(b, k), single)
    out["ram_single"] = _summary(len(queries), total, lat)
    total, lat = _latencies(lambda b: ram.search_batch(b, k), batched)
    out["ram_batch64"] = _summary(len(queries), total, lat)
    assert ram.search_batch(queries, k) == ours, "mmap and in-memory results differ"
    ram.close()

    model = bm25s.BM25.load(str(Path(a.work) / "idx" / "bm25"), mmap=False)
    toks = [bm25s.tokenize([q], stopwords="en", return_ids=False, show_progress=False)[0] for q in queries]
    toks = [[w for w in tk if w in model.vocab_dict] for tk in toks]
    searchable = [tk for tk in toks if tk][:500]  # ~70 ms each at 1M: a sample is enough for its QPS
    total, lat = _latencies(
        lambda b: model.retrieve(b, k=k, show_progress=False, n_threads=1), [[tk] for tk in searchable]
    )
    out["bm25s_retrieve_single"] = {**_summary(len(searchable), total, lat), "sample": len(searchable)}
    same = ties = 0
    for tk, hits in zip(toks, ours, strict=True):
        if not tk:
            continue
        docs, scores = model.retrieve([tk], k=k + 1, show_progress=False, n_threads=1)
        assert [h.score for h in hits] == scores[0][:k].tolist(), "scores differ from bm25s"
        if len(set(scores[0].tolist())) < k + 1:  # a tie within the top k+1: bm25s' order is arbitrary
            ties += 1
            continue
        ids = [int(h.document.id) - 1 for h in hits]  # generated ids are 1-based positions
        assert ids == docs[0][:k].tolist(), "top-10 differs from bm25s"
        same += 1
    out["top10_equal_to_bm25s"] = same
    out["top10_with_ties_skipped"] = ties
    return out


def _run_stage(stage: str, a: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--stage", stage, "--corpus", str(a.corpus), "--work", str(a.work)]
    if a.queries:
        cmd += ["--queries", str(a.queries)]
    print(f"[{time.strftime('%H:%M:%S')}] stage {stage} (load average {os.getloadavg()[0]:.1f})", flush=True)
    res = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=4 * 3600)
    result = json.loads(res.stdout.strip().splitlines()[-1])
    result["load_average_after"] = os.getloadavg()
    print(json.dumps(result, indent=1), flush=True)
    return result


def _dir_mib(p: Path) -> float:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--queries", type=Path)
    p.add_argument("--work", type=Path, required=True, help="scratch directory (removed first)")
    p.add_argument("--no-old", action="store_true", help="skip bm25s' in-memory build")
    p.add_argument("--json", type=Path)
    p.add_argument("--stage", choices=["bm25", "old", "docstore", "serve"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.stage:
        fn = {"bm25": _stage_bm25, "old": _stage_old, "docstore": _stage_docstore, "serve": _stage_serve}[a.stage]
        print(json.dumps(fn(a)))
        return
    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    results: dict[str, Any] = {"cpus": os.cpu_count(), "load_average_start": os.getloadavg()}
    results["bm25"] = _run_stage("bm25", a)
    results["bm25_index_mib"] = _dir_mib(a.work / "idx" / "bm25")
    results["bm25_work_dir_mib"] = _dir_mib(a.work / "bm25-work")
    shutil.rmtree(a.work / "bm25-work")
    if not a.no_old:
        results["old"] = _run_stage("old", a)
        same = all(
            np.array_equal(np.load(a.work / "idx" / "bm25" / n), np.load(a.work / "old-bm25" / n))
            for n in ("data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy")
        )
        results["old_arrays_equal"] = same
        print(f"streaming arrays == bm25s in-memory arrays: {same}", flush=True)
        shutil.rmtree(a.work / "old-bm25")
    results["docstore"] = _run_stage("docstore", a)
    results["docstore_mib"] = _dir_mib(a.work / "idx") - results["bm25_index_mib"]
    if a.queries:
        results["serve"] = _run_stage("serve", a)
    results["load_average_end"] = os.getloadavg()
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
