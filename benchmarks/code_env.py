"""rlf/Code-v0 env steps per second: the warm sandbox pool against the cold path, in the same run.

    python benchmarks/code_env.py [--envs 16 64] [--seconds 5] [--rounds 3] [--json out/code_env.json]

Each episode is scripted: python(reference program) -> answer(its printed value), i.e. two steps, one sandboxed
Python run (every guard: namespaces, per-run uid, rlimits, whole-tree kill) and one verifier run (numeric /
exact match; "write a function" tasks are skipped so that every episode costs the same). Steps/s through a
ToolVectorEnv of N Code-v0 envs (all calls of a step concurrently, up to the tool's max_concurrency, default
the CPU count), for:
  - pool:    CodeEnv(pool=True), the default: as root a python call is one fork of the warm zygote (a direct worker,
             `rlf_envs.sandbox.pool`); otherwise a warm supervisor and its forked worker
  - supervised: the same through a pool with direct workers off (`SandboxPool(direct=False)`: what a non-root
             trainer gets; the pool before direct workers)
  - cold:    CodeEnv(pool=False), the path before the pool: a new supervisor interpreter + worker interpreter per call
  - plain:   CodeEnv whose python tool is a plain `python -I main.py` fork+exec in the episode's dir, with no guard
             at all (no namespaces, uid, rlimits, deadline kill): what the same calls cost without a sandbox
  - bare fork: CodeEnv whose python tool is a fork of a warm interpreter that execs the code with no guard at all
             (`bare_fork.py`): the ceiling of any fork-per-run design; what a sandbox costs is its gap to this row
  - sync:    gymnasium SyncVectorEnv over the same pooled CodeEnvs (one env after another)
  - instant: Tools-v0 envs with an instant Python tool: the env machinery alone, the floor
Every episode is checked: the python call succeeded and printed the answer, and the answer was verified.
Also printed: the reference programs' own CPU time (each run in this process once, `exec`, in its files' dir),
which bounds any sandbox: N cores / (CPU per program) runs/s, even with a free sandbox and a free env.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
from bare_fork import BareForkServer
from scripted_env import compare_rows, report, tool_call

import rlf_envs.envs.code as code_module
from rlf_envs.env import ToolVectorEnv
from rlf_envs.envs.code import CodeEnv, code_tasks
from rlf_envs.sandbox import SandboxPool, SandboxResult, default_pool
from rlf_envs.tools.interpreter import PythonInterpreter
from rlf_envs.types import Task, ToolStatus


def tasks() -> list[Task]:
    return [t for t in code_tasks("train") if t.meta["check"] != "tests"]


def script(env: Any) -> list[str]:
    task = env.trajectory.task
    return [tool_call("python", code=str(task.meta["program"])), f"<answer>{task.ground_truth}</answer><|im_end|>"]


class PlainInterpreter(PythonInterpreter):
    """The python tool without a sandbox: `python -I main.py` (fork+exec) in the episode's work dir, output read
    whole. For this benchmark only: it has none of the sandbox's guards."""

    async def call(self, arguments: dict[str, Any], context: Any = None) -> str:
        workdir = context  # the episode's SandboxDir, bound by Code-v0
        workdir.write("main.py", arguments["code"])
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "main.py", cwd=workdir.path, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        return self.render(SandboxResult(stdout=out.decode(), stderr=err.decode(), exit_code=proc.returncode))


class BareForkInterpreter(PythonInterpreter):
    """The python tool as one fork of a warm interpreter per call, with no guard (`bare_fork.BareForkServer`)."""

    def __init__(self, server: BareForkServer, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server = server

    async def call(self, arguments: dict[str, Any], context: Any = None) -> str:
        workdir = context  # the episode's SandboxDir, bound by Code-v0
        out, status = await self.server.run(str(workdir.path), arguments["code"])
        return self.render(SandboxResult(stdout=out, stderr="", exit_code=status))


def code_env_with(tool: Callable[[Any, int], PythonInterpreter], **kwargs: Any) -> CodeEnv:
    """A Code-v0 env whose python tool is `tool(limits, max_output_chars)` instead of the default one."""
    real = code_module.python_tool
    code_module.python_tool = lambda limits, chars, _: tool(limits, chars)
    try:
        return CodeEnv(pool=True, **kwargs)
    finally:
        code_module.python_tool = real


def supervised_code_env(pool: SandboxPool, **kwargs: Any) -> CodeEnv:
    """A Code-v0 env whose python tool runs every call through a supervisor of `pool` (direct workers off)."""
    return code_env_with(lambda limits, chars: PythonInterpreter(limits, max_output_chars=chars, pool=pool), **kwargs)


def plain_code_env(**kwargs: Any) -> CodeEnv:
    """A Code-v0 env whose python tool is `PlainInterpreter` (same concurrency as the pooled tool)."""
    return code_env_with(lambda limits, chars: PlainInterpreter(limits, max_output_chars=chars, pool=True), **kwargs)


def bare_fork_code_env(server: BareForkServer, **kwargs: Any) -> CodeEnv:
    """A Code-v0 env whose python tool is `BareForkInterpreter` on `server` (same concurrency as the pooled tool)."""
    return code_env_with(
        lambda limits, chars: BareForkInterpreter(server, limits, max_output_chars=chars, pool=True), **kwargs)


def program_cpu_ms(tasks: list[Task]) -> float:
    """Mean CPU milliseconds of the reference programs themselves (exec'd here, each in a dir with its files)."""
    total = 0.0
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="rlf_bench_") as d:
        os.chdir(d)
        try:
            for t in tasks:
                for name, text in (t.meta.get("files") or {}).items():
                    with open(name, "w") as f:
                        f.write(str(text))
                c0 = time.process_time()
                with contextlib.redirect_stdout(io.StringIO()):
                    exec(compile(str(t.meta["program"]), "main.py", "exec"), {"__name__": "__main__"})
                total += time.process_time() - c0
        finally:
            os.chdir(cwd)
    return 1000 * total / len(tasks)


def all_verified(rewards: Any) -> None:
    assert (rewards == 1.0).all(), rewards  # every scripted episode is verified correct


def python_ran(env: Any) -> None:
    """The episode's python call succeeded and printed the answer (the scripted answer is verified whatever the
    tool said, so a broken tool would otherwise go unnoticed, and look fast)."""
    (result,) = env.trajectory.turns[0].results
    assert result.status is ToolStatus.OK, result
    assert str(env.trajectory.task.ground_truth) in result.content, (result.content, env.trajectory.task.ground_truth)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3, help="measurements of each rate, interleaved (median)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    secs = args.seconds
    kwargs: dict[str, Any] = {"tasks": tasks(), "max_turns": 4, "max_total_tokens": 1 << 30}
    pool = default_pool()
    if pool is None:
        raise SystemExit("RLF_SANDBOX_POOL=0 turns the pool off: unset it to compare")

    def venv(cls: Any, pooled: bool) -> Callable[[int], Any]:
        return lambda n: cls([lambda: CodeEnv(pool=pooled, **kwargs) for _ in range(n)])

    def plain(n: int) -> Any:
        return ToolVectorEnv([lambda: plain_code_env(**kwargs) for _ in range(n)])

    supervised_pool = SandboxPool(pool.size, direct=False)
    bare = BareForkServer(pool.preload)

    def supervised(n: int) -> Any:
        return ToolVectorEnv([lambda: supervised_code_env(supervised_pool, **kwargs) for _ in range(n)])

    rows = compare_rows(args.envs, {"pool": venv(ToolVectorEnv, True), "cold": venv(ToolVectorEnv, False),
                                    "supervised": supervised, "plain": plain,
                                    "bare": lambda n: ToolVectorEnv([lambda: bare_fork_code_env(bare, **kwargs)
                                                                     for _ in range(n)]),
                                    "sync": venv(gym.vector.SyncVectorEnv, True)},
                        secs, args.rounds, script, all_verified, steps=2, max_turns=4, check_env=python_ran)
    supervised_pool.close()
    bare.close()
    labels = {"pool": "Code-v0, warm pool (pool=True, default)", "cold": "Code-v0, cold (pool=False, before)",
              "supervised": "Code-v0, warm pool, every run supervised",
              "plain": "Code-v0, plain fork+exec, no sandbox",
              "bare": "Code-v0, bare fork server, no guard",
              "sync": "gymnasium SyncVectorEnv, pooled Code-v0", "instant": "Tools-v0, instant tool (floor)"}
    cpus = len(os.sched_getaffinity(0))
    prog_ms = program_cpu_ms(kwargs["tasks"])
    report("Code-v0", "code", "2-step episodes (1 sandboxed python run + verified answer)", rows, labels, args.json,
           after="pool", before="cold", extra={"pool_size": pool.size, "cpus": cpus, "program_cpu_ms": prog_ms,
                                                "load_avg_1m_at_end": os.getloadavg()[0]})
    bound = 2 * cpus * 1000 / prog_ms  # steps/s: 2 steps per run
    print(f"\nThe programs themselves: {prog_ms:.2f} ms of CPU per run (mean over {len(kwargs['tasks'])} tasks), so "
          f"{cpus} CPUs give at most {bound:,.0f} steps/s even with a free sandbox and a free env")
    for n, rates in rows.items():
        print(f"  {n} envs: pool at {rates['pool'] / rates['supervised']:.2f}x of the supervised pool, "
              f"{rates['pool'] / rates['plain']:.2f}x of plain fork+exec, {rates['pool'] / rates['bare']:.2f}x of "
              f"the bare fork server (the ceiling of forking, itself {rates['bare'] / rates['cold']:.2f}x the cold "
              f"path); that bound is {bound / rates['cold']:.1f}x the cold path")


if __name__ == "__main__":
    main()
