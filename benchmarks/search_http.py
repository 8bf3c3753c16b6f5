"""Search over HTTP: one /retrieve request per batch of searches (coalesced) vs one request per search.

    python benchmarks/search_http.py [--envs 64] [--turns 15] [--rounds 3] [--latency-ms 50]
                                     [--format search_r1|qwen3] [--parts AB] [--json out/search_http.json]

Part A: `--envs` rlf/Search-v0 envs (search_r1 format, text mode) in one ToolVectorEnv, each turn every env
searches a different entity (no query repeats within a turn, so de-duplication does not help), against rlf's
retrieval server (BM25 over the shipped corpus, a subprocess on loopback). Env steps/s = envs / turn time. For
reference, the same turns searching the same index in-process (no HTTP: the ceiling).

Part B: the same envs against a Search-R1-style retriever on loopback (a subprocess) that takes `--latency-ms` per
request whatever its batch size, like a GPU retriever. Two servers: one answering requests concurrently (the
kindest to one-request-per-search) and one answering one request at a time (a single GPU). Reported: the turn
time and its ratio to the retriever's latency (goal: coalesced within 1.2x), next to the same envs and turns with
an in-process tool of that latency (no HTTP: what the env itself costs per turn on this machine).

Each mode runs `--turns` timed turns per round (a fifth of them against the one-at-a-time server), rounds
alternate the modes (so load on a shared box hits both), and the median turn over all rounds is reported; envs
are reset (untimed) every 3 turns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "rlf_envs" / "src")]

import rlf_envs  # noqa: E402
from rlf_envs.env import ToolEnv, ToolVectorEnv  # noqa: E402
from rlf_envs.envs.search import SearchEnv, search_tasks  # noqa: E402
from rlf_envs.tools import FunctionTool  # noqa: E402
from servers.retrieval.process import ServerProcess  # noqa: E402

CORPUS = ROOT / "rlf_envs" / "src" / "rlf_envs" / "data" / "search" / "corpus.jsonl"
MODES = {"coalesced": True, "one request per search": False}
REFERENCE = "no HTTP: in-process tool"
REFERENCE_INDEX = "no HTTP: in-process BM25"
TURNS_PER_EPISODE = 3


# -- a Search-R1-style retriever with a fixed latency per request (run as a subprocess) ---------------------


def serve_fixed_latency(latency_s: float, serial: bool) -> None:
    """`/retrieve` answering after `latency_s` per request whatever its size; `serial`: one request at a time."""
    from aiohttp import web

    lock = asyncio.Lock()

    async def retrieve(request: web.Request) -> web.Response:
        body = await request.json()
        queries, topk = body["queries"], int(body.get("topk", 3))
        if serial:
            async with lock:
                await asyncio.sleep(latency_s)
        else:
            await asyncio.sleep(latency_s)
        result = [
            [{"document": {"id": f"{i}", "contents": f'"{q}"\nA passage about {q}.'}, "score": 1.0 - i / 10}
             for i in range(topk)]
            for q in queries
        ]
        return web.json_response({"result": result})

    async def main() -> None:
        app = web.Application(client_max_size=16 << 20)
        app.router.add_post("/retrieve", retrieve)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        print(f"listening on http://127.0.0.1:{port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


@contextmanager
def fixed_latency_server(latency_s: float, serial: bool) -> Iterator[str]:
    cmd = [sys.executable, __file__, "--serve-fixed-latency", str(latency_s)] + (["--serial"] if serial else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("listening on "):
            raise RuntimeError(f"the fixed-latency retriever did not start: {line!r}")
        yield line.split()[-1]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- the measurement ------------------------------------------------------------------------------------------


class Run:
    """`envs` Search-v0 envs over HTTP with coalescing on or off; `turns()` times turns of one search per env."""

    def __init__(
        self, url: str | None, envs: int, coalesce: bool, fmt: str, latency_s: float = 0.0, index: Path | None = None
    ) -> None:
        self.entities = [t.meta["entity"] for t in search_tasks("train")]
        limits: dict[str, Any] = dict(
            format=fmt, max_turns=TURNS_PER_EPISODE + 1, max_total_tokens=1 << 20,
            caller={"timeout_s": 60, "max_retries": 0},
        )
        if index is not None:  # the reference: the same index searched in-process
            fns = [lambda: SearchEnv(retriever="inprocess", index_dir=index, **limits) for _ in range(envs)]
        elif url is None:  # the reference: the same envs and turns with an in-process tool of the same latency
            tool = in_process_search(latency_s)
            fns = [lambda: ToolEnv(tools=[tool], tasks=search_tasks("train"), **limits) for _ in range(envs)]
        else:
            fns = [lambda: SearchEnv(retriever=url, coalesce=coalesce, **limits) for _ in range(envs)]
        self.venv = ToolVectorEnv(env_fns=fns)
        self.tool: Any = self.venv.envs[0].toolbox.tools["search"]
        self.n = envs
        self.fmt = fmt
        self.offset = 0

    @property
    def requests(self) -> int:
        return getattr(getattr(self.tool, "backend", None), "requests", 0)  # HTTP requests sent (0 in-process)

    def action(self, entity: str) -> str:
        if self.fmt == "search_r1":
            return f"<think>I must look it up.</think><search>{entity}</search>"
        call = {"name": "search", "arguments": {"query": entity}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    def turns(self, count: int) -> list[float]:
        times = []
        for t in range(count):
            if t % TURNS_PER_EPISODE == 0:
                self.venv.reset(seed=t)
            names = [self.entities[(self.offset + i) % len(self.entities)] for i in range(self.n)]
            self.offset += self.n
            actions = [self.action(e) for e in names]
            t0 = time.perf_counter()
            obs, _, _, _, info = self.venv.step(actions)
            times.append(time.perf_counter() - t0)
            bad = [o for o in obs if "Doc 1(Title:" not in o]
            if bad:
                raise RuntimeError(f"{len(bad)} searches failed, e.g. {bad[0][:300]!r}")
        return times

    def close(self) -> None:
        from rlf_envs import runtime

        self.venv.close()
        runtime.run(self.tool.aclose())


def in_process_search(latency_s: float) -> FunctionTool:
    async def search(query: str, topk: int = 3) -> str:
        """Search (a stand-in taking the retriever's latency, without HTTP)."""
        await asyncio.sleep(latency_s)
        return "\n".join(f'Doc {i + 1}(Title: "{query}") A passage about {query}.' for i in range(topk))

    return FunctionTool(search)


def compare(
    url: str, envs: int, turns: int, rounds: int, fmt: str, reference_latency_s: float | None = None,
    reference_index: Path | None = None,
) -> dict[str, dict[str, float]]:
    """Median turn per mode, rounds alternating the modes; requests per turn from the backend's counter. With
    `reference_latency_s`, also the same turns with an in-process tool of that latency (no HTTP at all)."""
    runs = {name: Run(url, envs, coalesce, fmt) for name, coalesce in MODES.items()}
    if reference_latency_s is not None:
        runs[REFERENCE] = Run(None, envs, False, fmt, reference_latency_s)
    if reference_index is not None:
        runs[REFERENCE_INDEX] = Run(None, envs, False, fmt, index=reference_index)
    times: dict[str, list[float]] = {name: [] for name in runs}
    try:
        for r in runs.values():
            r.turns(2)  # warm-up: connections, caches
        requests0 = {name: r.requests for name, r in runs.items()}
        for _ in range(rounds):
            for name, r in runs.items():
                times[name] += r.turns(turns)
        out = {}
        for name, r in runs.items():
            med = statistics.median(times[name])
            out[name] = {
                "turn_s_median": med,
                "turn_s_p90": statistics.quantiles(times[name], n=10)[-1],
                "steps_per_s": envs / med,
                "requests_per_turn": (r.requests - requests0[name]) / len(times[name]),
            }
        return out
    finally:
        for r in runs.values():
            r.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", type=int, default=64)
    ap.add_argument("--turns", type=int, default=15, help="timed turns per mode per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--latency-ms", type=float, default=50.0, help="part B: the retriever's latency per request")
    ap.add_argument("--format", default="search_r1", choices=["search_r1", "qwen3"])
    ap.add_argument("--parts", default="AB", help="A, B or AB")
    ap.add_argument("--server-args", default="", help='part A: extra `serve` flags, e.g. "--max-wait-ms 0"')
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--serve-fixed-latency", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serial", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_fixed_latency is not None:
        serve_fixed_latency(args.serve_fixed_latency, args.serial)
        return 0

    load0 = os.getloadavg()[0]
    report: dict[str, Any] = {"envs": args.envs, "turns": args.turns * args.rounds, "format": args.format}
    if "A" in args.parts:
        from rlf_envs.retrieval import build_index

        with tempfile.TemporaryDirectory() as tmp:
            build_index(CORPUS, Path(tmp) / "bm25", kind="bm25", show_progress=False)
            with ServerProcess(Path(tmp) / "bm25", args.server_args.split(), start_timeout_s=120) as srv:
                index = Path(tmp) / "bm25"
                a = compare(srv.url, args.envs, args.turns, args.rounds, args.format, reference_index=index)
        ratio = a["coalesced"]["steps_per_s"] / a["one request per search"]["steps_per_s"]
        report["bm25_server"] = {**a, "speedup": ratio, "server_args": args.server_args}
        print(f"\nA. {args.envs} Search-v0 envs ({args.format}) -> rlf retrieval server (BM25, shipped corpus)")
        print(f"{'mode':<24} {'turn (median)':>14} {'p90':>9} {'env steps/s':>12} {'requests/turn':>14}")
        for name, r in a.items():
            print(f"{name:<24} {r['turn_s_median'] * 1e3:>11.1f} ms {r['turn_s_p90'] * 1e3:>6.1f} ms "
                  f"{r['steps_per_s']:>12,.0f} {r['requests_per_turn']:>14.1f}")
        print(f"coalesced / one request per search: {ratio:.2f}x env steps/s (goal >= 3x)")
    if "B" in args.parts:
        latency = args.latency_ms / 1e3
        report["fixed_latency"] = {}
        for serial in (False, True):
            kind = "one request at a time" if serial else "concurrent requests"
            with fixed_latency_server(latency, serial) as url:
                # one request per search at a time takes envs x latency a turn: fewer turns there
                turns = max(3, args.turns // 5) if serial else args.turns
                b = compare(url, args.envs, turns, args.rounds, args.format, None if serial else latency)
            for r in b.values():
                r["vs_latency"] = r["turn_s_median"] / latency
            report["fixed_latency"][kind] = b
            print(f"\nB. {args.envs} envs -> a {args.latency_ms:g} ms-per-request retriever ({kind})")
            print(f"{'mode':<24} {'turn (median)':>14} {'p90':>9} {'/ latency':>10} {'requests/turn':>14}")
            for name, r in b.items():
                print(f"{name:<24} {r['turn_s_median'] * 1e3:>11.1f} ms {r['turn_s_p90'] * 1e3:>6.1f} ms "
                      f"{r['vs_latency']:>9.2f}x {r['requests_per_turn']:>14.1f}")
    report["machine"] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_1m_at_start": load0,
        "loadavg_1m_at_end": os.getloadavg()[0],
    }
    report["rlf_envs"] = rlf_envs.__version__
    print(f"\nload average (1 min): {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end; {os.cpu_count()} CPUs")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp_path = args.json.with_suffix(".tmp")
        tmp_path.write_text(json.dumps(report, indent=2))
        tmp_path.replace(args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
