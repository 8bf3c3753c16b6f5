"""Event-loop stall while an MCP stdio server sends a huge reply: the SDK's stdio transport vs rlf's.

    python benchmarks/mcp_replies.py [--mb 50] [--json out/mcp_replies.json]

One server (tests/support/servers/misbehaving_mcp.py) answers `huge(n)` with an n-byte text. A 10 ms heartbeat runs
on the same loop; its longest gap is how long every other env on that loop was frozen. Rows: the SDK's
`stdio_client` (baseline), rlf's transport with its default 4 MB cap (the reply is dropped unparsed and
answered with an error), and rlf's transport with the cap raised above the reply (parsed off the loop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "tests" / "support" / "servers" / "misbehaving_mcp.py"


async def measure(transport: Any, n: int, deadline_s: float) -> dict[str, Any]:
    from mcp import Client

    longest = 0.0
    stop = False

    async def heartbeat() -> None:
        nonlocal longest
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            longest = max(longest, now - last)
            last = now

    async with Client(transport, read_timeout_seconds=deadline_s + 5) as client:
        await client.call_tool("echo", {"text": "warm-up"})
        hb = asyncio.ensure_future(heartbeat())
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(deadline_s):
                res = await client.call_tool("huge", {"n": n})
            outcome = f"ok ({len(res.content[0].text):,} chars)" if not res.is_error else "tool error"
        except TimeoutError:
            outcome = f"timed out ({deadline_s:g}s)"
        except Exception as e:
            outcome = f"error: {str(e)[:80]}"
        elapsed = time.perf_counter() - t0
        t1 = time.perf_counter()
        try:
            async with asyncio.timeout(deadline_s):
                nxt = await client.call_tool("echo", {"text": "next"})
            next_call = f"ok in {time.perf_counter() - t1:.2f}s" if not nxt.is_error else "error"
        except TimeoutError:
            next_call = f"timed out ({deadline_s:g}s)"
        stop = True
        await hb
    return {"outcome": outcome, "seconds": round(elapsed, 2), "longest_loop_stall_s": round(longest, 3),
            "next_call": next_call}


async def main_async(mb: float, deadline_s: float) -> list[dict[str, Any]]:
    from mcp.client.stdio import StdioServerParameters

    from rlf_envs.tools.mcp_stdio import BoundedStdioTransport

    n = int(mb * 1_000_000)
    rows = []
    cases: list[tuple[str, Any]] = [
        ("SDK stdio_client (baseline)", lambda: StdioServerParameters(command=sys.executable, args=[str(SERVER)])),
        ("rlf, max_reply_bytes=4 MB (default)", lambda: BoundedStdioTransport(sys.executable, [str(SERVER)])),
        (f"rlf, max_reply_bytes={2 * mb:g} MB", lambda: BoundedStdioTransport(
            sys.executable, [str(SERVER)], max_reply_bytes=int(2 * n + (1 << 20)))),
    ]
    for name, make in cases:
        row = {"transport": name, "reply_mb": mb, **await measure(make(), n, deadline_s)}
        rows.append(row)
        print(f"{name:<40} {row['outcome']:<28} {row['seconds']:>7.2f}s  stall {row['longest_loop_stall_s']:>6.3f}s"
              f"  next call: {row['next_call']}", flush=True)
    base = rows[0]["longest_loop_stall_s"]
    for r in rows:
        r["stall_vs_baseline"] = round(r["longest_loop_stall_s"] / base, 4) if base else None
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=float, default=50.0, help="reply size in MB")
    ap.add_argument("--deadline-s", type=float, default=30.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = asyncio.run(main_async(args.mb, args.deadline_s))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
