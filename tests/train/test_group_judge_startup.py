"""The group judge is checked when the run starts (and by --dry-run, the same way): a base_url where nothing
answers, or a model the endpoint does not serve, is a ConfigError naming the key; a run where no group can be judged
for 3 steps in a row stops instead of training on fallback scores."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest
from repo_paths import REPO

from rlf_train.config import ConfigError
from rlf_train.group_reward import GroupReward


class _Models(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"object": "list", "data": [{"id": "judge-model", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a: Any) -> None:
        pass


@pytest.fixture()
def models_server() -> Any:
    srv = HTTPServer(("127.0.0.1", 0), _Models)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group(base_url: str, model: str) -> GroupReward:
    g = GroupReward.from_config({"type": "group_judge", "base_url": base_url, "model": model}, None)
    assert g is not None
    return g


def test_a_judge_endpoint_that_does_not_answer_is_refused_naming_the_key() -> None:
    g = _group(f"http://127.0.0.1:{_free_port()}/v1", "judge-model")
    try:
        with pytest.raises(ConfigError, match="group_reward.base_url: no OpenAI-compatible endpoint answers"):
            g.check_endpoint(timeout_s=5)
    finally:
        g.close()


def test_a_model_the_endpoint_does_not_serve_is_refused_and_a_good_one_passes(models_server: str) -> None:
    bad = _group(models_server, "no-such-model")
    good = _group(models_server, "judge-model")
    try:
        with pytest.raises(ConfigError, match="group_reward.model: .* serves judge-model, not 'no-such-model'"):
            bad.check_endpoint()
        good.check_endpoint()
    finally:
        bad.close()
        good.close()


def test_a_run_where_nothing_can_be_judged_stops() -> None:
    g = _group("http://127.0.0.1:9/v1", "judge-model")
    counters = {"groups": 0.0, "fallbacks": 0.0, "errors": 0.0}

    def metrics() -> dict[str, float]:
        return dict(counters)

    g.verifier.metrics = metrics  # type: ignore[method-assign]
    g._before = metrics()
    import rlf_train.group_reward as mod

    real = mod.GroupReward.apply

    def step(judged: bool) -> None:
        counters["groups"] += 4
        counters["fallbacks"] += 0 if judged else 4
        counters["errors"] += 0 if judged else 4

    try:
        import rlf_envs.rewards as rewards

        orig = rewards.score_groups

        async def no_scoring(*a: Any, **k: Any) -> None:
            return None

        rewards.score_groups = no_scoring  # type: ignore[assignment]
        try:
            for judged in (False, False, True, False, False):  # a judged step resets the count
                step(judged)
                real(g, [], 4)
            step(False)
            with pytest.raises(RuntimeError, match="no group could be judged for 3 steps in a row"):
                real(g, [], 4)
        finally:
            rewards.score_groups = orig  # type: ignore[assignment]
        assert "groups" in g.summary() and "scored by the fallback" in g.summary()
    finally:
        g.close()


def test_dry_run_refuses_group_reward_typos_and_a_dead_judge_as_the_run_does(tmp_path: Any) -> None:

    from rlf_train.cli import preflight
    from rlf_train.config import load_config

    root = REPO
    base = [f"logging.run_dir={tmp_path / 'run'}"]
    typo = load_config(root / "configs" / "quickstart.yaml", [*base, "group_reward={type: group_judge, base_url: "
                                                               "'http://127.0.0.1:9/v1', model: j, fallbak: 0.5}"])
    with pytest.raises(ConfigError, match="fallbak"):
        preflight(typo)
    dead = load_config(root / "configs" / "quickstart.yaml", [*base, "group_reward={type: group_judge, base_url: "
                                                               f"'http://127.0.0.1:{_free_port()}/v1', model: j}}"])
    with pytest.raises(ConfigError, match="no OpenAI-compatible endpoint answers"):
        preflight(dead)
