"""Retrieval throughput: in-process batched search (the ceiling) vs the HTTP server, per index kind and client mode.

    python benchmarks/retrieval.py [--kinds dense,bm25] [--modes single,batched] [--per-request 8]
                                   [--clients 1,16,64] [--seconds 5] [--pin 0:1] [--json out.json]

For every kind (dense MiniLM + faiss flat, BM25) and client mode:

* `single`: each client sends one Search-R1 request with ONE query at a time (an RL rollout's search).
* `batched`: each request carries `--per-request` queries (a trainer that coalesces its envs' searches).

The in-process ceiling is what a user without the server gets from the same index in the same process:
`search_batch` over all the queries the clients have in flight at the top level (clients x queries per
request, at most the server's `--max-batch`), in a loop, on the same number of encoder/faiss threads as
the server. The server runs as a subprocess on a free loopback port; the load generator (this process,
one asyncio loop with aiohttp) sends every request the next of the shipped questions, so nothing repeats
within a batch. Reported per level: queries/s, request p50/p99, `vs in-proc` = server QPS / ceiling QPS,
and the CPU (in cores) that the server process and the load generator burned while the level ran.

`--pin S:C` (e.g. `0:1` on a 2-core box) runs the ceiling and the server (all of its threads) on CPUs S
and the load generator on CPUs C, so both sides of the ratio get the same cores and the client's cost
does not come out of the server's budget. Without it, everything floats over all CPUs.
Target at the top level: server_over_inprocess >= 0.95 and p99/p50 < 2.
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
import psutil  # noqa: E402

from rlf_envs.retrieval import build_index, load_index  # noqa: E402
from rlf_envs.retrieval._deps import set_threads  # noqa: E402
from servers.retrieval.process import ServerProcess  # noqa: E402

DATA = ROOT / "rlf_envs" / "src" / "rlf_envs" / "data" / "search"
TARGET_RATIO = 0.95
TARGET_P99_OVER_P50 = 2.0
MODES = ("single", "batched")


@dataclass
class Row:
    kind: str
    mode: str  # "in-process" | "single" | "batched"
    clients: int
    per_request: int
    queries: int
    seconds: float
    qps: float
    p50_ms: float
    p99_ms: float
    errors: int = 0
    server_over_inprocess: float | None = None
    p99_over_p50: float | None = None
    mean_server_batch: float | None = None
    client_cores: float | None = None  # CPU-seconds per second of the load generator (this process)
    server_cores: float | None = None  # CPU-seconds per second of the server process, all threads
    client_us_per_request: float | None = None
    #: CPU microseconds per query: of the in-process search loop, or of the server process (all threads). CPU
    #: time, unlike QPS, barely moves when other processes load the box
    cpu_us_per_query: float | None = None


def _questions() -> list[str]:
    rows = [json.loads(line) for f in ("test.jsonl", "train.jsonl") for line in (DATA / f).read_text().splitlines()]
    return [r["question"] for r in rows]


def _pct(lat: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(lat) * 1000, q)) if lat else float("nan")


def _pin(cpus: set[int] | None) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


def inprocess(kind: str, index_dir: Path, questions: list[str], batch: int, topk: int, seconds: float) -> Row:
    index = load_index(index_dir)
    try:
        index.search_batch(questions[:batch], topk)  # warm-up (model, caches)
        lat: list[float] = []
        n, pos = 0, 0
        c0, t0 = time.process_time(), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            qs = [questions[(pos + i) % len(questions)] for i in range(batch)]
            pos += batch
            s = time.perf_counter()
            index.search_batch(qs, topk)
            lat.append(time.perf_counter() - s)
            n += batch
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        index.close()
    row = Row(kind, "in-process", batch, batch, n, dt, n / dt, _pct(lat, 50), _pct(lat, 99))
    row.cpu_us_per_query = cpu / n * 1e6
    return row


@dataclass
class _Level:
    lat: list[float]
    errors: int
    seconds: float
    client_cpu_s: float
    server_cpu_s: float
    health_before: dict[str, float]
    health_after: dict[str, float]


def _cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def _pool(a: Row, b: Row) -> Row:
    """Two in-process measurements as one (queries and seconds added; latency percentiles of the slower)."""
    n, dt = a.queries + b.queries, a.seconds + b.seconds
    row = Row(a.kind, a.mode, a.clients, a.per_request, n, dt, n / dt, max(a.p50_ms, b.p50_ms), max(a.p99_ms, b.p99_ms))
    if a.cpu_us_per_query is not None and b.cpu_us_per_query is not None:
        row.cpu_us_per_query = (a.cpu_us_per_query * a.queries + b.cpu_us_per_query * b.queries) / n
    return row


async def _server_level(
    url: str, questions: list[str], clients: int, per_request: int, topk: int, seconds: float,
    server: list[psutil.Process] | None = None,
) -> _Level:
    """`clients` closed-loop clients for `seconds`, after a warm-up round that is not counted (nor is its CPU)."""
    lat: list[float] = []
    errors = 0
    counter = 0
    connector = aiohttp.TCPConnector(limit=clients, force_close=False)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:

        def body() -> bytes:
            nonlocal counter
            qs = [questions[(counter + i) % len(questions)] for i in range(per_request)]
            counter += per_request  # the next questions: no repeats within a batch
            return json.dumps({"queries": qs, "topk": topk, "return_scores": True}).encode()

        async def one(data: bytes) -> bool:
            headers = {"Content-Type": "application/json"}
            async with s.post(url + "/retrieve", data=data, headers=headers) as r:
                await r.read()
                return r.status == 200

        # warm-up: open the connections, let the server's encoder settle
        await asyncio.gather(*(one(body()) for _ in range(clients)))
        async with s.get(url + "/health") as r:
            before = dict(await r.json())
        s0 = _cpu_s(server or [])
        stop_at = time.perf_counter() + seconds

        async def client() -> None:
            nonlocal errors
            while time.perf_counter() < stop_at:
                data = body()
                t = time.perf_counter()
                try:
                    ok = await one(data)
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                if ok:
                    lat.append(time.perf_counter() - t)
                else:
                    errors += 1

        c0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        s1 = _cpu_s(server or [])
        async with s.get(url + "/health") as r:
            after = dict(await r.json())
    return _Level(lat, errors, dt, cpu, s1 - s0, before, after)


def server_level(
    srv: ServerProcess, kind: str, mode: str, questions: list[str], clients: int, per_request: int,
    topk: int, seconds: float,
) -> Row:
    assert srv.proc is not None
    parent = psutil.Process(srv.proc.pid)
    procs = [parent, *parent.children()]  # the workers of `serve --workers N`
    level = asyncio.run(_server_level(srv.url, questions, clients, per_request, topk, seconds, procs))
    lat, errors, dt, client_cpu = level.lat, level.errors, level.seconds, level.client_cpu_s
    before, after = level.health_before, level.health_after
    n = len(lat) * per_request
    row = Row(kind, mode, clients, per_request, n, dt, n / dt, _pct(lat, 50), _pct(lat, 99), errors)
    row.p99_over_p50 = row.p99_ms / row.p50_ms if row.p50_ms else None
    nb = after["batches"] - before["batches"]
    nq = after["queries"] - before["queries"]
    # with several workers /health answers for one of them: no batch statistics then
    row.mean_server_batch = nq / nb if nb and len(procs) == 1 else None
    row.server_cores = level.server_cpu_s / dt
    row.client_cores = client_cpu / dt
    row.client_us_per_request = client_cpu / max(1, len(lat) + errors) * 1e6
    row.cpu_us_per_query = row.server_cores * dt / max(1, n) * 1e6
    if len(procs) == 1:
        print(f"  {kind} {mode} {clients} clients: {after['unique_queries'] - before['unique_queries']} of {nq} "
              "queries searched after de-duplication", file=sys.stderr)
    return row


def _cpus(spec: str) -> set[int]:
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _print_table(rows: list[Row], seconds: float, topk: int) -> None:
    print(f"\nretrieval benchmark (topk={topk}, {os.cpu_count()} CPUs, {seconds:g}s per level)")
    head = (
        f"{'kind':<6}{'mode':<11}{'clients':>8}{'q/req':>6}{'QPS':>10}{'p50 ms':>9}{'p99 ms':>9}{'p99/p50':>9}"
        f"{'batch':>7}{'vs in-proc':>12}{'cpu us/q':>9}{'srv cores':>10}{'cli cores':>10}{'cli us/req':>11}"
        f"{'errors':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = f"{r.server_over_inprocess:.2f}" if r.server_over_inprocess is not None else "1.00 (base)"
        tail = f"{r.p99_over_p50:.2f}" if r.p99_over_p50 is not None else "-"
        mb = f"{r.mean_server_batch:.1f}" if r.mean_server_batch is not None else "-"
        if r.mode == "in-process":
            mb = str(r.clients)
        srv = f"{r.server_cores:.2f}" if r.server_cores is not None else "-"
        cli = f"{r.client_cores:.2f}" if r.client_cores is not None else "-"
        cus = f"{r.client_us_per_request:.0f}" if r.client_us_per_request is not None else "-"
        cpq = f"{r.cpu_us_per_query:.0f}" if r.cpu_us_per_query is not None else "-"
        print(
            f"{r.kind:<6}{r.mode:<11}{r.clients:>8}{r.per_request:>6}{r.qps:>10.1f}{r.p50_ms:>9.2f}{r.p99_ms:>9.2f}"
            f"{tail:>9}{mb:>7}{ratio:>12}{cpq:>9}{srv:>10}{cli:>10}{cus:>11}{r.errors:>7}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="dense,bm25", help="comma-separated index kinds (dense, bm25)")
    ap.add_argument("--modes", default="single,batched", help="comma-separated client modes (single, batched)")
    ap.add_argument("--per-request", type=int, default=8, help="queries per request in the batched mode")
    ap.add_argument("--index", type=Path, default=None,
                    help="an existing index dir (one kind only; default: build each kind over the shipped corpus)")
    ap.add_argument("--clients", default="1,16,64", help="comma-separated concurrent client counts")
    ap.add_argument("--topk", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per level")
    ap.add_argument("--max-wait-ms", type=float, default=2.0, help="server micro-batch wait")
    ap.add_argument("--max-batch", type=int, default=512, help="server micro-batch size (and the ceiling's cap)")
    ap.add_argument("--threads", type=int, default=1,
                    help="encoder/faiss CPU threads, the same for in-process and server (0: library default)")
    ap.add_argument("--server-args", default="", help="extra `serve` flags, space-separated (e.g. '--workers 2')")
    ap.add_argument("--pin", default=None, metavar="S:C",
                    help="CPU lists: ceiling + server on S, load generator on C (e.g. 0:1)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    modes = [m for m in args.modes.split(",") if m]
    if bad := [k for k in kinds if k not in ("dense", "bm25")] + [m for m in modes if m not in MODES]:
        ap.error(f"unknown kinds/modes {bad}")
    if args.index is not None and len(kinds) != 1:
        ap.error("--index needs exactly one --kinds")
    levels = [int(c) for c in args.clients.split(",")]
    server_cpus = client_cpus = None
    if args.pin:
        s, _, c = args.pin.partition(":")
        server_cpus, client_cpus = _cpus(s), _cpus(c)
    all_cpus = os.sched_getaffinity(0)
    questions = _questions()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            index_dir = args.index
            if index_dir is None:
                index_dir = Path(tmp) / f"{kind}-index"
                print(f"building a {kind} index of the shipped corpus ...", file=sys.stderr)
                build_index(DATA / "corpus.jsonl", index_dir, kind=kind, show_progress=False)
            set_threads(args.threads)
            srv_args = ["--max-wait-ms", str(args.max_wait_ms), "--max-batch", str(args.max_batch),
                        "--threads", str(args.threads), *args.server_args.split()]
            for mode in modes:
                qpr = 1 if mode == "single" else args.per_request
                # the ceiling is measured before and after the server levels (half the time each) and the two
                # pooled: on a shared box the load drifts, and one measurement before would bias the ratio
                batch = min(args.max_batch, max(levels) * qpr)
                _pin(server_cpus)
                first = inprocess(kind, index_dir, questions, batch, args.topk, args.seconds / 2)
                level_rows = []
                with ServerProcess(index_dir, srv_args, start_timeout_s=120) as srv:  # inherits server_cpus
                    _pin(client_cpus)
                    for clients in levels:
                        level_rows.append(server_level(srv, kind, mode, questions, clients, qpr, args.topk,
                                                       args.seconds))
                _pin(server_cpus)
                second = inprocess(kind, index_dir, questions, batch, args.topk, args.seconds / 2)
                _pin(all_cpus if server_cpus is not None else None)
                base = _pool(first, second)
                print(f"  {kind} {mode} in-process: {first.qps:.1f} QPS before the server levels, {second.qps:.1f} "
                      "after", file=sys.stderr)
                rows.append(base)
                for row in level_rows:
                    row.server_over_inprocess = row.qps / base.qps
                    rows.append(row)
    _print_table(rows, args.seconds, args.topk)
    verdicts = []
    top = max(levels)
    for r in rows:
        if r.mode != "in-process" and r.clients == top:
            ok = (r.errors == 0 and (r.server_over_inprocess or 0) >= TARGET_RATIO
                  and (r.p99_over_p50 or 1e9) < TARGET_P99_OVER_P50)
            verdicts.append(ok)
            print(f"{r.kind} {r.mode} at {top} clients: server_over_inprocess={r.server_over_inprocess:.2f} "
                  f"(target >= {TARGET_RATIO}), p99/p50={r.p99_over_p50:.2f} (target < {TARGET_P99_OVER_P50}): "
                  + ("MET" if ok else "NOT MET"))
    if args.json:
        result = {
            "benchmark": "retrieval",
            "kinds": kinds,
            "modes": modes,
            "per_request": args.per_request,
            "topk": args.topk,
            "threads": args.threads,
            "pin": args.pin,
            "server_args": args.server_args,
            "seconds_per_level": args.seconds,
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "loadavg_1m_at_end": os.getloadavg()[0],
            },
            "rows": [asdict(r) for r in rows],
            "target": {"clients": top, "server_over_inprocess": TARGET_RATIO, "p99_over_p50": TARGET_P99_OVER_P50},
            "meets_target": bool(verdicts) and all(verdicts),
        }
        tmp_json = args.json.with_suffix(args.json.suffix + ".tmp")
        tmp_json.write_text(json.dumps(result, indent=2) + "\n")
        tmp_json.replace(args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
