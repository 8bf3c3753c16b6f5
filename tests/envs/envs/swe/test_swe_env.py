"""rlf/SWE-v0: mutation operators, task rows, the patch filter, the tools, and whole episodes on the local session
backend (a tiny repository made here, and the shipped tasks: gold patch 1.0, untouched repository 0.0).

Episode tests need the local session backend (root) and an image with python3 + pytest: the Debian test image
(`python -m rlf_envs.sandbox.sessions.images build-debian`); they skip with the reason otherwise."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import random
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest

import rlf_envs  # noqa: F401 - registers the ids
from rlf_envs.data.swe.generate import is_test_path, problem_statement, unified_diff
from rlf_envs.data.swe.mutate import mutants
from rlf_envs.envs.swe.pytest_report import PytestOutcome, parse_report
from rlf_envs.envs.swe.tasks import shipped_projects, shipped_tasks, swe_task_from_row
from rlf_envs.envs.swe.verify import filter_patch, is_protected


def _image() -> str | None:
    try:
        from rlf_envs.sandbox.sessions.images import debian_test_image
    except ImportError:
        return None
    return debian_test_image()


needs_sessions = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the local session backend needs root"),
    pytest.mark.skipif(_image() is None, reason="no session image with pytest: run `python -m "
                       "rlf_envs.sandbox.sessions.images build-debian` (Debian 12 root, ~2 min)"),
]

SRC = '''def clamp(x, lo, hi):
    """Clamp x into [lo, hi]."""
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def total(xs):
    return sum(xs[0:len(xs)])
'''
TESTS = '''from calc import clamp, total


def test_low():
    assert clamp(-5, 0, 10) == 0


def test_high():
    assert clamp(50, 0, 10) == 10


def test_mid():
    assert clamp(5, 0, 10) == 5


def test_total():
    assert total([1, 2, 3]) == 6
'''
BUG = SRC.replace("if x > hi:", "if x < hi:")


def tiny_row(tmp: Path, **over: Any) -> dict[str, Any]:
    repo = tmp / "repo"
    (repo / "calc").mkdir(parents=True, exist_ok=True)
    (repo / "tests").mkdir(exist_ok=True)
    (repo / "calc" / "__init__.py").write_text(SRC)
    (repo / "tests" / "test_calc.py").write_text(TESTS)
    row = {"instance_id": "tiny__clamp-1", "problem_statement": "clamp(11, 0, 10) returns 11, not 10",
           "repo_dir": str(repo), "bug_patch": unified_diff("calc/__init__.py", SRC, BUG),
           "patch": unified_diff("calc/__init__.py", BUG, SRC),
           "FAIL_TO_PASS": ["tests/test_calc.py::test_high", "tests/test_calc.py::test_mid"],
           "PASS_TO_PASS": ["tests/test_calc.py::test_low", "tests/test_calc.py::test_total"]}
    row.update(over)
    return row


def _skip_without_sessions() -> None:
    for mark in needs_sessions:
        if mark.args[0]:
            pytest.skip(mark.kwargs["reason"])


def call(name: str, **args: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


# -- no sessions needed ------------------------------------------------------------------------------------------


def test_mutants_change_one_site_and_reparse() -> None:
    ms = mutants(SRC, "calc/__init__.py")
    ops = {m.op for m in ms}
    assert {"compare", "early_return", "off_by_one"} <= ops, ops
    for m in ms:
        new = m.apply(SRC)
        assert ast.dump(ast.parse(new)) != ast.dump(ast.parse(SRC))
        changed = [a for a, b in zip(SRC.splitlines(), new.splitlines(), strict=False) if a != b]
        assert len(changed) <= 2 or m.op == "early_return"
    flip = next(m for m in ms if m.op == "compare" and "x < lo" in SRC.splitlines()[m.lineno - 1])
    assert "if x <= lo:" in flip.apply(SRC)


def test_problem_statement_never_quotes_the_change() -> None:
    m = next(m for m in mutants(SRC, "calc/__init__.py") if m.op == "compare" and m.lineno == 5)
    bad_line = m.apply(SRC).splitlines()[4].strip()
    msg = f"AssertionError: {bad_line} at 0x7f00aabbcc"
    failing = [("tests/test_calc.py::test_high", PytestOutcome("failed", msg))]
    from rlf_envs.data.swe.generate import PROJECTS

    text = problem_statement(PROJECTS[0], failing, m, SRC)
    assert "tests/test_calc.py::test_high" in text
    assert bad_line not in text and "0x7f00aabbcc" not in text


@pytest.mark.parametrize("path,protected", [
    ("calc/__init__.py", False), ("src/pkg/core.py", False), ("tests/test_calc.py", True),
    ("pkg/tests/helpers.py", True), ("conftest.py", True), ("pkg/conftest.py", True), ("pytest.ini", True),
    ("setup.cfg", True), ("pyproject.toml", True), ("tox.ini", True), ("sitecustomize.py", True),
    ("pkg/usercustomize.py", True), ("evil.pth", True), ("pkg/__pycache__/x.pyc", True), (".pytest_cache/v", True),
    ("test_other.py", True), ("../outside.py", True), ("/etc/passwd", True), (".git/config", True),
])
def test_protected_paths(path: str, protected: bool) -> None:
    assert is_protected(path) is protected


def test_filter_patch_keeps_library_drops_tests_and_flags_forgery() -> None:
    lib = unified_diff("calc/__init__.py", BUG, SRC)
    tst = unified_diff("tests/test_calc.py", TESTS, TESTS.replace("== 10", "== 11"))
    conf = unified_diff("conftest.py", "", "import os\n")
    fp = filter_patch(lib + tst + conf)
    assert fp.kept == ["calc/__init__.py"] and sorted(fp.dropped) == ["conftest.py", "tests/test_calc.py"]
    assert fp.text == lib and not fp.forbidden
    forged = unified_diff("calc/__init__.py", SRC, SRC + "import _pytest\n")
    assert filter_patch(forged).forbidden == ["calc/__init__.py"]
    link = "diff --git a/calc/l b/calc/l\nnew file mode 120000\n--- /dev/null\n+++ b/calc/l\n@@ -0,0 +1 @@\n+/etc\n"
    assert filter_patch(link).dropped == ["calc/l"]


def test_task_rows_swe_bench_shape_and_errors(tmp_path: Path) -> None:
    row = tiny_row(tmp_path, FAIL_TO_PASS=json.dumps(["tests/test_calc.py::test_high"]))
    t = swe_task_from_row(row)
    assert t.FAIL_TO_PASS == ("tests/test_calc.py::test_high",) and t.workdir == "/workspace"
    assert swe_task_from_row({**row, "image": "docker:swebench/x"}).workdir == "/testbed"
    for bad, msg in [({"instance_id": ""}, "instance_id"), ({"FAIL_TO_PASS": []}, "FAIL_TO_PASS is empty"),
                     ({"FAIL_TO_PASS": "not json"}, "list of test ids"), ({"problem_statement": None}, "problem"),
                     ({"repo_dir": str(tmp_path / "nope")}, "not a directory"), ({"workdir": "rel"}, "absolute")]:
        with pytest.raises(ValueError, match=msg):
            swe_task_from_row({**row, **bad})


def test_report_parser_is_strict() -> None:
    assert parse_report('{"a::b": {"outcome": "passed"}}')["a::b"].passed
    assert parse_report("[1, 2]") == {} and parse_report("not json") == {} and parse_report("x" * 100, limit=10) == {}
    assert parse_report('{"a": {"outcome": 3}, "b": 5}') == {}


def test_shipped_data_shape() -> None:
    projects = shipped_projects()
    train, test = shipped_tasks("train"), shipped_tasks("test")
    assert len(train) >= 100 and len(test) >= 30
    repos = {t.meta["swe"]["repo"] for t in train + test}
    assert len(repos) >= 4 and repos <= set(projects)
    for p in projects.values():
        assert p["license"] in ("MIT", "BSD-3-Clause", "Apache-2.0")
    ids = [t.id for t in train + test]
    assert len(ids) == len(set(ids))
    from rlf_envs.data.swe import split_path

    fns = {}
    for split in ("train", "test"):
        for line in split_path(split).read_text().splitlines():
            r = json.loads(line)
            fns.setdefault(split, set()).add((r["repo"], r["mutation"]["function"]))
            assert r["FAIL_TO_PASS"] and r["patch"] and r["bug_patch"]
            assert r["mutation"]["path"] not in r["problem_statement"]
            assert all(not is_test_path(p) for p in [r["mutation"]["path"]])
    assert not fns["train"] & fns["test"], "a function is mutated in both splits"


# -- episodes on the local backend -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_env(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("swe")
    env = gym.make("rlf/SWE-v0", tasks=[tiny_row(tmp)], limits={"exec_timeout_s": 5.0, "output_chars": 600}).unwrapped
    yield env
    env.close()


def run_episode(env: Any, actions: list[str]) -> tuple[float, dict[str, Any], list[str]]:
    env.reset(seed=0)
    obs: list[str] = []
    for a in actions:
        o, r, term, trunc, info = env.step(a)
        obs.append(o)
        if term or trunc:
            return r, info, obs
    raise AssertionError("the episode did not end")


def test_gold_edit_scores_one_untouched_zero(tiny_env: Any) -> None:
    _skip_without_sessions()
    r, info, obs = run_episode(tiny_env, [
        call("bash", command="python3 -m pytest -q -o addopts= tests 2>&1 | tail -3"),
        call("edit", path="calc/__init__.py", old="if x < hi:", new="if x > hi:"),
        call("submit")])
    assert "2 failed" in obs[0] and "[exit code 0]" in obs[0]
    assert r == 1.0 and info["infra_failed"] is False
    assert "diff --git a/calc/__init__.py" in info["trajectory"].answer
    r0, info0, _ = run_episode(tiny_env, [call("submit")])
    assert r0 == 0.0 and info0["trajectory"].score_info["swe/f2p_passed"] == 0.0


def test_hostile_patches_do_not_forge_the_verdict(tiny_env: Any) -> None:
    _skip_without_sessions()
    attacks = [
        # rewrite the failing test, plant a conftest that passes everything, a .pth and a sitecustomize
        call("write_file", path="tests/test_calc.py", text="def test_high():\n    pass\n"),
        call("write_file", path="conftest.py", text="import pytest\n@pytest.hookimpl(hookwrapper=True)\n"
                                                     "def pytest_runtest_makereport(item, call):\n    yield\n"),
        call("write_file", path="calc/zz.pth", text="import os\n"),
        call("write_file", path="sitecustomize.py", text="import os\nos._exit(0)\n"),
        call("bash", command="mkdir -p .pytest_cache && echo x > .pytest_cache/x; (sleep 100 &) ; echo started"),
    ]
    r, info, _ = run_episode(tiny_env, [*attacks, call("submit")])
    assert r == 0.0 and info["trajectory"].score_info["swe/dropped_files"] >= 4
    # library code reaching into pytest is refused outright
    r2, info2, _ = run_episode(tiny_env, [
        call("edit", path="calc/__init__.py", old="def total(xs):", new="import _pytest\n\n\ndef total(xs):"),
        call("edit", path="calc/__init__.py", old="if x < hi:", new="if x > hi:"), call("submit")])
    assert r2 == 0.0 and info2["trajectory"].score_info["swe/forbidden"] == 1.0


def test_tool_errors_and_output_caps(tiny_env: Any) -> None:
    _skip_without_sessions()
    _, _, obs = run_episode(tiny_env, [
        call("edit", path="calc/__init__.py", old="no such text", new="x"),
        call("edit", path="calc/__init__.py", old="return", new="x"),
        call("bash", command="python3 -c \"print('y' * 5000)\""),
        call("bash", command="sleep 30"),
        call("read_file", path="calc/__init__.py", start=3, end=4),
        call("read_file", path="nope.py"),
        call("bash"),
        call("submit")])
    assert "not found" in obs[0] and "whitespace" in obs[0]
    assert "occurs 4 times" in obs[1]
    assert "[output cut:" in obs[2] and "characters removed" in obs[2]
    assert "timed out after 5 s" in obs[3] and "[exit code 124]" in obs[3]
    assert "3  " in obs[4] and "if x < lo:" in obs[4] and "def clamp" not in obs[4]
    assert "Error" in obs[5] or "error" in obs[5]
    assert "command" in obs[6]


def test_partial_credit_and_infra_failure(tmp_path: Path) -> None:
    _skip_without_sessions()
    half = [call("edit", path="calc/__init__.py", old="if x < hi:", new="if x < hi and x != 5:"), call("submit")]
    for partial, want in ((True, 0.5), (False, 0.0)):
        env = gym.make("rlf/SWE-v0", tasks=[tiny_row(tmp_path)], partial_credit=partial).unwrapped
        try:
            r, info, _ = run_episode(env, half)
            assert r == want and info["trajectory"].score_info["swe/f2p_passed"] == 1.0
        finally:
            env.close()

    from rlf_envs.sandbox.sessions import SessionBackend, SessionInfraError

    class Broken(SessionBackend):
        name = "broken"

        async def create(self, spec: Any) -> Any:
            raise SessionInfraError("engine lost")

        def reap(self) -> int:
            return 0

        async def aclose(self) -> None:
            return None

    env = gym.make("rlf/SWE-v0", tasks=[tiny_row(tmp_path)], backend=Broken()).unwrapped
    r, info, obs = run_episode(env, [call("bash", command="ls"), call("submit")])
    assert "infrastructure failure" in obs[0]
    assert info["infra_failed"] is True and info["trajectory"].score_info["infra_failed"] == 1.0 and r == 0.0
    assert info["trajectory"].infra_failed and "engine lost" in info["trajectory"].infra_error
    env.close()


def _verdicts(tasks: list[Any]) -> list[tuple[str, float, float]]:
    from rlf_envs.envs.swe.env import SweVerifier

    ver = SweVerifier(image=_image())

    async def one(t: Any) -> tuple[str, float, float]:
        gold = await ver.verdict(t.meta["swe"]["patch"], t)
        broken = await ver.verdict("", t)
        return t.id, gold.value if not gold.infra_failed else -1.0, broken.value if not broken.infra_failed else -1.0

    async def all_() -> list[tuple[str, float, float]]:
        sem = asyncio.Semaphore(4)

        async def gated(t: Any) -> tuple[str, float, float]:
            async with sem:
                return await one(t)

        return list(await asyncio.gather(*(gated(t) for t in tasks)))

    from rlf_envs import runtime

    return runtime.run(all_())


def test_shipped_tasks_sample_gold_one_broken_zero() -> None:
    _skip_without_sessions()
    tasks = shipped_tasks("train") + shipped_tasks("test")
    by_repo: dict[str, Any] = {}
    for t in random.Random(0).sample(tasks, len(tasks)):
        by_repo.setdefault(t.meta["swe"]["repo"], t)
    bad = [v for v in _verdicts(list(by_repo.values())) if v[1:] != (1.0, 0.0)]
    assert not bad, bad


@pytest.mark.slow
def test_all_shipped_tasks_gold_one_broken_zero() -> None:
    """Every shipped task: the gold patch scores 1.0, the untouched repository 0.0 (two hidden runs per task)."""
    _skip_without_sessions()
    tasks = shipped_tasks("train") + shipped_tasks("test")
    bad = [v for v in _verdicts(tasks) if v[1:] != (1.0, 0.0)]
    assert not bad, f"{len(bad)} of {len(tasks)} tasks: {bad[:10]}"


def test_viewer_shows_commands_and_edits_readably() -> None:
    from rlf_envs.view import show_arguments

    assert show_arguments("bash", {"command": "python3 -m pytest -q tests"}) == "$ python3 -m pytest -q tests"
    shown = show_arguments("edit", {"path": "a.py", "old": "if x:\n    y", "new": "if not x:\n    y"})
    assert "path: a.py" in shown and "old:\nif x:\n    y" in shown and "\\n" not in shown
    assert show_arguments("calculator", {"expression": "1+1"}) == '{\n "expression": "1+1"\n}'


def test_vector_env_runs_sessions_side_by_side(tmp_path: Path) -> None:
    """gymnasium.make_vec: two episodes in one batch, each in its own session; gold and untouched in one step."""
    _skip_without_sessions()
    vec = gym.make_vec("rlf/SWE-v0", num_envs=2, tasks=[tiny_row(tmp_path)])
    try:
        vec.reset(seed=0)
        vec.step([call("edit", path="calc/__init__.py", old="if x < hi:", new="if x > hi:"),
                  call("bash", command="cat calc/__init__.py | grep -c 'x < hi'")])
        _, rewards, terms, _, _ = vec.step([call("submit"), call("submit")])
        assert list(terms) == [True, True] and list(rewards) == [1.0, 0.0]
    finally:
        vec.close()


KILLED_OWNER = """
import json, sys, time
import gymnasium as gym
import rlf_envs
vec = gym.make_vec("rlf/SWE-v0", num_envs=8, task_file=sys.argv[1])
vec.reset(seed=0)
call = '<tool_call>' + json.dumps({"name": "bash", "arguments": {"command": "(sleep 1000 &) ; echo started"}})
vec.step([call + '</tool_call>'] * 8)
print("ready", flush=True)
time.sleep(1000)
"""


@pytest.mark.slow
def test_sigkill_mid_batch_leaves_nothing_behind(tmp_path: Path) -> None:
    """A trainer process SIGKILLed with 8 SWE episodes open (each with a background process): the next backend's
    start-up reaps every session: no label, no process of theirs, no cgroup, no mount left."""
    _skip_without_sessions()
    import signal
    import subprocess
    import sys
    import time

    from rlf_envs.sandbox.sessions import owners
    from rlf_envs.sandbox.sessions.local import LocalBackend

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(tiny_row(tmp_path)) + "\n")
    env = {**os.environ, "RLF_SESSIONS_DIR": str(tmp_path / "labels"),
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    p = subprocess.Popen([sys.executable, "-c", KILLED_OWNER, str(tasks)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        assert p.stdout.readline() == "ready\n"
        os.environ["RLF_SESSIONS_DIR"] = str(tmp_path / "labels")
        labels = owners.labels()
        assert len(labels) >= 8
        pids = [pid for lab in labels for pid, _ in lab.procs]
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        b = LocalBackend(pool_size=0)  # start-up reaps what the dead owner left
        assert b.reaped_at_start >= 8
        assert owners.labels() == []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(owners.alive(pid, None) for pid in pids):
            time.sleep(0.1)
        assert not [pid for pid in pids if owners.alive(pid, None)]
        assert not [d for lab in labels for d in lab.cgroups if os.path.isdir(d)]
        with open("/proc/self/mountinfo") as f:
            assert str(tmp_path) not in f.read()
    finally:
        os.environ.pop("RLF_SESSIONS_DIR", None)
        if p.poll() is None:
            p.kill()


def test_gymnasium_check_env_and_sync_vector(tmp_path: Path) -> None:
    """Gymnasium's own env checker passes on rlf/SWE-v0."""
    import warnings

    from gymnasium.utils.env_checker import check_env

    env = gym.make("rlf/SWE-v0", tasks=[tiny_row(tmp_path)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)
    env.close()
    assert env.unwrapped.tasks[0].meta["swe"]["FAIL_TO_PASS"]


def test_pack_is_deterministic_and_shipped_archives_hold_licences(tmp_path: Path) -> None:
    import tarfile

    from rlf_envs.data.swe import DATA_DIR
    from rlf_envs.data.swe.generate import PROJECTS, pack

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.py").write_text("x = 1\n")
    (tmp_path / "b.txt").write_text("b\n")
    one = pack(tmp_path, ["b.txt", "a/x.py"])
    os.utime(tmp_path / "b.txt", (1, 1))
    assert pack(tmp_path, ["a/x.py", "b.txt"]) == one  # order and mtimes do not change the bytes
    for p in PROJECTS:
        with tarfile.open(DATA_DIR / "repos" / f"{p.id}.tar.gz") as tf:
            names = tf.getnames()
        assert p.license_file in names and not any(n.startswith(("/", "..")) for n in names)


def test_docker_backend_needs_an_image_for_repository_tasks() -> None:
    with pytest.raises(ValueError, match="docker:<ref>"):
        gym.make("rlf/SWE-v0", backend="docker")
