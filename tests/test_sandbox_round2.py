"""The second outside attack round on the sandbox (issue 40): one hostile episode must never break the batch or the
host. Each attack goes through the direct-worker, supervised and cold paths where it applies:

1. a deep directory tree (and directories of mode 000) left in the work dir: `run_python`, `run_tests`, the Code
   env's `step` and `close`, the vector env beside honest envs, `SandboxPool.close()` and the zygote's clean-up
   never raise, a correct solution still scores, and nothing stays on disk;
3. socket families a run does not need (AF_VSOCK, AF_NETLINK, AF_PACKET, ...) are refused, for `socket` and
   `socketpair`, and io_uring (which creates sockets without the `socket` call) is refused;
4. a solution's exception never reaches the tests as control flow (StopIteration, StopAsyncIteration,
   GeneratorExit, KeyboardInterrupt, SystemExit): `all(map(f, xs))` and its kin fail;
5. the memory limit holds for the whole run (every process of it), not per process.
"""

from __future__ import annotations

import asyncio
import os
import socket
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest

import rlf_envs  # noqa: F401 - registers the ids
from rlf_envs import runtime
from rlf_envs.sandbox import SandboxDir, SandboxLimits, SandboxPool, SandboxResult, cleanup, default_pool, run_python
from rlf_envs.sandbox import run_tests
from rlf_envs.types import Task

pytestmark = [pytest.mark.envs, pytest.mark.timeout(300)]

FAST = SandboxLimits(timeout_s=30.0, cpu_s=20, file_mb=4, memory_mb=256)
#: a tree deeper than Python's recursion limit (and than PATH_MAX: 3000 levels of "d/"), then mode 000 on the way
DEEP_TREE = textwrap.dedent("""
    import os
    top = os.getcwd()
    for i in range(3000):
        os.mkdir("d")
        os.chdir("d")
    open("leaf", "w").write("x")
    os.chdir(top)
    for i in range(3):
        os.makedirs(f"locked{i}/inner")
        open(f"locked{i}/inner/f", "w").write("y" * 1000)
        os.chmod(f"locked{i}/inner", 0)
        os.chmod(f"locked{i}", 0)
    os.mkfifo("fifo")
""")


@pytest.fixture(scope="module", params=["direct", "supervised", "cold"])
def pool(request: pytest.FixtureRequest) -> Iterator[SandboxPool | bool]:
    if request.param == "cold":
        yield False
        return
    with SandboxPool(size=2, direct=request.param == "direct") as p:
        yield p


def run(code: str, pool: SandboxPool | bool, limits: SandboxLimits = FAST, **kw: Any) -> SandboxResult:
    r = asyncio.run(run_python(code, "", limits, pool=pool, **kw))
    assert r.error is None, r
    return r


def _sandbox_dirs(parent: str) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith(("rlf_sbx_", cleanup.TRASH_PREFIX)))


# ------------------------------------------------------------------------------------------ item 1: clean-up


def test_a_deep_tree_neither_raises_nor_stays_run_python(pool: SandboxPool | bool) -> None:
    base = default_pool().base_dir  # type: ignore[union-attr]
    before = _sandbox_dirs(base)
    r = run(DEEP_TREE + "print('built')", pool)
    assert r.stdout.strip() == "built" and r.exit_code == 0, r
    assert cleanup.flush(120)
    assert _sandbox_dirs(base) == before


def test_a_correct_solution_that_builds_a_deep_tree_still_scores(pool: SandboxPool | bool) -> None:
    base = default_pool().base_dir  # type: ignore[union-attr]
    before = _sandbox_dirs(base)
    solution = DEEP_TREE + "def add(a, b):\n    return a + b\n"
    r = asyncio.run(run_tests(solution, ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"], FAST, pool=pool))
    assert r.test_results == (True, True), r
    assert cleanup.flush(120)
    assert _sandbox_dirs(base) == before


def test_a_kept_work_dir_with_a_deep_tree_is_removed_off_the_call(pool: SandboxPool | bool) -> None:
    d = SandboxDir(FAST.drop_privileges)
    run(DEEP_TREE, pool, workdir=d)
    d.write("d", "a file where the run left a directory tree")  # replaces the tree: never raises
    assert (d.path / "d").read_text().startswith("a file")
    d.remove()
    assert not d.root.exists()
    assert cleanup.flush(120)


def test_pool_close_and_the_zygote_clean_up_survive_a_deep_tree() -> None:
    p = SandboxPool(size=1)
    d = SandboxDir(FAST.drop_privileges, parent=p.base_dir)
    run(DEEP_TREE, p, workdir=d)
    zygote = p.zygote_pid
    assert zygote is not None
    p.close()  # never raises
    assert not os.path.exists(p.base_dir)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{zygote}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{zygote}")
    assert cleanup.flush(120)
    parent = os.path.dirname(p.base_dir)
    assert not [n for n in os.listdir(parent) if n.startswith(f"{cleanup.TRASH_PREFIX}{os.getpid()}_")]


def test_a_hostile_episode_does_not_break_the_vector_batch() -> None:
    """Env 0 builds the deep tree (and mode-000 dirs) in its episode's work dir, envs 1 and 2 are honest; the whole
    batch steps, every env is scored (the hostile one too: its answer is right), every work dir is gone."""
    from rlf_envs.envs.code import CodeEnv  # noqa: F401 - (the id's entry point)

    tasks = [Task(f"t{k}", "Print 1.", "1", meta={"check": "numeric"}) for k in range(3)]
    venv = gym.make_vec("rlf/Code-v0", num_envs=3, tasks=tasks, limits=FAST)
    envs = list(venv.envs)  # type: ignore[attr-defined]

    def call(code: str) -> str:
        import json

        return f"<tool_call>\n{json.dumps({'name': 'python', 'arguments': {'code': code}})}\n</tool_call><|im_end|>"

    async def episode() -> tuple[list[Any], list[Any]]:
        await venv.areset_envs({k: {"task_index": k} for k in range(3)})  # type: ignore[attr-defined]
        await venv.astep_active({0: call(DEEP_TREE + "print(1)"), 1: call("print(1)"),  # type: ignore[attr-defined]
                                 2: call("print(1)")})
        dirs = [e.workdir for e in envs]
        done = await venv.astep_active({k: "<answer>1</answer><|im_end|>" for k in range(3)})  # type: ignore
        return dirs, [done[k] for k in range(3)]

    dirs, done = runtime.run(episode())
    assert [d.reward for d in done] == [1.0, 1.0, 1.0] and all(d.terminated for d in done)
    assert all(d is not None and not d.root.exists() for d in dirs)
    venv.close()
    assert cleanup.flush(120)
