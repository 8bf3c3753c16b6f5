"""rlf/SWE-v0 on the docker backend: repository tasks in an engine image (`image="docker:REF"`, the Debian test
image that .ci/run imports as rlf-debian-test:12; RLF_DOCKER_TEST_IMAGE overrides), scored by the hidden tests in a
fresh container. Skips with the reason without the docker SDK, an engine (DOCKER_HOST) or that image."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest

import rlf_envs  # noqa: F401 - registers the ids
from rlf_envs.envs.swe.tasks import shipped_tasks
from tests.envs.envs.swe.test_swe_env import call, run_episode, tiny_row

DOCKER_IMAGE = os.environ.get("RLF_DOCKER_TEST_IMAGE", "rlf-debian-test:12")


def docker_ready(image: str = DOCKER_IMAGE) -> str | None:
    """None when the docker backend can run sessions of `image`, else why not (the skip reason)."""
    try:
        import docker
    except ImportError:
        return "the docker SDK is not installed (pip install 'rlf-envs[docker]')"
    try:
        c = docker.from_env(timeout=5)
        try:
            c.ping()
            c.images.get(image)
        finally:
            c.close()
    except Exception as e:
        return f"no docker engine with the image {image} ({type(e).__name__}; see DOCKER_HOST and .ci/run)"
    return None


def own_containers() -> list[Any]:
    import docker

    c = docker.from_env(timeout=30)
    try:
        return list(c.containers.list(all=True, filters={"label": [f"rlf.owner.pid={os.getpid()}"]}))
    finally:
        c.close()


@pytest.fixture
def docker_backend() -> Any:
    """A docker backend of the test's own (closed after it, so its warm pool leaves no container behind)."""
    why = docker_ready()
    if why:
        pytest.skip(why)
    from rlf_envs import runtime
    from rlf_envs.sandbox.sessions import open_backend

    before = {c.id for c in own_containers()}
    b = runtime.run(_open(open_backend))
    try:
        yield b
    finally:
        runtime.run(b.aclose())
    left = [c for c in own_containers() if c.id not in before]
    assert left == [], f"containers left behind: {left}"


async def _open(open_backend: Any) -> Any:
    return open_backend("docker", pool_size=1)


def test_tiny_repository_gold_one_untouched_zero_docker(docker_backend: Any, tmp_path: Path) -> None:
    env = gym.make("rlf/SWE-v0", tasks=[tiny_row(tmp_path)], backend=docker_backend,
                   image=f"docker:{DOCKER_IMAGE}", limits={"exec_timeout_s": 180.0}).unwrapped
    try:
        r, info, obs = run_episode(env, [
            call("bash", command="python3 -m pytest -q -o addopts= tests 2>&1 | tail -3"),
            call("edit", path="calc/__init__.py", old="if x < hi:", new="if x > hi:"),
            call("submit")])
        assert "2 failed" in obs[0], obs[0]
        assert r == 1.0 and info["infra_failed"] is False, info["trajectory"].score_info
        assert "diff --git a/calc/__init__.py" in info["trajectory"].answer
        r0, info0, _ = run_episode(env, [call("submit")])
        assert r0 == 0.0 and info0["infra_failed"] is False
        assert info0["trajectory"].score_info["swe/f2p_passed"] == 0.0
    finally:
        env.close()


def test_shipped_tasks_gold_one_broken_zero_docker(docker_backend: Any) -> None:
    """One shipped task per project (two hidden runs each) in fresh containers of the engine image."""
    import asyncio

    from rlf_envs import runtime
    from rlf_envs.envs.swe.env import SweVerifier

    by_repo: dict[str, Any] = {}
    tasks = shipped_tasks("train") + shipped_tasks("test")
    for t in random.Random(1).sample(tasks, len(tasks)):
        by_repo.setdefault(t.meta["swe"]["repo"], t)
    ver = SweVerifier(docker_backend, image=f"docker:{DOCKER_IMAGE}")

    async def one(t: Any) -> tuple[str, float, float, str]:
        gold = await ver.verdict(t.meta["swe"]["patch"], t)
        broken = await ver.verdict("", t)
        err = gold.error or broken.error or ""
        return (t.id, -1.0 if gold.infra_failed else gold.value, -1.0 if broken.infra_failed else broken.value, err)

    async def all_() -> list[tuple[str, float, float, str]]:
        return list(await asyncio.gather(*(one(t) for t in by_repo.values())))

    got = runtime.run(all_())
    assert len(got) >= 4
    bad = [v for v in got if v[1:3] != (1.0, 0.0)]
    assert not bad, bad


def test_docker_backend_instance_needs_an_image_too(docker_backend: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="docker:<ref>"):
        gym.make("rlf/SWE-v0", tasks=[tiny_row(tmp_path)], backend=docker_backend)
