"""benchmarks/code_env.py measures what it says: every row's python calls really ran (a broken tool fails the run
instead of looking fast), and its no-guard ceiling, the bare fork server, runs code and reports exit statuses."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from repo_paths import REPO

pytestmark = pytest.mark.timeout(300)

ROOT = REPO
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.append(str(ROOT / "benchmarks"))  # after everything else: its modules shadow nothing


def test_the_bare_fork_server_runs_code_in_its_dir_and_reports_exit_statuses(tmp_path: Path) -> None:
    from bare_fork import BareForkServer

    programs = [
        ("print(int(open('data.txt').read()) + 1)", 0, "42"),
        ("import sys; print('bye', file=sys.stderr); sys.exit(3)", 3, "bye"),
        ("raise ValueError('boom')", 1, "ValueError: boom"),
        ("import os; os._exit(5)", 5, ""),
    ]

    async def run_all() -> list[tuple[str, int]]:  # concurrently: answers are matched to their calls
        dirs = []
        for i in range(len(programs)):
            d = tmp_path / f"run{i}"
            d.mkdir()
            (d / "data.txt").write_text("41")
            dirs.append(d)
        return await asyncio.gather(*(server.run(str(d), code) for d, (code, _, _) in zip(dirs, programs, strict=True)))

    with BareForkServer(("csv", "math")) as server:
        got = asyncio.run(run_all())
    for (out, status), (_, want_status, want_out) in zip(got, programs, strict=True):
        assert status == want_status
        assert want_out in out
    assert server.proc.returncode == 0  # closing the socket ends the server


def test_calls_waiting_on_a_dead_bare_fork_server_fail_instead_of_hanging(tmp_path: Path) -> None:
    from bare_fork import BareForkServer

    async def call_then_kill() -> None:
        call = asyncio.ensure_future(server.run(str(tmp_path), "import time; time.sleep(5)"))
        await asyncio.sleep(0.5)
        server.proc.kill()
        with pytest.raises(RuntimeError, match="exited"):
            await asyncio.wait_for(call, 20)

    with BareForkServer(()) as server:
        asyncio.run(call_then_kill())


def test_a_python_tool_that_fails_fails_the_benchmark() -> None:
    import code_env

    from rlf_envs.types import ToolStatus

    class Result:
        def __init__(self, status: ToolStatus, content: str) -> None:
            self.status, self.content = status, content

    def env(result: Result) -> Any:
        turn = type("Turn", (), {"results": [result]})
        task = type("Task", (), {"ground_truth": 42})
        return type("Env", (), {"trajectory": type("T", (), {"turns": [turn], "task": task})})

    code_env.python_ran(env(Result(ToolStatus.OK, "[stdout]\n42")))
    with pytest.raises(AssertionError):
        code_env.python_ran(env(Result(ToolStatus.ERROR, "Error: python failed: TypeError")))
    with pytest.raises(AssertionError):
        code_env.python_ran(env(Result(ToolStatus.OK, "[stdout]\n41")))


def test_code_env_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "code_env.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "code_env.py"), "--envs", "2", "--seconds", "0.2", "--rounds", "1",
         "--json", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT / "benchmarks",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(out.read_text())["code_env"]["rows"]["2"]
    for name in ("pool", "cold", "supervised", "plain", "bare", "sync", "instant"):
        assert row[f"{name}_steps_per_s"] > 0
    assert "of the bare fork server" in proc.stdout
