"""Harbor tasks, loaded unchanged: task.toml (both spellings), Dockerfile replay plans (and refusals by name),
reward.txt / reward.json, and the shipped test tasks end to end on the local backend (oracle 1.0, untouched 0.0)
with the locally built Debian root as their base image (a build ARG). The docker backend runs them when an engine
answers and holds the Debian test image (`RLF_DOCKER_TEST_IMAGE`, default `rlf-debian-test:12`, which .ci/run
imports); it skips with the reason otherwise."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest
from repo_paths import SUPPORT

import rlf_envs  # noqa: F401 - registers the ids
from rlf_envs.tasks.harbor import (
    HarborError,
    load_harbor_dir,
    load_harbor_task,
    parse_dockerfile,
    parse_reward,
    parse_task_toml,
    plan_dockerfile,
)
from tests.envs.envs.swe import test_swe_docker

DOCKER_IMAGE = test_swe_docker.DOCKER_IMAGE
docker_backend = test_swe_docker.docker_backend  # the fixture: a backend of the test's own, closed after
TASKS = SUPPORT / "harbor_tasks"


def _image() -> str | None:
    try:
        from rlf_envs.sandbox.sessions.images import debian_test_image
    except ImportError:
        return None
    return debian_test_image()


def _skip_without_sessions() -> None:
    if os.geteuid() != 0:
        pytest.skip("the local session backend needs root")
    if _image() is None:
        pytest.skip("no Debian test image: run `python -m rlf_envs.sandbox.sessions.images build-debian`")


def test_task_toml_both_spellings() -> None:
    old = load_harbor_task(TASKS / "fix-greeting").config
    assert old.schema == "1.0" and old.name == "fix-greeting" and old.verifier_timeout_s == 60.0
    assert old.memory_mb == 1024 and old.storage_mb == 1024 and old.network is False
    assert old.metadata["difficulty"] == "easy"
    new = load_harbor_task(TASKS / "count-numbers").config
    assert new.schema == "1.1" and new.name == "rlf-tests/count-numbers" and new.memory_mb == 1024
    assert new.network is False and new.verifier_env == {"EXPECTED_FILE": "/data/answer.txt"}
    with pytest.raises(HarborError, match="version"):
        parse_task_toml("[verifier]\ntimeout_sec = 1\n", "x/task.toml", "x")
    with pytest.raises(HarborError, match="not TOML"):
        parse_task_toml("version = ", "x/task.toml", "x")
    with pytest.raises(HarborError, match="size"):
        parse_task_toml('version = "1.0"\n[environment]\nmemory = "lots"\n', "x/task.toml", "x")
    cfg = parse_task_toml('version = "1.0"\n[environment]\nmemory = "512M"\nfuture_key = 3\n[newsection]\na = 1\n',
                          "x", "x")
    assert cfg.memory_mb == 512  # unknown keys are ignored, as Harbor ignores them


def test_dockerfile_plan_replays_and_refuses_by_name(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    plan = plan_dockerfile(TASKS / "count-numbers" / "environment", TASKS / "count-numbers" / "environment" /
                           "Dockerfile", build_args={"BASE_IMAGE": str(root)})
    assert plan.base == str(root) and plan.workdir == "/data" and plan.env["DATA_DIR"] == "/data"
    assert list(plan.seed.values()) == ["extra/more.txt"]
    runs = [s for s in plan.steps if s[0] == "run"]
    assert len(runs) == 1 and "numbers.txt" in runs[0][1] and runs[0][3]["COUNT"] == "5"
    plan2 = plan_dockerfile(TASKS / "count-numbers" / "environment", TASKS / "count-numbers" / "environment" /
                            "Dockerfile", build_args={"BASE_IMAGE": str(root), "COUNT": "9"})
    assert next(s for s in plan2.steps if s[0] == "run")[3]["COUNT"] == "9"
    with pytest.raises(HarborError, match="no root filesystem for image 'debian:bookworm-slim'"):
        plan_dockerfile(TASKS / "fix-greeting" / "environment", TASKS / "fix-greeting" / "environment" / "Dockerfile")
    for line, word in [("USER nobody", "USER"), ("ADD x.tar /", "ADD of an archive"),
                       ("ADD https://example.com/a.txt /a", "ADD of a URL"), ("SHELL [\"/bin/sh\"]", "SHELL"),
                       ("COPY --from=build /a /b", "--from"),
                       (f"FROM {root}", "multi-stage"), ("RUN --mount=type=cache,target=/x true", "RUN options")]:
        df = tmp_path / "Dockerfile"
        df.write_text(f"FROM {root}\nWORKDIR /app\n{line}\n")
        with pytest.raises(HarborError, match=word) as e:
            plan_dockerfile(tmp_path, df)
        assert ":3:" in str(e.value)
    (tmp_path / "a.txt").write_text("a\n")
    df.write_text(f"FROM {root}\nUSER root\nWORKDIR /app\nVOLUME /data\nADD a.txt /opt/a.txt\nADD a.txt ./\n")
    plan3 = plan_dockerfile(tmp_path, df)  # USER root and VOLUME change nothing; ADD of a local file is COPY
    assert plan3.seed == {str((tmp_path / "a.txt").resolve()): "a.txt"}
    assert [s[2] for s in plan3.steps if s[0] == "file"] == ["/opt/a.txt"]
    df.write_text(f"FROM {root}\nRUN true\n")
    with pytest.raises(HarborError, match="WORKDIR"):
        plan_dockerfile(tmp_path, df)
    df.write_text(f"FROM {root}\nWORKDIR /app\nCOPY missing.txt /app/\n")
    with pytest.raises(HarborError, match="no file 'missing.txt'"):
        plan_dockerfile(tmp_path, df)


def test_dockerfile_parser_continuations_and_comments() -> None:
    ins = parse_dockerfile("# c\nFROM x\n\nRUN a \\\n  && b\n# mid\nENV A=1 B=\"two words\"\n", "D")
    assert [(i.keyword, i.line) for i in ins] == [("FROM", 2), ("RUN", 4), ("ENV", 7)]
    assert ins[1].args.split() == ["a", "&&", "b"]


def test_reward_files() -> None:
    assert parse_reward(b"1\n", None) == 1.0 and parse_reward(b"0.25", b"{}") == 0.25
    assert parse_reward(None, b'{"reward": 0.5, "x": 1}') == 0.5
    assert parse_reward(None, b'{"a": 1, "b": 0}') == 0.5
    assert parse_reward(b"junk", None) is None and parse_reward(None, b"[1]") is None
    assert parse_reward(None, None) is None


def test_loader_errors(tmp_path: Path) -> None:
    with pytest.raises(HarborError, match="no Harbor task"):
        load_harbor_dir(tmp_path)
    d = tmp_path / "t"
    shutil.copytree(TASKS / "fix-greeting", d)
    (d / "tests" / "test.sh").unlink()
    with pytest.raises(HarborError, match="tests/test.sh"):
        load_harbor_task(d)
    tasks = load_harbor_dir(TASKS)
    assert sorted(t.id for t in tasks) == ["fix-greeting", "rlf-tests/count-numbers", "sales-report"]


def _solve_actions(task_dir: Path) -> list[str]:
    """The scripted baseline for a Harbor task: the oracle's solve.sh through the agent's tools."""
    from rlf_envs.envs.swe.baseline import harbor_oracle_actions

    return harbor_oracle_actions(str(task_dir))


def _episode(env: Any, task_id: str, actions: list[str]) -> tuple[float, dict[str, Any]]:
    env.reset(options={"task_id": task_id})
    for a in actions:
        _, r, term, trunc, info = env.step(a)
        if term or trunc:
            return r, info
    raise AssertionError("episode did not end")


@pytest.mark.parametrize("name,task_id", [("fix-greeting", "fix-greeting"),
                                          ("count-numbers", "rlf-tests/count-numbers"),
                                          ("sales-report", "sales-report")])
def test_oracle_scores_one_untouched_zero_local(name: str, task_id: str) -> None:
    _skip_without_sessions()
    tasks = load_harbor_dir(TASKS, build_args={"BASE_IMAGE": str(_image())})
    env = gym.make("rlf/SWE-v0", tasks=tasks).unwrapped
    try:
        r, info = _episode(env, task_id, _solve_actions(TASKS / name))
        assert r == 1.0 and info["infra_failed"] is False, info["trajectory"].score_info
        r0, info0 = _episode(env, task_id, ['<tool_call>{"name": "submit", "arguments": {}}</tool_call>'])
        assert r0 == 0.0 and info0["infra_failed"] is False
    finally:
        env.close()


def test_harbor_through_task_file_and_json_reward(tmp_path: Path) -> None:
    _skip_without_sessions()
    # the task's FROM names debian:bookworm-slim: without a root for it the local backend refuses it at once
    with pytest.raises(ValueError, match="no root filesystem for image 'debian:bookworm-slim'"):
        gym.make("rlf/SWE-v0", task_file=str(TASKS / "count-numbers"))
    tasks = load_harbor_dir(TASKS / "count-numbers", base_images={"debian:bookworm-slim": str(_image())})
    env = gym.make("rlf/SWE-v0", tasks=tasks).unwrapped
    try:
        r, info = _episode(env, "rlf-tests/count-numbers", [
            '<tool_call>{"name": "bash", "arguments": {"command": "echo 42 > answer.txt; ls"}}</tool_call>',
            '<tool_call>{"name": "submit", "arguments": {}}</tool_call>'])
        assert r == 0.0 and info["infra_failed"] is False  # a wrong answer: reward.json says 0.0
    finally:
        env.close()


@pytest.mark.parametrize("name,task_id", [("fix-greeting", "fix-greeting"),
                                          ("count-numbers", "rlf-tests/count-numbers"),
                                          ("sales-report", "sales-report")])
def test_oracle_scores_one_untouched_zero_docker(docker_backend: Any, name: str, task_id: str) -> None:
    """The image built from the task's Dockerfile by the engine (FROM the Debian test image, a build ARG)."""
    tasks = load_harbor_dir(TASKS / name, build_args={"BASE_IMAGE": DOCKER_IMAGE})
    env = gym.make("rlf/SWE-v0", tasks=tasks, backend=docker_backend).unwrapped
    try:
        r, info = _episode(env, task_id, _solve_actions(TASKS / name))
        assert r == 1.0, info["trajectory"].score_info
        r0, info0 = _episode(env, task_id, ['<tool_call>{"name": "submit", "arguments": {}}</tool_call>'])
        assert r0 == 0.0 and info0["infra_failed"] is False, info0["trajectory"].score_info
    finally:
        env.close()


def test_swe_bench_style_jsonl_loads(tmp_path: Path) -> None:
    from rlf_envs.envs.swe.tasks import load_swe_jsonl

    rows = [{"instance_id": "org__repo-1", "repo": "org/repo", "base_commit": "abc", "problem_statement": "bug",
             "patch": "", "test_patch": "", "FAIL_TO_PASS": '["t.py::a"]', "PASS_TO_PASS": "[]",
             "image": "docker:swebench/sweb.eval.x86_64.org__repo-1", "version": "1.0",
             "environment_setup_commit": "def", "created_at": "2024", "hints_text": ""}]
    p = tmp_path / "swe.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    [t] = load_swe_jsonl(p)
    assert t.id == "org__repo-1" and t.meta["swe"]["workdir"] == "/testbed"
    assert t.meta["swe"]["FAIL_TO_PASS"] == ["t.py::a"]


def _write_task(d: Path, dockerfile: str, test_sh: str, files: dict[str, str] | None = None) -> Path:
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "instruction.md").write_text("Do the thing.\n")
    (d / "task.toml").write_text('version = "1.0"\n\n[verifier]\ntimeout_sec = 60.0\n\n[agent]\ntimeout_sec = 60.0\n'
                                 '\n[environment]\nbuild_timeout_sec = 60.0\nmemory = "1G"\n')
    (d / "environment" / "Dockerfile").write_text(dockerfile)
    for name, text in (files or {}).items():
        (d / "environment" / name).write_text(text)
    (d / "tests" / "test.sh").write_text(test_sh)
    return d


def _outside_task(tmp_path: Path, base: str, chmod: bool = True) -> list[Any]:
    """COPY to /usr/local/bin (the source's mode kept), COPY --chmod (BuildKit's: not in the classic builder that the
    docker SDK drives), RUN writing /opt and the workdir."""
    note, run, mode = ("--chmod=700 ", "--chmod=755 ", "700") if chmod else ("", "", "644")
    d = _write_task(tmp_path / "outside", "ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\nWORKDIR /app\n"
                    f"COPY tool.sh /usr/local/bin/tool\nCOPY {note}note.txt /opt/note.txt\nCOPY {run}run.sh ./\n"
                    "RUN mkdir -p /opt/data && echo 7 > /opt/data/n && tool > /app/from-run.txt\n",
                    "#!/bin/bash\nmkdir -p /logs/verifier\n"
                    f"[ \"$(cat /opt/data/n)\" = 7 ] && [ \"$(stat -c %a /opt/note.txt)\" = {mode} ] && "
                    "[ -f /app/answer.txt ] && echo 1 > /logs/verifier/reward.txt || echo 0 > "
                    "/logs/verifier/reward.txt\n",
                    {"tool.sh": "#!/bin/sh\necho from-tool\n", "note.txt": "n\n", "run.sh": "#!/bin/sh\necho ran\n"})
    (d / "environment" / "tool.sh").chmod(0o755)
    if not chmod:
        (d / "environment" / "run.sh").chmod(0o755)
    return load_harbor_dir(d, build_args={"BASE_IMAGE": base})


def _check_outside(env: Any, task_id: str) -> None:
    env.reset(options={"task_id": task_id})
    obs, *_ = env.step('<tool_call>{"name": "bash", "arguments": {"command": "cat from-run.txt; tool; '
                       './run.sh; touch answer.txt"}}</tool_call>')
    assert "from-tool\nfrom-tool\nran" in obs, obs
    _, r, term, _, info = env.step('<tool_call>{"name": "submit", "arguments": {}}</tool_call>')
    assert term and r == 1.0 and info["infra_failed"] is False, info["trajectory"].score_info
    r0, _ = _episode(env, task_id, ['<tool_call>{"name": "submit", "arguments": {}}</tool_call>'])
    assert r0 == 0.0


def test_local_replay_writes_outside_the_workdir_like_docker(tmp_path: Path) -> None:
    _skip_without_sessions()
    tasks = _outside_task(tmp_path, str(_image()))
    env = gym.make("rlf/SWE-v0", tasks=tasks).unwrapped
    try:
        _check_outside(env, tasks[0].id)
    finally:
        env.close()


def test_docker_build_of_the_same_task_scores_the_same(docker_backend: Any, tmp_path: Path) -> None:
    tasks = _outside_task(tmp_path, DOCKER_IMAGE, chmod=False)
    env = gym.make("rlf/SWE-v0", tasks=tasks, backend=docker_backend).unwrapped
    try:
        _check_outside(env, tasks[0].id)
    finally:
        env.close()


def test_docker_build_failure_is_an_infrastructure_failure(docker_backend: Any, tmp_path: Path) -> None:
    d = _write_task(tmp_path / "broken", "ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\nWORKDIR /app\n"
                    "RUN echo step-output && exit 3\n", "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    tasks = load_harbor_dir(d, build_args={"BASE_IMAGE": DOCKER_IMAGE})
    env = gym.make("rlf/SWE-v0", tasks=tasks, backend=docker_backend).unwrapped
    try:
        env.reset(options={"task_id": tasks[0].id})
        obs, *_ = env.step('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>')
        assert "infrastructure failure" in obs and "docker build" in obs and "step-output" in obs, obs
        _, r, term, _, info = env.step('<tool_call>{"name": "submit", "arguments": {}}</tool_call>')
        assert term and r == 0.0 and info["infra_failed"] is True
    finally:
        env.close()


def test_local_run_step_needing_the_network_fails_naming_the_step(tmp_path: Path) -> None:
    _skip_without_sessions()
    d = _write_task(tmp_path / "net", "ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\nWORKDIR /app\n"
                    "RUN python3 -c \"import urllib.request; urllib.request.urlopen('http://deb.debian.org', "
                    "timeout=5)\"\n", "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    tasks = load_harbor_dir(d, build_args={"BASE_IMAGE": str(_image())})
    env = gym.make("rlf/SWE-v0", tasks=tasks).unwrapped
    try:
        env.reset(options={"task_id": tasks[0].id})
        obs, *_ = env.step('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>')
        assert "infrastructure failure" in obs and "Dockerfile RUN" in obs and "urlopen" in obs, obs
        assert "offline" in obs
        _, r, term, _, info = env.step('<tool_call>{"name": "submit", "arguments": {}}</tool_call>')
        assert term and r == 0.0 and info["infra_failed"] is True
    finally:
        env.close()
