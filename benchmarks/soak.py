"""Hostile soak: N envs stepped for M minutes by a policy that does everything wrong, against tools that do too.

    python benchmarks/soak.py --minutes 5 --envs 64 --json out/soak.json

Actions (random mix): good tool calls, tool-call JSON nested 1,200 deep, integer literals of 5,000 digits,
hundreds of KB of unclosed `<tool_call>` / `<answer>` / `<think>` tags, lone surrogates, NUL bytes,
arguments of the wrong type, unknown tools, answers. Tools: an MCP stdio server
(tests/support/servers/misbehaving_mcp.py) that sleeps past deadlines, blocks, crashes, answers with up to 8 MB,
streams a reply that never ends, and starts children (a shell pipeline, a `setsid` daemon holding its
pipes, a process in its own group); Python tools that are slow, hang a thread, raise, return huge text or
lone surrogates. Text mode.

Reported: steps, steps/s, exceptions that escaped `step` (must be 0), tool outcomes, MCP restarts,
leftover processes after `close_all()` (must be 0), peak and final RSS, and the longest stall of rlf's
event loop (a 10 ms heartbeat on it; must stay below the tool deadlines).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "tests" / "support" / "servers" / "misbehaving_mcp.py"


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _call(name: str, **args: Any) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call><|im_end|>'


def hostile_action(rng: random.Random) -> str:
    """One policy turn, mostly hostile."""
    r = rng.random()
    if r < 0.20:  # well-formed calls to the misbehaving MCP tools
        choice = rng.random()
        if choice < 0.004:
            return _call("mcp_crash")
        if choice < 0.008:
            return _call("mcp_spawn")
        if choice < 0.010:
            return _call("mcp_flood", seconds=3)
        if choice < 0.15:
            return _call("mcp_slow", seconds=rng.choice([0.01, 0.5, 5]))
        if choice < 0.20:
            return _call("mcp_blocking_sleep", seconds=0.3)
        if choice < 0.35:
            return _call("mcp_huge", n=rng.choice([1000, 300_000, 3_000_000, 8_000_000]))
        if choice < 0.45:
            return _call("mcp_fail", message="kaboom")
        return _call("mcp_echo", text="x" * rng.randint(1, 2000))
    if r < 0.35:  # well-formed calls to misbehaving Python tools
        return rng.choice([
            _call("py_slow", seconds=rng.choice([0.01, 0.2, 5])),
            _call("py_hang"),
            _call("py_raise"),
            _call("py_huge", n=rng.choice([100, 100_000, 2_000_000])),
            _call("py_surrogate"),
        ])
    if r < 0.45:
        return '<tool_call>{"name": "mcp_echo", "arguments": {"text": ' + "[" * 1200 + "]" * 1200 + "}}</tool_call>"
    if r < 0.52:
        return '<tool_call>{"name": "mcp_echo", "arguments": {"text": ' + "9" * 5000 + "}}</tool_call>"
    if r < 0.60:
        return "<tool_call>" * rng.randint(1000, 30_000)
    if r < 0.66:
        return "<answer>" * rng.randint(1000, 30_000)
    if r < 0.70:
        return "<think>" * 10_000 + "<tool_call>{" * 5000
    if r < 0.76:
        return _call("nope", x=1)
    if r < 0.82:
        return _call("mcp_echo", text=["not", "a", "string"])
    if r < 0.86:
        return '<tool_call>{"name": "mcp_echo", "arguments": {"text": "\\ud800\\u0000"}}</tool_call>'
    if r < 0.90:
        return "".join(rng.choice("<>{}[]\"\\/_:,tool_call answer\x00\ud800é") for _ in range(rng.randint(0, 3000)))
    return "<answer>alpha</answer><|im_end|>"


def python_tools() -> list[Any]:
    from rlf_envs.tools import tool

    @tool(timeout_s=1.0)
    async def py_slow(seconds: float) -> str:
        """Sleep."""
        await asyncio.sleep(seconds)
        return "slept"

    @tool(timeout_s=0.5)
    def py_hang() -> str:
        """Block a worker thread for 2 s (past the deadline)."""
        time.sleep(2)
        return "woke"

    @tool
    def py_raise() -> str:
        """Raise."""
        raise RuntimeError("python tool failure")

    @tool
    def py_huge(n: int) -> str:
        """n characters."""
        return "y" * min(n, 5_000_000)

    @tool
    def py_surrogate() -> str:
        """A lone surrogate."""
        return json.loads('"bad \\ud800 text"')

    return [py_slow, py_hang, py_raise, py_huge, py_surrogate]


async def soak(minutes: float, n_envs: int, seed: int) -> dict[str, Any]:
    from rlf_envs import runtime
    from rlf_envs.env import ToolVectorEnv
    from rlf_envs.tools import mcp_stdio

    mcp = {"mcpServers": {"bad": {
        "command": sys.executable, "args": [str(SERVER)], "timeout": 2.0, "prefix": "mcp_",
        "max_reply_bytes": 4 << 20, "idempotent": ["echo", "pid"], "startup_timeout_s": 30,
    }}}
    tasks = [{"id": "t", "question": "Say alpha", "answer": "alpha"}]
    venv = ToolVectorEnv(num_envs=n_envs, tools=python_tools(), mcp_servers=mcp, tasks=tasks, max_turns=6,
                         max_total_tokens=400_000, caller={"timeout_s": 3.0, "max_retries": 1})
    rng = random.Random(seed)
    leaders: set[int] = set()
    stall = {"longest": 0.0}
    stop = asyncio.Event()

    async def heartbeat() -> None:  # runs on rlf's loop: its longest gap is the longest loop stall
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            stall["longest"] = max(stall["longest"], now - last)
            last = now
            leaders.update(mcp_stdio._live)

    hb = asyncio.run_coroutine_threadsafe(heartbeat(), runtime.get_loop())
    steps = escaped = episodes = 0
    errors: list[str] = []
    rss_peak = rss_first_min = 0.0
    t0 = time.monotonic()
    end = t0 + minutes * 60
    await venv.areset_envs({i: {"task_index": 0} for i in range(n_envs)})
    while time.monotonic() < end:
        active = venv.active
        try:
            res = await venv.astep_active({i: hostile_action(rng) for i in active})
            steps += len(res)
        except Exception as e:  # must never happen
            escaped += 1
            errors.append(f"{type(e).__name__}: {str(e)[:200]}")
            res = {}
        done = [i for i in range(n_envs) if venv.envs[i].done]
        episodes += len(done)
        if done:
            await venv.areset_envs({i: {"task_index": 0} for i in done})
        rss = _rss_mb()
        rss_peak = max(rss_peak, rss)
        if time.monotonic() - t0 < 60:
            rss_first_min = max(rss_first_min, rss)
    elapsed = time.monotonic() - t0
    metrics = venv.envs[0].toolbox.metrics.total
    from rlf_envs.tools.mcp import _shared

    restarts = sum(s.restarts for s in _shared.values())
    leaders.update(mcp_stdio._live)
    t_close = time.monotonic()
    from rlf_envs import close_all

    await asyncio.to_thread(close_all)
    close_s = time.monotonic() - t_close
    stop.set()
    await asyncio.wrap_future(hb)
    await asyncio.sleep(1.0)
    leftovers = _leftovers(leaders)
    return {
        "minutes": round(elapsed / 60, 2), "envs": n_envs, "steps": steps, "steps_per_s": round(steps / elapsed, 1),
        "episodes": episodes, "exceptions_out_of_step": escaped, "exception_samples": errors[:5],
        "tool_calls": metrics.calls, "tool_ok": metrics.ok, "tool_timeouts": metrics.timeouts,
        "tool_crashed": metrics.crashed, "tool_errors": metrics.errors, "tool_truncated": metrics.truncated,
        "calls_per_tool": {k: v.calls for k, v in sorted(venv.envs[0].toolbox.metrics.per_tool.items())},
        "mcp_restarts": restarts, "mcp_server_processes_seen": len(leaders), "close_all_s": round(close_s, 2),
        "leftover_processes": leftovers, "peak_rss_mb": round(rss_peak, 1),
        "peak_rss_first_minute_mb": round(rss_first_min, 1), "final_rss_mb": round(_rss_mb(), 1),
        "ru_maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "longest_loop_stall_s": round(stall["longest"], 3),
    }


def _leftovers(leaders: set[int]) -> list[str]:
    """Processes still running that came from us: our children, and members of any MCP server's session."""
    from rlf_envs.tools.procs import _alive, tree_members

    me = os.getpid()
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                if int(fields[1]) == me and _alive(int(name)):
                    found.add(int(name))
            except (OSError, IndexError, ValueError):
                pass
    for leader in leaders:
        found.update(p for p in tree_members(leader) if _alive(p))
    out = []
    for pid in sorted(found):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            out.append(f"{pid}: {cmd[:100]}")
        except OSError:
            out.append(str(pid))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--envs", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    report = asyncio.run(soak(args.minutes, args.envs, args.seed))
    for k, v in report.items():
        print(f"{k:>28}: {v}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    ok = report["exceptions_out_of_step"] == 0 and not report["leftover_processes"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
