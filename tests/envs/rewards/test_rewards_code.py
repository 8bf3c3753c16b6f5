"""Code verifier: answers run against tests in a limited subprocess; hostile code must not harm the host."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rlf_envs.rewards import CodeVerifier, build_verifier
from rlf_envs.rewards.code import extract_code
from rlf_envs.types import Task, Trajectory

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]


def traj(answer: str | None, tests: object = TESTS, tid: str = "c1") -> Trajectory:
    return Trajectory(Task(tid, "write add(a, b)", tests), "P", [], answer)


async def run(v: CodeVerifier, answer: str | None, tests: object = TESTS) -> tuple[float, dict[str, float]]:
    t = traj(answer, tests)
    s = await v.safe_score(t, t.task)
    return s.value, s.info


def fast(**kw: object) -> CodeVerifier:
    return CodeVerifier(**{"timeout_s": 5.0, "cpu_s": 5, **kw})


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
    v = fast(timeout_s=1.0, cpu_s=10)
    for code in ["while True:\n    pass", "import time\ntime.sleep(100)", "def add(a, b):\n    while True: pass"]:
        t0 = time.monotonic()
        value, info = await run(v, code)
        assert value == 0.0 and info["code/timeout"] == 1.0, code
        assert time.monotonic() - t0 < 60.0  # a hang guard, not a speed claim


@pytest.mark.asyncio
async def test_cpu_limit_kills_busy_loop_before_wall_deadline() -> None:
    # the CPU limit (1 s) ends the loop, not the wall deadline (reported as code/timeout), however slowly a
    # loaded machine hands out that CPU second
    value, info = await run(fast(timeout_s=600.0, cpu_s=1), "while True:\n    pass")
    assert value == 0.0 and info["code/timeout"] == 0.0


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
    assert value == 0.0 and info["code/output_limit"] == 1.0 and info["code/timeout"] == 0.0
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
async def test_batch_runs_concurrently(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to max_concurrency sandboxes at once (counted, not timed)."""
    import rlf_envs.rewards.code as code_mod

    inner, live, peak = code_mod.run_tests, [0], [0]

    async def counting(*a: object, **k: object) -> object:
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        try:
            return await inner(*a, **k)  # type: ignore[arg-type]
        finally:
            live[0] -= 1

    monkeypatch.setattr(code_mod, "run_tests", counting)
    v = fast(max_concurrency=3)
    trajs = [traj("import time\ntime.sleep(0.5)\ndef add(a, b): return a + b", tid=f"b{i}") for i in range(6)]
    scores = await v.score_batch(trajs)
    assert [s.value for s in scores] == [1.0] * 6
    assert peak[0] == 3


# ---- hostile solutions: each of these forged a pass, leaked or escaped with the old in-interpreter harness ----

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]


FRAME_WALK = """
import sys
def add(a, b):
    # read the expected value out of the caller's (the test's) code object
    f = sys._getframe(1)
    consts = [c for c in f.f_code.co_consts if c is not None and c not in (a, b) and type(c) is type(a)]
    return consts[-1] if consts else None
"""

FORGE_RESULT_LINE = """
import gc, os, re, sys
found = set()
f = sys._getframe()
while f is not None:
    for d in (f.f_locals, f.f_globals):
        for v in list(d.values()):
            if isinstance(v, str) and re.fullmatch("[0-9a-f]{16,64}", v):
                found.add(v)
    f = f.f_back
for o in gc.get_objects():
    if isinstance(o, dict):
        for v in list(o.values()):
            if isinstance(v, str) and re.fullmatch("[0-9a-f]{16,64}", v):
                found.add(v)
lines = [f"\\n{t} [true, true, true]\\n" for t in found]
lines += ['\\n{"results": [true, true, true], "errors": ["", "", ""], "nonce": "%s"}\\n' % t for t in found]
lines += ['\\n{"ok": 3}\\n'] * 3
for line in lines:
    for fd in range(256):
        try:
            os.write(fd, line.encode())
        except OSError:
            pass
os._exit(0)
"""

REPLACE_BUILTINS = """
import builtins, os, sys
builtins.exec = lambda *a, **k: None
builtins.compile = lambda *a, **k: None
sys.exit = lambda *a: None
os._exit = lambda *a: None
def add(a, b):
    return None
"""

ALWAYS_EQUAL = """
class Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = object.__hash__
def add(a, b):
    return Anything()
"""

CLOSE_AND_REOPEN_FDS = """
import os
for fd in (0, 1, 2):
    os.close(fd)
for path in ("/dev/tty", "/proc/self/fd/1", "/proc/1/fd/1"):
    try:
        fd = os.open(path, os.O_WRONLY)
        os.write(fd, b"all tests passed\\n")
    except OSError:
        pass
def add(a, b):
    return None
"""


@pytest.mark.asyncio
@pytest.mark.parametrize("attack", ["frame_walk", "forge_result_line", "replace_builtins", "always_equal"])
async def test_a_solution_cannot_forge_a_pass(attack: str) -> None:
    code = {"frame_walk": FRAME_WALK, "forge_result_line": FORGE_RESULT_LINE,
            "replace_builtins": REPLACE_BUILTINS, "always_equal": ALWAYS_EQUAL}[attack]
    value, info = await run(fast(), code, ADD_TESTS)
    assert value == 0.0, (attack, info)
    assert info["code/passed"] == 0


@pytest.mark.asyncio
async def test_closing_descriptors_and_early_exit_do_not_pass() -> None:
    v = fast()
    for code in [CLOSE_AND_REOPEN_FDS, "import os\nos._exit(0)", "import sys\nsys.exit(0)",
                 "def add(a, b):\n    import os\n    os._exit(0)"]:
        value, info = await run(v, code, ADD_TESTS)
        assert value == 0.0, code


@pytest.mark.asyncio
async def test_honest_solutions_still_pass_through_the_harness() -> None:
    v = fast()
    solution = textwrap.dedent("""
        import math
        class Stack:
            def __init__(self):
                self.items = []
            def push(self, x):
                self.items.append(x)
            def pop(self):
                if not self.items:
                    raise IndexError("pop from empty stack")
                return self.items.pop()
            def __len__(self):
                return len(self.items)
        def stats(xs):
            return {"n": len(xs), "mean": sum(xs) / len(xs), "set": set(xs), "pair": (min(xs), max(xs))}
        def gen(n):
            yield from range(n)
        def big():
            return 3 ** 10000
        TABLE = list(range(2_000_000))  # a big lookup table: more than one reply can carry
        def root(x):
            if x < 0:
                raise ValueError("negative")
            return math.sqrt(x)
    """)
    tests = [
        "s = Stack(); s.push(1); s.push(b'x'); assert len(s) == 2 and s.pop() == b'x' and s.pop() == 1",
        "s = Stack()\ntry:\n    s.pop()\n    raise AssertionError('no error')\nexcept IndexError:\n    pass",
        "assert stats([1, 2, 3]) == {'n': 3, 'mean': 2.0, 'set': {1, 2, 3}, 'pair': (1, 3)}",
        "assert list(gen(3)) == [0, 1, 2] and sum(x for x in gen(4)) == 6",
        "try:\n    root(-1)\nexcept ValueError as e:\n    assert 'negative' in str(e)\nelse:\n    raise AssertionError",
        "assert big() % 1000 == 3 ** 10000 % 1000",
        "assert TABLE[12345] == 12345 and len(TABLE) == 2_000_000 and 7 in TABLE",
    ]
    value, info = await run(v, solution, tests)
    assert value == 1.0, info


def _score_in_a_scoring_process(*solutions: str) -> list[str]:
    """Score each solution in a sacrificial scoring process (its own session, a secret in its environment
    from the start, as a trainer's API keys are); returns the lines it printed ("SCORED <value>")."""
    script = textwrap.dedent(f"""
        import asyncio
        from rlf_envs.rewards import CodeVerifier
        from rlf_envs.types import Task, Trajectory
        v = CodeVerifier(timeout_s=5.0, cpu_s=5)
        for code in {list(solutions)!r}:
            t = Trajectory(Task("k", "add", {ADD_TESTS!r}), "P", [], code)
            print("SCORED", asyncio.run(v.safe_score(t, t.task)).value, flush=True)
    """)
    env = {**os.environ, "RLF_TEST_SECRET_KEY": "hunter2"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                          start_new_session=True)
    assert proc.returncode == 0, f"the scoring process died ({proc.returncode}): {proc.stderr[-2000:]}"
    return [line for line in proc.stdout.splitlines() if line.startswith("SCORED")]


KILL_PARENT = """
import os, signal
for get in (lambda: os.getppid(), lambda: os.getpgid(os.getppid()), lambda: os.getsid(os.getppid())):
    try:
        target = get()
    except OSError:
        continue
    for send in (os.kill, os.killpg):
        try:
            send(target, signal.SIGKILL)
        except OSError:
            pass
def add(a, b):
    return a + b
"""

READ_SECRET = """
import os
SECRET = None
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            data = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        if b"RLF_TEST_SECRET_KEY=" in data:
            SECRET = data.split(b"RLF_TEST_SECRET_KEY=")[1].split(b"\\0")[0].decode()
def add(a, b):
    return a + b if SECRET == "hunter2" else None
"""


def test_a_solution_cannot_kill_the_scoring_process(isolated: None) -> None:
    # the old harness was the scorer's direct child: this killed the (sacrificial) scorer
    assert _score_in_a_scoring_process(KILL_PARENT) == ["SCORED 1.0"]


def test_the_scoring_process_environment_is_unreadable(isolated: None) -> None:
    control = READ_SECRET.replace('SECRET == "hunter2"', "True")  # the solution itself works...
    assert _score_in_a_scoring_process(control, READ_SECRET) == ["SCORED 1.0", "SCORED 0.0"]  # ...without it


@pytest.mark.asyncio
async def test_no_file_written_outside_the_work_dir(tmp_path: Path, isolated: None) -> None:
    targets = [tmp_path / "escaped.txt", Path(f"/tmp/rlf_escape_{secrets.token_hex(6)}"),
               Path(f"/var/tmp/rlf_escape_{secrets.token_hex(6)}")]
    os.chmod(tmp_path, 0o777)  # even a world-writable directory of ours is out of reach
    code = "def add(a, b):\n    return a + b\n" + "".join(
        f"try:\n    open({str(t)!r}, 'w').write('x')\nexcept OSError:\n    pass\n" for t in targets)
    try:
        assert (await run(fast(), code, ADD_TESTS))[0] == 1.0
        assert [t for t in targets if t.exists()] == []
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


@pytest.mark.asyncio
async def test_escaped_grandchild_holding_the_pipes_is_killed(leftovers: Callable[[str], list[int]]) -> None:
    marker = f"{3600 + secrets.randbelow(10**6) / 10**7:.7f}"  # a unique `sleep` argument to find it by
    code = textwrap.dedent(f"""
        import os
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv("/bin/sleep", ["sleep", "{marker}"])  # keeps stdout/stderr open, new session
            os._exit(0)
        def add(a, b):
            return a + b
    """)
    t0 = time.monotonic()
    value, info = await run(fast(timeout_s=5.0), code, ADD_TESTS)
    assert value == 1.0, info
    assert time.monotonic() - t0 < 20.0  # no hang on the pipes (generous bound)
    assert leftovers(marker) == []


@pytest.mark.asyncio
async def test_guards_are_reported_per_score() -> None:
    value, info = await run(fast(), "def add(a, b):\n    return a + b\n", ADD_TESTS)
    assert value == 1.0
    if os.geteuid() == 0:  # CI runs as root on Linux: the uid guard is always available there
        assert info["code/guard/uid"] == 1.0 and info["code/guard/nproc"] == 1.0


def test_old_flat_yaml_config_still_builds() -> None:
    v = build_verifier({"type": "code", "timeout_s": 3, "cpu_s": 2, "memory_mb": 256, "file_mb": 1,
                        "max_output_bytes": 4096, "max_processes": 16, "partial_credit": False})
    assert isinstance(v, CodeVerifier)
    lim = v.cfg.limits
    assert (lim.timeout_s, lim.cpu_s, lim.memory_mb, lim.file_mb, lim.max_processes) == (3, 2, 256, 1, 16)
    with pytest.raises(ValueError, match="max_proceses"):
        build_verifier({"type": "code", "max_proceses": 3})
