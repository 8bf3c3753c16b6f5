"""Wiki scale: build and serve BM25 and dense (faiss flat / IVF-PQ / HNSW) indexes of a wiki-18-shaped corpus.

    python benchmarks/wiki_scale.py [--passages 1000000] [--kinds bm25 dense] [--faiss ivfpq hnsw flat]
        [--device cpu|cuda] [--model DIR] [--threads 2] [--json out.json] [--md out.md]

Generates the corpus (and 2,000 queries) with `rlf_envs.data.wiki.generate` when `--corpus` is absent.
Every build runs `python -m servers.retrieval build` in a subprocess; its wall time and peak RSS
(`wait4` rusage of that child) are recorded. Dense encodes the corpus once: the first faiss kind keeps
its embeddings and the others reuse them (`--embeddings`), so their build time is docstore + faiss only.
Each index is then served by the real server (`ServerProcess`, `--threads`), driven by `--clients`
single-query clients for `--seconds`; reported: QPS, p50/p99 and the server's RSS (anonymous vs
file-backed: the memory-mapped faiss file and document store are file pages the kernel can drop).
Nothing is downloaded: the model is the bundled MiniLM or a local `--model` directory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "rlf_envs" / "src"), str(ROOT / "benchmarks")]

import retrieval as load_gen  # noqa: E402  (benchmarks/retrieval.py: the closed-loop client load generator)

from rlf_envs.retrieval.types import IndexManifest  # noqa: E402
from servers.retrieval.process import ServerProcess  # noqa: E402

MiB = 1 << 20


@dataclass
class Result:
    name: str  # bm25 | dense-flat | dense-ivfpq | ...
    build_s: float
    build_peak_rss_mib: float
    index_mib: float  # faiss file or bm25 dir
    docstore_mib: float
    embed_s: float | None = None  # dense: the encoding pass (measured in the build that did it)
    recall: float | None = None
    recall_k: int | None = None
    serve_rss_mib: float = 0.0
    serve_rss_anon_mib: float = 0.0
    serve_rss_file_mib: float = 0.0
    serve_load_s: float = 0.0
    qps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    errors: int = 0
    notes: list[str] = field(default_factory=list)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "rlf_envs" / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def run_measured(cmd: list[str], timeout_s: float) -> tuple[float, float, str]:
    """Run `cmd`; return (wall seconds, peak RSS MiB of the child, its stderr+stdout tail). Raises on failure."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout or []), daemon=True)
    reader.start()
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)  # the rusage of this child alone (ru_maxrss in KiB)
    finally:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join(10)
    dt = time.perf_counter() - t0
    tail = "".join(out[-40:])
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode} after {dt:.0f}s:\n{tail}")
    return dt, usage.ru_maxrss / 1024, tail


def _size_mib(path: Path) -> float:
    if path.is_file():
        return path.stat().st_size / MiB
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / MiB if path.exists() else 0.0


def _proc_mem(pid: int) -> dict[str, float]:
    mem: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            mem[key] = int(value.split()[0]) / 1024
    return mem


def ensure_corpus(corpus: Path, passages: int, queries: int) -> Path:
    qpath = corpus.with_suffix(".queries.jsonl")
    if corpus.is_file() and qpath.is_file():
        return qpath
    corpus.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "rlf_envs.data.wiki.generate", "--passages", str(passages), "--out", str(corpus),
           "--queries", str(queries), "--queries-out", str(qpath)]
    dt, _, _ = run_measured(cmd, 3600)
    print(f"generated {passages:,} passages in {dt:.0f}s -> {corpus}", flush=True)
    return qpath


def build(args: argparse.Namespace, out: Path, kind: str, extra: list[str]) -> tuple[float, float, str]:
    cmd = [sys.executable, "-m", "servers.retrieval", "build", "--corpus", str(args.corpus), "--out", str(out),
           "--kind", kind, "--overwrite", "--restart", "--threads", str(args.build_threads), *extra]
    print("$", " ".join(cmd), flush=True)
    return run_measured(cmd, args.build_timeout_s)


def serve_and_load(args: argparse.Namespace, index: Path, questions: list[str], r: Result) -> None:
    flags = ["--threads", str(args.threads), "--device", args.serve_device]
    t0 = time.perf_counter()
    with ServerProcess(index, flags, start_timeout_s=args.build_timeout_s) as srv:
        assert srv.proc is not None
        r.serve_load_s = time.perf_counter() - t0
        row = load_gen.server_level(srv, r.name, "single", questions, args.clients, 1, args.topk, args.seconds)
        mem = _proc_mem(srv.proc.pid)
    r.qps, r.p50_ms, r.p99_ms, r.errors = row.qps, row.p50_ms, row.p99_ms, row.errors
    r.serve_rss_mib, r.serve_rss_anon_mib = mem.get("VmRSS", 0.0), mem.get("RssAnon", 0.0)
    r.serve_rss_file_mib = mem.get("RssFile", 0.0)


def bench_bm25(args: argparse.Namespace, questions: list[str]) -> Result:
    out = args.workdir / "idx-bm25"
    dt, rss, _ = build(args, out, "bm25", [])
    r = Result("bm25", dt, rss, _size_mib(out / "bm25"), _size_mib(out / "docs.jsonl") + _size_mib(out / "offsets.npy"))
    serve_and_load(args, out, questions, r)
    return r


def bench_dense(args: argparse.Namespace, questions: list[str]) -> list[Result]:
    results: list[Result] = []
    embeddings: Path | None = None
    common = ["--recall-queries", str(args.queries), "--recall-k", str(args.topk_recall),
              "--recall-sample", str(args.recall_sample), "--batch-size", str(args.batch_size),
              "--device", args.device]
    if args.model:
        common += ["--model", args.model]
    if args.device.startswith("cuda") and not args.no_fp16:
        common.append("--fp16")
    for faiss_kind in args.faiss:
        out = args.workdir / f"idx-dense-{faiss_kind}"
        extra = [*common, "--faiss", faiss_kind]
        if faiss_kind == "ivfpq" and args.pq_m:
            extra += ["--pq-m", str(args.pq_m)]
        extra += ["--keep-embeddings"] if embeddings is None else ["--embeddings", str(embeddings)]
        dt, rss, _ = build(args, out, "dense", extra)
        m = IndexManifest.read(out)
        r = Result(f"dense-{faiss_kind}", dt, rss, _size_mib(out / "index.faiss"),
                   _size_mib(out / "docs.jsonl") + _size_mib(out / "offsets.npy"), recall=m.recall, recall_k=m.recall_k)
        if embeddings is None:
            embeddings = args.workdir / "embeddings.npy"
            os.replace(out / "embeddings.npy", embeddings)
            r.embed_s = float(m.extra["embed_seconds"])
        else:
            r.notes.append("embeddings reused: build = docstore + faiss + recall")
        serve_and_load(args, out, questions, r)
        results.append(r)
        print(json.dumps(asdict(r)), flush=True)
    return results


def markdown(results: list[Result], meta: dict[str, object]) -> str:
    lines = [
        f"Wiki scale: {meta['passages']:,} passages, device {meta['device']}, server threads {meta['threads']}, "
        f"{meta['clients']} single-query clients, {meta['cpus']} CPUs ({meta['machine']})",
        "",
        "| index | build s | embed s | build peak RSS MiB | index MiB | docstore MiB | recall@k vs flat "
        "| serve RSS MiB (anon / file) | QPS | p50 ms | p99 ms | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        recall = f"{r.recall:.3f} @{r.recall_k}" if r.recall is not None else "exact" if r.name == "bm25" else "-"
        lines.append(
            f"| {r.name} | {r.build_s:.0f} | {'-' if r.embed_s is None else f'{r.embed_s:.0f}'} "
            f"| {r.build_peak_rss_mib:.0f} | {r.index_mib:.0f} | {r.docstore_mib:.0f} | {recall} "
            f"| {r.serve_rss_mib:.0f} ({r.serve_rss_anon_mib:.0f} / {r.serve_rss_file_mib:.0f}) "
            f"| {r.qps:.0f} | {r.p50_ms:.1f} | {r.p99_ms:.1f} | {r.errors} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passages", type=int, default=1_000_000)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/rlf-wiki-scale"))
    ap.add_argument("--corpus", type=Path, default=None, help="default: WORKDIR/wiki-N.jsonl, generated if absent")
    ap.add_argument("--kinds", nargs="+", choices=("bm25", "dense"), default=["bm25", "dense"])
    ap.add_argument("--faiss", nargs="+", choices=("flat", "ivf", "ivfpq", "ivfsq", "hnsw", "hnswsq"),
                    default=["ivfpq", "hnsw", "flat"], help="dense kinds; the first one does the encoding pass")
    ap.add_argument("--pq-m", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="encoder device for the build (cuda: fp16 unless --no-fp16)")
    ap.add_argument("--no-fp16", action="store_true")
    ap.add_argument("--serve-device", default="cpu", help="the server's query-encoder device")
    ap.add_argument("--model", default=None, help="a local sentence-transformers directory (default: bundled MiniLM)")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2, help="server CPU threads (2 emulates the 2-core box)")
    ap.add_argument("--build-threads", type=int, default=0, help="build CPU threads (0: all)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--topk", type=int, default=3)
    ap.add_argument("--topk-recall", type=int, default=10)
    ap.add_argument("--recall-sample", type=int, default=500)
    ap.add_argument("--build-timeout-s", type=float, default=3600.0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--md", type=Path, default=None)
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.corpus = args.corpus or args.workdir / f"wiki-{args.passages}.jsonl"
    args.queries = ensure_corpus(args.corpus, args.passages, 2000)
    questions = [json.loads(line)["question"] for line in args.queries.read_text().splitlines() if line.strip()]
    results: list[Result] = []
    if "bm25" in args.kinds:
        results.append(bench_bm25(args, questions))
        print(json.dumps(asdict(results[-1])), flush=True)
    if "dense" in args.kinds:
        results += bench_dense(args, questions)
    with args.corpus.open("rb") as f:
        passages = sum(1 for _ in f)
    meta: dict[str, object] = {
        "passages": passages, "device": args.device, "threads": args.threads, "clients": args.clients,
        "seconds": args.seconds, "cpus": os.cpu_count(), "machine": platform.machine(), "corpus": str(args.corpus),
    }
    table = markdown(results, meta)
    print(table)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=2) + "\n")
    if args.md:
        args.md.write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
