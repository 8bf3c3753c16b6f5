"""The coding-agent reward cannot be beaten by the policy it trains (third outside attack round): SWE verdicts and
Harbor verdicts that a patch tries to forge without fixing the bug, and failing episodes that try to make
themselves infrastructure failures. Every attack here scored 1.0 (or infra) on the code before round 3.

Needs the local session backend (root) and the Debian test image; skips with the reason otherwise."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest
from repo_paths import SUPPORT
from session_support import need_sessions, session_image

import rlf_envs  # noqa: F401 - registers the ids
from rlf_envs import runtime
from rlf_envs.data.swe.generate import unified_diff
from rlf_envs.envs.swe.env import SweLimits, SweVerifier
from rlf_envs.envs.swe.harbor_run import expected_reward_files, harbor_filter
from rlf_envs.envs.swe.tasks import load_swe_rows, swe_task_from_row
from rlf_envs.envs.swe.verify import filter_patch, import_roots, shadowed_module, task_test_files

HARBOR = SUPPORT / "harbor_tasks"


SRC = '''def clamp(x, lo, hi):
    """Clamp x into [lo, hi]."""
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x
'''
BUG = SRC.replace("if x > hi:", "if x < hi:")
TESTS = '''from calc import clamp


def test_low():
    assert clamp(-5, 0, 10) == 0


def test_high():
    assert clamp(50, 0, 10) == 10


def test_mid():
    assert clamp(5, 0, 10) == 5
'''


def row(tmp: Path, test_path: str = "tests/test_calc.py") -> dict[str, Any]:
    repo = tmp / "repo"
    (repo / "calc").mkdir(parents=True, exist_ok=True)
    (repo / "calc" / "__init__.py").write_text(SRC)
    (repo / test_path).parent.mkdir(parents=True, exist_ok=True)
    (repo / test_path).write_text(TESTS)
    return {"instance_id": "forge__clamp-1", "problem_statement": "clamp(11, 0, 10) returns 11, not 10",
            "repo_dir": str(repo), "bug_patch": unified_diff("calc/__init__.py", SRC, BUG),
            "patch": unified_diff("calc/__init__.py", BUG, SRC),
            "FAIL_TO_PASS": [f"{test_path}::test_high", f"{test_path}::test_mid"],
            "PASS_TO_PASS": [f"{test_path}::test_low"]}


def new_file(path: str, text: str) -> str:
    lines = text.splitlines(keepends=True)
    return (f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
            f"@@ -0,0 +1,{len(lines)} @@\n" + "".join("+" + line for line in lines))


def edit_lib(extra: str) -> str:
    """A library patch that leaves the bug in and adds `extra` at the top of calc/__init__.py."""
    return unified_diff("calc/__init__.py", BUG, textwrap.dedent(extra) + "\n\n" + BUG)


def verdict(r: dict[str, Any], patch: str, **kw: Any) -> Any:
    task = load_swe_rows([r])[0]
    return runtime.run(SweVerifier(image=session_image(), **kw).verdict(patch, task))


# -- without sessions -------------------------------------------------------------------------------------------


def test_files_the_test_ids_name_are_the_tasks_whatever_their_names(tmp_path: Path) -> None:
    t = swe_task_from_row(row(tmp_path, "checks/spec_calc.py"))
    owned = task_test_files(t)
    assert {"checks/spec_calc.py", "checks/conftest.py", "conftest.py"} <= owned
    fp = filter_patch(unified_diff("checks/spec_calc.py", TESTS, TESTS.replace("== 10", "== 11")), owned)
    assert fp.dropped == ["checks/spec_calc.py"] and not fp.text


def test_new_modules_that_shadow_the_images_are_dropped(tmp_path: Path) -> None:
    t = swe_task_from_row(row(tmp_path, "checks/spec_calc.py"))
    mods = frozenset({"json", "pytest", "_pytest", "pluggy", "calc"})
    roots = import_roots(t)
    assert roots == {"", "checks"}
    assert shadowed_module("json.py", roots, mods) == "json"
    assert shadowed_module("_pytest/__init__.py", roots, mods) == "_pytest"
    assert shadowed_module("checks/pluggy.py", roots, mods) == "pluggy"
    assert shadowed_module("calc/json.py", roots, mods) is None  # calc.json: a submodule, shadows nothing
    assert shadowed_module("json.txt", roots, mods) is None
    patch = new_file("json.py", "x = 1\n") + new_file("calc/extra.py", "y = 2\n")
    fp = filter_patch(patch, task_test_files(t), roots=roots, modules=mods)
    assert fp.shadowing == ["json.py"] and fp.kept == ["calc/extra.py"]
    # an existing file of the repository that happens to share a name is the task's own: edits are kept
    fp2 = filter_patch(unified_diff("calc/__init__.py", BUG, SRC), task_test_files(t), roots=roots, modules=mods)
    assert fp2.kept == ["calc/__init__.py"]


def test_harbor_filter_drops_hooks_and_shadows() -> None:
    mods = frozenset({"json", "pytest"})
    patch = (new_file("conftest.py", "x = 1\n") + new_file("sub/conftest.py", "x = 1\n")
             + new_file("sitecustomize.py", "x = 1\n") + new_file("json.py", "x = 1\n")
             + new_file("pyproject.toml", "[tool.pytest.ini_options]\naddopts = '-p evil'\n")
             + new_file("zz.pth", "import os\n") + new_file("greet.py", "print('hi')\n"))
    text, dropped = harbor_filter(patch, "/app", mods)
    assert dropped == 6 and "greet.py" in text and "conftest" not in text
    # a workdir above Harbor's own directories: nothing reaches /tests or /logs
    text2, dropped2 = harbor_filter(new_file("logs/verifier/reward.txt", "1\n") + new_file("a.txt", "a\n"), "/")
    assert dropped2 == 1 and "a.txt" in text2
    assert expected_reward_files("echo 1 > /logs/verifier/reward.txt") == ("reward.txt",)
    assert expected_reward_files("python3 check.py > /logs/verifier/reward.json") == ("reward.json",)


# -- SWE verdicts on the local backend --------------------------------------------------------------------------


def test_gold_scores_one_untouched_zero_with_the_guarded_run(tmp_path: Path) -> None:
    need_sessions()
    r = row(tmp_path)
    gold = verdict(r, r["patch"])
    assert gold.value == 1.0 and gold.f2p_passed == 2 and gold.p2p_passed == 1, gold
    assert not gold.unknown_tests and not gold.tampering
    untouched = verdict(r, "")
    assert untouched.value == 0.0 and not untouched.infra_failed and untouched.f2p_passed == 0


def test_a_test_module_not_named_like_a_test_cannot_be_edited(tmp_path: Path) -> None:
    need_sessions()
    r = row(tmp_path, "checks/spec_calc.py")
    assert verdict(r, r["patch"]).value == 1.0
    cheat = unified_diff("checks/spec_calc.py", TESTS, TESTS.replace("clamp(50, 0, 10) == 10", "True")
                         .replace("clamp(5, 0, 10) == 5", "True"))
    v = verdict(r, cheat)
    assert v.value == 0.0 and v.dropped_files == 1 and not v.infra_failed


SHADOW_JSON = '''
import os as _o, sys as _s
_mods = _s.__dict__["modu" + "les"]
_me = _mods.pop("json")
_here = _o.path.dirname(_o.path.abspath(__file__))
_saved = list(_s.path)
_s.path[:] = [p for p in _s.path if _o.path.abspath(p or ".") != _here]
import json as _real
_s.path[:] = _saved
_mods["json"] = _me


def _fix(o):
    if isinstance(o, dict):
        return {k: ("passed" if v in ("failed", "error") else _fix(v)) for k, v in o.items()}
    return o


def dump(obj, fp, *a, **kw):
    return _real.dump(_fix(obj), fp, *a, **kw)


def dumps(obj, *a, **kw):
    if isinstance(obj, str):
        return _real.dumps(obj, *a, **kw)
    return _real.dumps(_fix(obj), *a, **kw)


loads, load, JSONDecodeError, JSONDecoder, JSONEncoder = (_real.loads, _real.load, _real.JSONDecodeError,
                                                          _real.JSONDecoder, _real.JSONEncoder)
'''


def test_a_new_module_shadowing_the_standard_library_does_not_forge(tmp_path: Path) -> None:
    need_sessions()
    r = row(tmp_path, "test_calc.py")  # the test at the repository root: pytest puts the root on sys.path
    v = verdict(r, new_file("json.py", SHADOW_JSON))
    assert v.value == 0.0 and v.shadowing_files == 1 and not v.infra_failed, v


#: a module named like the report plugin the runner loads (rlf's earlier runner loaded it by name with `-p`)
FAKE_PLUGIN = '''
import json, os
_OUT = {}
_nonce, _path = open(os.environ["RL" + "F_PY" + "TEST_REPORT"]).read().split("\\n", 1)


def _log(report):
    _OUT[report.nodeid] = {"outcome": "passed", "message": ""}


def _finish(session, exitstatus):
    with open(_path.strip(), "w") as f:
        json.dump({"nonce": _nonce, "outcomes": _OUT}, f)


globals()["py" + "test_runtest_logreport"] = _log
globals()["py" + "test_sessionfinish"] = _finish
'''


def test_runner_named_modules_do_not_forge(tmp_path: Path) -> None:
    need_sessions()
    r = row(tmp_path, "test_calc.py")
    for name in ("rl" "f_pytest_report.py", "_pytest/__init__.py", "pluggy/__init__.py", "run.py"):
        v = verdict(r, new_file(name, FAKE_PLUGIN))
        assert v.value == 0.0 and not v.infra_failed, (name, v)


FIFO_FORGER = '''
import glob, json as _j, os, threading


def _forge(path):
    with open(path) as f:  # blocks until the runner writes its report into the FIFO
        real = _j.load(f)
    os.unlink(path)
    outs = real.get("outcomes")
    everything_passed = {k: {"outcome": "passed", "message": ""} for k in (
        outs if isinstance(outs, dict) else _j.loads(outs) if isinstance(outs, str) else {})}
    real["outcomes"] = everything_passed if isinstance(outs, dict) else _j.dumps(everything_passed)
    with open(path, "w") as f:
        _j.dump(real, f)


for _d in glob.glob("/tmp/.rl" + "f_verify-*"):
    try:
        os.mkfifo(_d + "/report.json")
    except OSError:
        continue
    threading.Thread(target=_forge, args=(_d + "/report.json",)).start()  # joined at interpreter exit
'''


def test_a_fifo_in_place_of_the_report_does_not_forge(tmp_path: Path) -> None:
    need_sessions()
    r = row(tmp_path)
    for partial in (False, True):
        v = verdict(r, edit_lib(FIFO_FORGER), partial_credit=partial)
        assert v.value == 0.0 and not v.infra_failed, v


OUTCOME_REWRITER = '''
_m = __import__("_py" + "test.reports", fromlist=["TestReport"])
_init = _m.TestReport.__init__


def _passed(self, *a, **kw):
    _init(self, *a, **kw)
    self.outcome = "passed"
    self.longrepr = None


_m.TestReport.__init__ = _passed
'''


def test_in_process_rewriting_of_outcomes_is_caught_by_the_canary(tmp_path: Path) -> None:
    need_sessions()
    r = row(tmp_path)
    v = verdict(r, edit_lib(OUTCOME_REWRITER))
    assert v.value == 0.0 and v.tampering and v.info()["failure/tampering"] == 1.0 and not v.infra_failed, v


CLAIMS_NO_PYTEST = '''
import os, signal, sys
os.write(int(os.environ.get("FD", "2")), b"ModuleNotFoundError: No module named py" + b"test\\n")
for fd in range(3, 64):  # the real stderr behind the capture too
    try:
        if os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
            os.write(fd, b"ModuleNotFoundError: No module named py" + b"test\\n")
    except OSError:
        pass
os.kill(os.getpid(), signal.SIGKILL)
'''
FILLS_TMP = '''
import os
try:
    with open("/tmp/fill", "wb") as f:
        while True:
            f.write(b"x" * (1 << 20))
except OSError:
    pass
try:
    with open("/dev/shm/fill", "wb") as f:
        while True:
            f.write(b"x" * (1 << 20))
except OSError:
    pass
'''


def test_code_under_test_cannot_make_the_run_an_infrastructure_failure(tmp_path: Path) -> None:
    need_sessions()
    r = row(tmp_path)
    for attack in (CLAIMS_NO_PYTEST, FILLS_TMP):
        v = verdict(r, edit_lib(attack), limits=SweLimits(disk_mb=64, memory_mb=256))
        assert v.value == 0.0 and not v.infra_failed, v


def test_an_oversized_patch_is_refused_and_not_kept(tmp_path: Path) -> None:
    need_sessions()
    r = row(tmp_path)
    v = verdict(r, r["patch"] + new_file("calc/blob.py", "# " + "x" * 400_000 + "\n"),
                limits=SweLimits(max_patch_bytes=100_000))
    assert v.value == 0.0 and v.failure == "patch_too_large" and not v.infra_failed
    env = gym.make("rlf/SWE-v0", tasks=[r], limits={"max_patch_bytes": 100_000}).unwrapped
    try:
        env.reset(seed=0)
        env.step('<tool_call>{"name": "bash", "arguments": {"command": "head -c 300000 /dev/zero | tr \\"\\\\0\\" '
                 'x > big.txt; ls -la big.txt"}}</tool_call>')
        _, reward, term, _, info = env.step('<tool_call>{"name": "submit", "arguments": {}}</tool_call>')
        traj = info["trajectory"]
        assert term and reward == 0.0 and info["infra_failed"] is False
        assert traj.score_info.get("failure/patch_too_large") == 1.0, traj.score_info
        assert not traj.answer  # never kept in the trajectory
    finally:
        env.close()


def test_a_session_past_its_wall_clock_is_the_episodes_failure(tmp_path: Path) -> None:
    need_sessions()
    env = gym.make("rlf/SWE-v0", tasks=[row(tmp_path)], limits={"session_timeout_s": 3.0}).unwrapped
    try:
        env.reset(seed=0)
        env.step('<tool_call>{"name": "bash", "arguments": {"command": "echo started"}}</tool_call>')
        import time

        time.sleep(6.0)
        _, reward, term, _, info = env.step('<tool_call>{"name": "submit", "arguments": {}}</tool_call>')
        assert term and reward == 0.0 and info["infra_failed"] is False, info["trajectory"].score_info
        assert info["trajectory"].score_info.get("failure/session_expired") == 1.0
    finally:
        env.close()


def test_bad_paths_are_tool_errors_not_infrastructure_failures(tmp_path: Path) -> None:
    need_sessions()
    env = gym.make("rlf/SWE-v0", tasks=[row(tmp_path)]).unwrapped
    try:
        env.reset(seed=0)
        obs = []
        for path in ("a\\u0000b", "\\ud800x", "/proc/self/fd/0"):
            o, *_ = env.step('<tool_call>{"name": "read_file", "arguments": {"path": "' + path + '"}}</tool_call>')
            obs.append(o)
            env.step('<tool_call>{"name": "write_file", "arguments": {"path": "' + path + '", "text": "x"}}'
                     '</tool_call>')
        _, reward, term, _, info = env.step('<tool_call>{"name": "submit", "arguments": {}}</tool_call>')
        assert term and info["infra_failed"] is False, (obs, info["trajectory"].score_info)
        assert all("infrastructure" not in o for o in obs), obs
    finally:
        env.close()


# -- Harbor verdicts on the local backend -----------------------------------------------------------------------


def _harbor_task(name: str) -> Any:
    from rlf_envs.tasks.harbor import load_harbor_dir

    return load_harbor_dir(HARBOR / name, build_args={"BASE_IMAGE": str(session_image())})[0]


GREET_TAMPER_DIR = '''import os
os.makedirs("/logs/verifier/reward.txt", exist_ok=True)
with open("/logs/verifier/reward.json", "w") as f:
    f.write('{"reward": 1.0}')
print("nope")
'''
GREET_READONLY = '''import os
with open("/logs/verifier/reward.txt", "w") as f:
    f.write("1\\n")
os.chmod("/logs/verifier/reward.txt", 0o444)
print("nope")
'''
GREET_DAEMON = '''import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        end = time.time() + 20
        while time.time() < end:
            try:
                with open("/logs/verifier/reward.txt", "w") as f:
                    f.write("1\\n")
            except OSError:
                pass
            time.sleep(0.0005)
    os.kill(os.getpid(), 9)
time.sleep(0.3)
print("nope")
'''
GREET_KILL_PARENT = '''import os, signal
with open("/logs/verifier/reward.txt", "w") as f:
    f.write("1\\n")
os.killpg(os.getpgid(0), signal.SIGKILL)
'''


@pytest.mark.parametrize("attack", ["dir", "readonly", "daemon", "kill_parent"])
def test_harbor_reward_files_cannot_be_forged(attack: str) -> None:
    need_sessions()
    src = {"dir": GREET_TAMPER_DIR, "readonly": GREET_READONLY, "daemon": GREET_DAEMON,
           "kill_parent": GREET_KILL_PARENT}[attack]
    task = _harbor_task("fix-greeting")
    orig = (HARBOR / "fix-greeting" / "environment" / "greet.py").read_text()
    patch = unified_diff("greet.py", orig, src)
    v = runtime.run(SweVerifier(image=session_image()).verdict(patch, task))
    assert v.value == 0.0 and not v.infra_failed, v
    # the daemon races test.sh: when it is still alive at the end its run is voided (leftover_processes); on a loaded
    # machine it may lose the race and the reward is test.sh's own 0 -- never 1.0 either way
    assert v.failure or attack == "daemon", v


SALES_JSON = '''def loads(s, *a, **kw):
    return {"north": 42.47, "south": 159.9, "East": 1.0, "east": 3.0}


def dumps(o, *a, **kw):
    return "{}"


def load(f, *a, **kw):
    return loads(f.read())


def dump(o, f, *a, **kw):
    f.write("{}")


class JSONDecodeError(ValueError):
    pass
'''
SALES_CONFTEST = '''def pytest_sessionfinish(session, exitstatus):
    session.exitstatus = 0
    import os
    os.makedirs("/logs/verifier", exist_ok=True)
    open("/logs/verifier/reward.txt", "w").write("1\\n")
    os._exit(0)
'''


@pytest.mark.parametrize("name,text", [("json.py", SALES_JSON), ("conftest.py", SALES_CONFTEST),
                                       ("sitecustomize.py", SALES_CONFTEST.replace("def pytest_sessionfinish",
                                                                                   "def _unused"))])
def test_harbor_workdir_modules_and_hooks_do_not_forge(name: str, text: str) -> None:
    need_sessions()
    task = _harbor_task("sales-report")
    patch = new_file(name, text) + new_file("report.json", '{"north": 1}\n')
    v = runtime.run(SweVerifier(image=session_image()).verdict(patch, task))
    assert v.value == 0.0 and not v.infra_failed and v.dropped_files >= 1, v
