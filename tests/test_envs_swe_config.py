"""rlf/SWE-v0 refuses a misconfigured host when the env is made (house rule 9), saying how to fix it, instead of
showing the host's error to the policy and scoring 0.0: an unknown backend, a missing image directory or archive, a
docker image the engine does not hold or without its prefix, a task without a repository, unknown arguments and
limits. Harbor's build_args/base_images are env arguments."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest

import rlf_envs  # noqa: F401 - registers the ids
from rlf_envs.data.swe.generate import unified_diff

pytestmark = pytest.mark.envs

HARBOR = Path(__file__).resolve().parent / "harbor_tasks"


def _image() -> str | None:
    try:
        from rlf_envs.sandbox.sessions.images import debian_test_image
    except ImportError:
        return None
    return debian_test_image()


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the local session backend needs root")


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
    _need_root()
    with pytest.raises(ValueError, match="no such directory"):
        gym.make("rlf/SWE-v0", tasks=[row(tmp_path)], image=str(tmp_path / "no-root"))
    with pytest.raises((ValueError, FileNotFoundError), match="nope.tar"):
        gym.make("rlf/SWE-v0", tasks=[row(tmp_path)], image=f"oci-archive:{tmp_path / 'nope.tar'}")
    with pytest.raises(ValueError, match="docker backend"):
        gym.make("rlf/SWE-v0", tasks=[row(tmp_path)], image="docker:rlf-debian-test:12")


def test_a_task_without_a_repository_is_refused(tmp_path: Path) -> None:
    _need_root()
    with pytest.raises(ValueError, match="has no repository"):
        gym.make("rlf/SWE-v0", tasks=[row(tmp_path, repo_dir=None)])
    with pytest.raises(ValueError, match="not one of rlf's shipped archives"):
        gym.make("rlf/SWE-v0", tasks=[row(tmp_path, repo_dir=None, repo="no-such-project")])


def test_a_good_configuration_still_makes_the_env(tmp_path: Path) -> None:
    _need_root()
    if _image() is None:
        pytest.skip("no Debian test image")
    env = gym.make("rlf/SWE-v0", tasks=[row(tmp_path)])
    env.close()


def test_harbor_build_args_and_base_images_are_env_arguments() -> None:
    _need_root()
    img = _image()
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
