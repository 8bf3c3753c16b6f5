"""The trainer config's `sessions` section: where coding-agent sandboxes run. Its backend goes to the env, its ray
settings to this process and to OpenRLHF's Ray workers; a disagreeing env.kwargs.backend is refused."""

from __future__ import annotations

import pytest
from repo_paths import REPO

from rlf_train.config import TrainConfig


def test_the_sessions_backend_reaches_the_env_and_the_ray_settings_the_workers() -> None:
    cfg = TrainConfig.model_validate({"env": {"id": "rlf/SWE-v0"}, "sessions": {
        "backend": "ray", "address": "10.0.0.1:6379", "nodes": "resource:sandbox", "per_node": 32}})
    assert cfg.env.kwargs["backend"] == "ray"
    assert cfg.sessions is not None and cfg.sessions.env_vars() == {
        "RLF_RAY_SESSION_INNER": "local", "RLF_RAY_ADDRESS": "10.0.0.1:6379",
        "RLF_RAY_SESSION_NODES": "resource:sandbox", "RLF_RAY_SESSIONS_PER_NODE": "32"}
    local = TrainConfig.model_validate({"env": {"id": "rlf/SWE-v0"}, "sessions": {"backend": "docker"}})
    assert local.env.kwargs["backend"] == "docker" and local.sessions is not None and local.sessions.env_vars() == {}


def test_a_disagreeing_env_backend_and_typos_are_refused() -> None:
    with pytest.raises(ValueError, match="disagree"):
        TrainConfig.model_validate({"env": {"id": "rlf/SWE-v0", "kwargs": {"backend": "local"}},
                                    "sessions": {"backend": "ray"}})
    with pytest.raises(ValueError):
        TrainConfig.model_validate({"sessions": {"backend": "rey"}})
    with pytest.raises(ValueError):
        TrainConfig.model_validate({"sessions": {"backend": "ray", "per_nod": 3}})


def test_the_swe_recipe_passes_the_dry_run() -> None:

    from session_support import need_sessions

    from rlf_train.cli import preflight
    from rlf_train.config import load_config

    need_sessions()
    cfg = load_config(REPO / "configs" / "swe_cpu.yaml")
    assert cfg.env.id == "rlf/SWE-v0" and cfg.env.kwargs["backend"] == "local"
    preflight(cfg)
