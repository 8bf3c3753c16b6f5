"""rlf/SWE-v0 refuses a misconfigured host when the env is made (house rule 9), saying how to fix it, instead of
showing the host's error to the policy and scoring 0.0: an unknown backend, a missing image directory or archive, a
docker image the engine does not hold or without its prefix, a task without a repository, unknown arguments and
limits. Harbor's build_args/base_images are env arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest
from repo_paths import SUPPORT
from session_support import need_root, session_image

import rlf_envs  # noqa: F401 - registers the ids
from rlf_envs.data.swe.generate import unified_diff

HARBOR = SUPPORT / "harbor_tasks"


def row(tmp: Path, **over: Any) -> dict[str, Any]:
    repo = tmp / "repo"
    repo.mkdir(exist_ok=True)
    (repo / "m.py").write_text("X = 1\n")
    (repo / "test_m.py").write_text("from m import X\n\n\ndef test_x():\n    assert X == 2\n")
    r = {"instance_id": "cfg-1", "problem_statement": "X should be 2", "repo_dir": str(repo),
         "patch": unified_diff("m.py", "X = 1\n", "X = 2\n"), "FAIL_TO_PASS": ["test_m.py::test_x"]}
    r.update(over)
    return {k: v for k, v in r.items() if v is not None}


def test_an_unknown_backend_is_refused_naming_the_close_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown session backend 'dockr'; did you mean 'docker'"):
        gym.make("rlf/SWE-v0", tasks=[row(tmp_path)], backend="dockr")


def test_unknown_arguments_and_limits_name_the_close_ones(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="unknown argument 'max_turn'; did you mean 'max_turns'"):
        gym.make("rlf/SWE-v0", tasks=[row(tmp_path)], max_turn=3)
    with pytest.raises(ValueError, match="unknown SWE limit 'exec_timeout'; did you mean 'exec_timeout_s'"):
        gym.make("rlf/SWE-v0", tasks=[row(tmp_path)], limits={"exec_timeout": 5})


def test_a_missing_image_directory_or_archive_is_refused(tmp_path: Path) -> None:
    need_root()
    with pytest.raises(ValueError, match="no such directory"):
        gym.make("rlf/SWE-v0", tasks=[row(tmp_path)], image=str(tmp_path / "no-root"))
    with pytest.raises((ValueError, FileNotFoundError), match="nope.tar"):
        gym.make("rlf/SWE-v0", tasks=[row(tmp_path)], image=f"oci-archive:{tmp_path / 'nope.tar'}")
    with pytest.raises(ValueError, match="docker backend"):
        gym.make("rlf/SWE-v0", tasks=[row(tmp_path)], image="docker:rlf-debian-test:12")


def test_a_task_without_a_repository_is_refused(tmp_path: Path) -> None:
    need_root()
    with pytest.raises(ValueError, match="has no repository"):
        gym.make("rlf/SWE-v0", tasks=[row(tmp_path, repo_dir=None)])
    with pytest.raises(ValueError, match="not one of rlf's shipped archives"):
        gym.make("rlf/SWE-v0", tasks=[row(tmp_path, repo_dir=None, repo="no-such-project")])


def test_a_good_configuration_still_makes_the_env(tmp_path: Path) -> None:
    need_root()
    if session_image() is None:
        pytest.skip("no Debian test image")
    env = gym.make("rlf/SWE-v0", tasks=[row(tmp_path)])
    env.close()


def test_harbor_build_args_and_base_images_are_env_arguments() -> None:
    need_root()
    img = session_image()
    if img is None:
        pytest.skip("no Debian test image")
    with pytest.raises(ValueError, match="no root filesystem for image 'debian:bookworm-slim'"):
        gym.make("rlf/SWE-v0", task_file=str(HARBOR / "count-numbers"))
    env = gym.make("rlf/SWE-v0", task_file=str(HARBOR / "count-numbers"),
                   base_images={"debian:bookworm-slim": img})
    env.close()
    env = gym.make("rlf/SWE-v0", task_file=str(HARBOR / "sales-report"), build_args={"BASE_IMAGE": img})
    env.close()
    with pytest.raises(ValueError, match="build_args must map strings"):
        gym.make("rlf/SWE-v0", task_file=str(HARBOR / "sales-report"), build_args={"BASE_IMAGE": 3})


def test_docker_images_are_checked_against_the_engine(tmp_path: Path) -> None:
    try:
        from rlf_envs.sandbox.sessions import open_backend

        b = open_backend("docker")
    except Exception as e:
        pytest.skip(f"no docker engine ({type(e).__name__})")
    try:
        with pytest.raises(ValueError, match="docker:<ref>"):
            gym.make("rlf/SWE-v0", tasks=[row(tmp_path)], backend=b, image="rlf-debian-test:12")
        with pytest.raises(ValueError, match="holds no image 'no-such-image:0'"):
            gym.make("rlf/SWE-v0", tasks=[row(tmp_path)], backend=b, image="docker:no-such-image:0")
    finally:
        import asyncio

        asyncio.run(b.aclose())


def test_the_task_checker_reports_broken_tasks(tmp_path: Path) -> None:
    import json
    import shutil
    import subprocess
    import sys

    need_root()
    img = session_image()
    if img is None:
        pytest.skip("no Debian test image")
    (tmp_path / "a").mkdir()
    good = row(tmp_path / "a")
    (tmp_path / "b").mkdir()
    wrong_id = row(tmp_path / "b", instance_id="cfg-wrong-id", FAIL_TO_PASS=["test_m.py::test_no_such_test"])
    (tmp_path / "c").mkdir()
    already = row(tmp_path / "c", instance_id="cfg-p2p-fails")
    Path(already["repo_dir"], "test_m.py").write_text(
        "from m import X\n\n\ndef test_x():\n    assert X == 2\n\n\ndef test_flaky():\n    assert False\n")
    already["PASS_TO_PASS"] = ["test_m.py::test_flaky"]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in (good, wrong_id, already)))
    out = tmp_path / "report.json"
    p = subprocess.run([sys.executable, "-m", "rlf_envs.envs.swe.baseline", "--task-file", str(tasks), "--json",
                        str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stdout + p.stderr
    got = {c["task_id"]: c for c in json.loads(out.read_text())}
    assert got["cfg-1"]["ok"] and got["cfg-1"]["gold"] == 1.0 and got["cfg-1"]["untouched"] == 0.0
    assert got["cfg-wrong-id"]["unknown_tests"] == ["test_m.py::test_no_such_test"] and not got["cfg-wrong-id"]["ok"]
    assert got["cfg-p2p-fails"]["failing_untouched"] == ["test_m.py::test_flaky"]
    assert "1 of 3 tasks ok" in p.stdout and "unknown test ids: test_m.py::test_no_such_test" in p.stdout
    # a Harbor task whose test.sh never writes a reward: named, not a silent 0.0
    task = tmp_path / "harbor" / "fix-greeting"
    shutil.copytree(HARBOR / "fix-greeting", task)
    (task / "tests" / "test.sh").write_text("#!/bin/bash\necho checked\n")
    p = subprocess.run([sys.executable, "-m", "rlf_envs.envs.swe.baseline", "--task-file", str(task),
                        "--build-arg", f"BASE_IMAGE={img}"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 1 and "no_reward" in p.stdout, p.stdout + p.stderr


def test_the_prompt_asks_for_submit_only_and_submit_is_its_own_end_reason(tmp_path: Path) -> None:
    need_root()
    if session_image() is None:
        pytest.skip("no Debian test image")
    env = gym.make("rlf/SWE-v0", tasks=[row(tmp_path)]).unwrapped
    try:
        obs, _ = env.reset(seed=0)
        assert "submit()" in obs and "<answer>" not in obs
        o, *_ = env.step('<tool_call>{"name": "read_file", "arguments": {"path": "nope/missing.py"}}</tool_call>')
        assert "no such file: nope/missing.py" in o and "loc-" not in o
        _, r, term, _, info = env.step('<tool_call>{"name": "submit", "arguments": {}}</tool_call>')
        assert term and info["end_reason"] == "submit"
    finally:
        env.close()


def test_the_viewer_shows_no_gold_for_tasks_without_one(tmp_path: Path) -> None:
    from rlf_envs.records import TrajectoryRecord
    from rlf_envs.types import Task, Trajectory
    from rlf_envs.view import episode_view

    traj = Trajectory(task=Task(id="t", question="q", ground_truth=None), prompt="q")
    ep = episode_view(TrajectoryRecord.from_trajectory(traj, step=0, source="eval", index=0))
    assert ep["task"]["gold"] is None


def test_the_workspace_hides_the_repositorys_git_history_unless_asked(tmp_path: Path) -> None:
    import subprocess

    need_root()
    if session_image() is None:
        pytest.skip("no Debian test image")
    r = row(tmp_path)
    repo = Path(r["repo_dir"])
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=repo, check=True)
    subprocess.run(["git", "checkout", "-qb", "future"], cwd=repo, check=True)
    (repo / "m.py").write_text("X = 2\n")
    subprocess.run([*git, "commit", "-qam", "THE FIX"], cwd=repo, check=True)
    subprocess.run(["git", "checkout", "-q", "master" if subprocess.run(
        ["git", "rev-parse", "--verify", "-q", "master"], cwd=repo).returncode == 0 else "main"], cwd=repo, check=True)
    assert (repo / "m.py").read_text() == "X = 1\n"
    cmd = '{"name": "bash", "arguments": {"command": "git log --all --oneline; git reflog | head; git status --short"}}'
    for keep, visible in ((False, False), (True, True)):
        env = gym.make("rlf/SWE-v0", tasks=[{**r, "keep_history": keep}]).unwrapped
        try:
            env.reset(seed=0)
            o, *_ = env.step(f"<tool_call>{cmd}</tool_call>")
            assert ("THE FIX" in o) is visible, o
            if not keep:
                assert "starting state" in o and "[exit code 0]" in o
        finally:
            env.close()
