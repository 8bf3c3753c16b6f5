"""Code verifier: answers run against tests in a limited subprocess; hostile code must not harm the host."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from rlf_envs.rewards import CodeVerifier, build_verifier, run_sandboxed
from rlf_envs.rewards.code import extract_code
from rlf_envs.types import Task, Trajectory

pytestmark = pytest.mark.rewards

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]


def traj(answer: str | None, tests: object = TESTS, tid: str = "c1") -> Trajectory:
    return Trajectory(Task(tid, "write add(a, b)", tests), "P", [], answer)


async def run(v: CodeVerifier, answer: str | None, tests: object = TESTS) -> tuple[float, dict[str, float]]:
    t = traj(answer, tests)
    s = await v.safe_score(t, t.task)
    return s.value, s.info


def fast(**kw: object) -> CodeVerifier:
    # generous limits: a loaded CI machine may take seconds to start a sandboxed interpreter; tests of a
    # limit set that limit low themselves
    return CodeVerifier(**{"timeout_s": 60.0, "cpu_s": 20, **kw})


def test_extract_code() -> None:
    assert extract_code("Sure:\n```python\ndef f(): pass\n```\nDone") == "def f(): pass\n"
    assert extract_code("```py\na=1\n```\n```python\nb=2\n```") == "b=2\n"
    assert extract_code("x = 1") == "x = 1"


@pytest.mark.asyncio
async def test_pass_partial_fail() -> None:
    v = fast()
    assert (await run(v, "def add(a, b):\n    return a + b\n"))[0] == 1.0
    value, info = await run(v, "def add(a, b):\n    return int(a) + int(b)\n")  # fails the string test
    assert value == pytest.approx(2 / 3) and info["code/passed"] == 2 and info["code/total"] == 3
    assert (await run(fast(partial_credit=False), "def add(a, b):\n    return int(a) + int(b)\n"))[0] == 0.0
    assert (await run(v, "```python\ndef add(a, b):\n    return a + b\n```"))[0] == 1.0
    assert (await run(v, "def add(a, b) return a + b"))[0] == 0.0  # syntax error
    good = "def add(a, b):\n    return a + b\n"
    assert (await run(v, good, "assert add(2, 2) == 4\nassert add(0, 0) == 0"))[0] == 1.0
    # tests can also import the solution as a module
    assert (await run(v, good, ["from solution import add\nassert add(1, 1) == 2"]))[0] == 1.0
    assert (await run(v, None))[1]["code/no_answer"] == 1.0


@pytest.mark.asyncio
async def test_tests_from_meta_and_bad_tests_fall_back(caplog: pytest.LogCaptureFixture) -> None:
    v = build_verifier({"type": "code", "tests_key": "tests", "fallback": -1, "timeout_s": 5})
    t = Trajectory(Task("m1", "?", None, meta={"tests": {"tests": ["assert f() == 1"]}}), "P", [], "def f(): return 1")
    assert (await v.safe_score(t, t.task)).value == 1.0
    bad = Trajectory(Task("no-tests-5", "?", None, meta={}), "P", [], "def f(): return 1")
    assert (await v.safe_score(bad, bad.task)).value == -1
    assert "no-tests-5" in caplog.text


@pytest.mark.asyncio
async def test_cheating_does_not_pass() -> None:
    v = fast()
    early_exit = "import os\nprint('all tests passed')\nos._exit(0)"
    assert (await run(v, early_exit))[0] == 0.0
    sys_exit = "import sys\nsys.exit(0)"
    assert (await run(v, sys_exit))[0] == 0.0
    fake_line = "print('deadbeef [true, true, true]')\ndef add(a, b): return None"
    assert (await run(v, fake_line))[0] == 0.0
    # redirecting stdout does not hide or fake the result (reported on a saved fd)
    redirect = "import sys, io\nsys.stdout = io.StringIO()\ndef add(a, b): return a + b"
    assert (await run(v, redirect))[0] == 1.0


@pytest.mark.asyncio
async def test_infinite_loops_hit_the_deadline() -> None:
    v = fast(timeout_s=1.0, cpu_s=1000)
    for code in ["while True:\n    pass", "import time\ntime.sleep(1000)", "def add(a, b):\n    while True: pass"]:
        t0 = time.monotonic()
        value, info = await run(v, code)
        assert value == 0.0 and info["code/timeout"] == 1.0, code
        assert time.monotonic() - t0 < 120.0  # the deadline fired (a generous bound: the code runs 1000 s)


@pytest.mark.asyncio
async def test_cpu_limit_kills_busy_loop_before_wall_deadline() -> None:
    # the CPU limit (1 s) ends the loop, not the wall deadline (reported as code/timeout), however slowly a
    # loaded machine hands out that CPU second
    value, info = await run(fast(timeout_s=600.0, cpu_s=1), "while True:\n    pass")
    assert value == 0.0 and info["code/no_report"] == 1.0 and info["code/timeout"] == 0.0


@pytest.mark.asyncio
async def test_memory_bomb_is_contained() -> None:
    v = fast(memory_mb=256)
    value, info = await run(v, "blob = bytearray(8 * 1024**3)\ndef add(a, b): return a + b")
    assert value == 0.0
    # a bomb inside one test only fails that test
    value, info = await run(v, "def add(a, b):\n    return a + b\n",
                            ["x = [0] * (10 ** 10)", "assert add(1, 2) == 3"])
    assert value == 0.5 and info["code/passed"] == 1


@pytest.mark.asyncio
async def test_huge_output_is_capped() -> None:
    v = fast(max_output_bytes=4096)
    value, info = await run(v, "while True:\n    print('x' * 10000)")
    assert value == 0.0 and info["code/output_limit"] == 1.0 and info["code/timeout"] == 0.0  # cut, not timed out
    value, info = await run(v, "import sys\nwhile True:\n    sys.stderr.write('y' * 10000)")
    assert value == 0.0 and info["code/output_limit"] == 1.0


@pytest.mark.asyncio
async def test_file_size_limit_and_temp_dir_cleanup(tmp_path: Path) -> None:
    before = set(os.listdir("/tmp"))
    v = fast(file_mb=1)
    bomb = "with open('big.bin', 'wb') as f:\n    f.write(b'0' * (50 * 1024 * 1024))\ndef add(a, b): return a + b"
    assert (await run(v, bomb))[0] == 0.0
    leftovers = [p for p in set(os.listdir("/tmp")) - before if p.startswith("rlf_code_")]
    assert leftovers == []


@pytest.mark.asyncio
async def test_forked_children_are_killed() -> None:
    solution = (
        "import os, sys, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "print('CHILD', pid, file=sys.stderr, flush=True)\n"
        "def add(a, b): return a + b\n"
    )
    out = await run_sandboxed(solution, TESTS, timeout_s=60.0)
    assert out.results == [True, True, True]
    m = re.search(r"CHILD (\d+)", out.stderr_tail)
    assert m, out.stderr_tail
    pid = int(m.group(1))
    deadline = time.monotonic() + 60  # generous: the child is killed at once, a loaded machine may lag
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            break  # gone
        if "State:\tZ" in state:
            break  # dead, waiting for init to reap it
        time.sleep(0.05)
    else:
        pytest.fail(f"forked child {pid} survived")


@pytest.mark.asyncio
async def test_environment_is_scrubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLF_TEST_SECRET_KEY", "hunter2")
    check = ["import os\nassert 'RLF_TEST_SECRET_KEY' not in os.environ",
             "import os\nassert os.getcwd() == os.environ['HOME']"]
    assert (await run(fast(), "x = 1", check))[0] == 1.0


@pytest.mark.asyncio
async def test_batch_runs_concurrently() -> None:
    v = fast(max_concurrency=4)
    trajs = [traj("import time\ntime.sleep(6)\ndef add(a, b): return a + b", tid=f"b{i}") for i in range(4)]
    t0 = time.monotonic()
    scores = await v.score_batch(trajs)
    assert [s.value for s in scores] == [1.0] * 4
    # one after another the four take >= 24 s; together ~6 s plus start-up (a generous bound for a busy machine)
    assert time.monotonic() - t0 < 20.0
