"""Retrieval throughput: in-process batched search (the ceiling) vs the HTTP server under 1/16/64 clients.

    python benchmarks/retrieval.py [--kind dense|bm25] [--index DIR] [--seconds 5] [--json out.json]

The in-process ceiling calls `search_batch` on batches of `--batch` queries (default: the largest
client count) in a loop: one encoder pass + one faiss search per batch, no HTTP. The server is
started as a subprocess on a free loopback port; each client sends one Search-R1 request with one
query at a time (what an RL rollout does) for `--seconds`. Reported: queries/s, p50/p99 latency and
`server_over_inprocess` = server QPS / in-process QPS. Target at 64 clients: ratio >= 0.6 and
p99 < 4x p50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "rlf_envs" / "src")]

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402

from rlf_envs.retrieval import build_index, load_index  # noqa: E402
from rlf_envs.retrieval._deps import set_threads  # noqa: E402
from servers.retrieval.process import ServerProcess  # noqa: E402

DATA = ROOT / "rlf_envs" / "src" / "rlf_envs" / "data" / "search"
TARGET_RATIO = 0.6
TARGET_P99_OVER_P50 = 4.0


@dataclass
class Row:
    mode: str
    clients: int
    queries: int
    seconds: float
    qps: float
    p50_ms: float
    p99_ms: float
    errors: int = 0
    server_over_inprocess: float | None = None
    p99_over_p50: float | None = None
    mean_server_batch: float | None = None


def _questions() -> list[str]:
    rows = [json.loads(line) for f in ("test.jsonl", "train.jsonl") for line in (DATA / f).read_text().splitlines()]
    return [r["question"] for r in rows]


def _pct(lat: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(lat) * 1000, q)) if lat else float("nan")


def inprocess(index_dir: Path, questions: list[str], batch: int, topk: int, seconds: float) -> Row:
    index = load_index(index_dir)
    try:
        index.search_batch(questions[:batch], topk)  # warm-up (model, caches)
        lat: list[float] = []
        n, pos = 0, 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            qs = [questions[(pos + i) % len(questions)] for i in range(batch)]
            pos += batch
            s = time.perf_counter()
            index.search_batch(qs, topk)
            lat.append(time.perf_counter() - s)
            n += batch
        dt = time.perf_counter() - t0
    finally:
        index.close()
    return Row("in-process", batch, n, dt, n / dt, _pct(lat, 50), _pct(lat, 99))


async def _server_level(url: str, questions: list[str], clients: int, topk: int, seconds: float) -> Row:
    lat: list[float] = []
    errors = 0
    counter = 0
    connector = aiohttp.TCPConnector(limit=clients, force_close=False)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:

        async def one(q: str) -> bool:
            async with s.post(url + "/retrieve", json={"queries": [q], "topk": topk, "return_scores": True}) as r:
                await r.read()
                return r.status == 200

        # warm-up: open the connections, let the server's encoder settle
        await asyncio.gather(*(one(questions[i % len(questions)]) for i in range(clients)))
        stop_at = time.perf_counter() + seconds

        async def client(c: int) -> None:
            nonlocal errors, counter
            while time.perf_counter() < stop_at:
                q = questions[counter % len(questions)]  # every request the next question: no repeats in a batch
                counter += 1
                t = time.perf_counter()
                try:
                    ok = await one(q)
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                if ok:
                    lat.append(time.perf_counter() - t)
                else:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        dt = time.perf_counter() - t0
    return Row("server", clients, len(lat), dt, len(lat) / dt, _pct(lat, 50), _pct(lat, 99), errors)


async def _health(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s, s.get(url + "/health") as r:
        return dict(await r.json())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=("dense", "bm25"), default="dense")
    ap.add_argument(
        "--index", type=Path, default=None, help="existing index dir (default: build one of the shipped corpus)"
    )
    ap.add_argument("--clients", default="1,16,64", help="comma-separated concurrent client counts")
    ap.add_argument("--batch", type=int, default=None, help="in-process batch size (default: max clients)")
    ap.add_argument("--topk", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per level")
    ap.add_argument("--max-wait-ms", type=float, default=2.0, help="server micro-batch wait")
    ap.add_argument("--threads", type=int, default=1,
                    help="encoder/faiss CPU threads, the same for in-process and server (0: library default)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.clients.split(",")]
    batch = args.batch or max(levels)
    questions = _questions()

    with tempfile.TemporaryDirectory() as tmp:
        index_dir = args.index
        if index_dir is None:
            index_dir = Path(tmp) / f"{args.kind}-index"
            print(f"building a {args.kind} index of the shipped corpus ...", file=sys.stderr)
            build_index(DATA / "corpus.jsonl", index_dir, kind=args.kind, show_progress=False)
        set_threads(args.threads)
        base = inprocess(index_dir, questions, batch, args.topk, args.seconds)
        rows = [base]
        srv_args = ["--max-wait-ms", str(args.max_wait_ms), "--threads", str(args.threads)]
        with ServerProcess(index_dir, srv_args, start_timeout_s=120) as srv:
            for clients in levels:
                before = asyncio.run(_health(srv.url))
                row = asyncio.run(_server_level(srv.url, questions, clients, args.topk, args.seconds))
                after = asyncio.run(_health(srv.url))
                row.server_over_inprocess = row.qps / base.qps
                row.p99_over_p50 = row.p99_ms / row.p50_ms if row.p50_ms else None
                nb = after["batches"] - before["batches"]
                row.mean_server_batch = (after["queries"] - before["queries"]) / nb if nb else None
                nq = after["queries"] - before["queries"]
                print(f"  {clients} clients: {after['unique_queries'] - before['unique_queries']} of {nq} queries "
                      "searched after de-duplication", file=sys.stderr)
                rows.append(row)

    print(f"\nretrieval benchmark ({args.kind}, topk={args.topk}, {os.cpu_count()} CPUs, {args.seconds:g}s per level)")
    head = (
        f"{'mode':<11}{'clients':>8}{'QPS':>10}{'p50 ms':>9}{'p99 ms':>9}{'p99/p50':>9}{'batch':>7}"
        f"{'vs in-proc':>12}{'errors':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = f"{r.server_over_inprocess:.2f}" if r.server_over_inprocess is not None else "1.00 (base)"
        tail = f"{r.p99_over_p50:.2f}" if r.p99_over_p50 is not None else "-"
        mb = f"{r.mean_server_batch:.1f}" if r.mean_server_batch is not None else str(r.clients)
        print(
            f"{r.mode:<11}{r.clients:>8}{r.qps:>10.1f}{r.p50_ms:>9.2f}{r.p99_ms:>9.2f}{tail:>9}{mb:>7}"
            f"{ratio:>12}{r.errors:>8}"
        )
    top = next((r for r in rows if r.mode == "server" and r.clients == max(levels)), None)
    meets = bool(
        top
        and top.errors == 0
        and (top.server_over_inprocess or 0) >= TARGET_RATIO
        and (top.p99_over_p50 or 1e9) < TARGET_P99_OVER_P50
    )
    if top:
        print(
            f"\nat {top.clients} clients: server_over_inprocess={top.server_over_inprocess:.2f} "
            f"(target >= {TARGET_RATIO}), p99/p50={top.p99_over_p50:.2f} (target < {TARGET_P99_OVER_P50}): "
            + ("MET" if meets else "NOT MET")
        )
    if args.json:
        result = {
            "benchmark": "retrieval",
            "kind": args.kind,
            "topk": args.topk,
            "seconds_per_level": args.seconds,
            "inprocess_batch": batch,
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "loadavg_1m_at_end": os.getloadavg()[0],
            },
            "inprocess": asdict(base),
            "server": [asdict(r) for r in rows[1:]],
            "target": {
                "clients": max(levels),
                "server_over_inprocess": TARGET_RATIO,
                "p99_over_p50": TARGET_P99_OVER_P50,
            },
            "meets_target": meets,
        }
        tmp_json = args.json.with_suffix(args.json.suffix + ".tmp")
        tmp_json.write_text(json.dumps(result, indent=2) + "\n")
        tmp_json.replace(args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
