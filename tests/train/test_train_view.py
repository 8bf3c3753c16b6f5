"""Trajectory records of a real short training run, and the viewer on them in a real headless browser
(Debian's `chromium`): the page loads, lists the run's episodes, the filters work, the same task is shown at
two steps, and a screenshot is taken. The viewer itself (and its no-torch tests) is in rlf_envs: test_view.py."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rlf_envs.records import list_steps, read_records
from rlf_envs.view import ViewError, load_run, main, make_server
from rlf_train.trainer import Trainer
from tests.envs.test_view import chromium, dump, needs_browser
from tests.train.test_end_to_end import _cfg, register


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run: SFT warm start, eval at step 0, 2 GRPO steps storing training episodes each step, eval at 2;
    then `rlf_train.eval` of the final checkpoint."""
    from rlf_train.eval import main as eval_main

    run = tmp_path_factory.mktemp("view") / "run"
    Trainer(_cfg(run, 2, ["logging.trajectories=4", "logging.trajectories_every=1"])).run()
    cfg_path = run.parent / "c.yaml"
    cfg_path.write_text((run / "config.yaml").read_text())
    register()
    assert eval_main(["--config", str(cfg_path), "--trajectories", "2"]) == 0
    return run


def test_training_writes_trajectory_records(run_dir: Path) -> None:
    assert [s for s, _ in list_steps(run_dir)] == [0, 1, 2]
    by_step = {s: read_records(p) for s, p in list_steps(run_dir)}
    sources = {s: sorted({r.source for r in recs}) for s, recs in by_step.items()}
    assert sources == {0: ["eval_greedy", "eval_sampled"], 1: ["train"],
                       2: ["eval_greedy", "eval_sampled", "offline_eval_greedy", "offline_eval_sampled", "train"]}
    assert sum(r.source == "eval_greedy" for r in by_step[2]) == 4
    assert sum(r.source == "offline_eval_greedy" for r in by_step[2]) == 2
    # the same held-out tasks at every eval, so steps can be compared
    assert [r.task.id for r in by_step[0] if r.source == "eval_greedy"] == [
        r.task.id for r in by_step[2] if r.source == "eval_greedy"]
    r = by_step[1][0]
    assert r.token_ids and r.loss_mask and len(r.token_ids) == len(r.loss_mask) and r.turns
    s, e = r.turns[0].action_span  # type: ignore[misc]
    assert set(r.loss_mask[s:e]) == {1}
    # a TensorBoard text sample per eval
    events = b"".join(p.read_bytes() for p in (run_dir / "tb" / "eval").iterdir())  # text samples: eval axis
    assert b"episode/eval_greedy" in events


def test_load_run_and_errors(run_dir: Path, tmp_path: Path) -> None:
    data = load_run(run_dir)
    assert len(data["episodes"]) == sum(len(read_records(p)) for _, p in list_steps(run_dir))
    assert data["metrics"]["rl"] and data["metrics"]["eval"]
    ep = next(e for e in data["episodes"] if e["source"] == "train")
    assert ep["mask_runs"][0][2] == 0 and any(run[2] == 1 for run in ep["mask_runs"])
    assert ep["turns"][0]["action_tokens"]["trained"] == ep["turns"][0]["action_tokens"]["tokens"]
    with pytest.raises(ViewError, match="not a directory"):
        load_run(tmp_path / "missing")
    with pytest.raises(ViewError, match="no trajectories"):
        load_run(tmp_path)


@pytest.fixture(scope="module")
def page(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("html") / "run.html"
    assert main([str(run_dir), "--out", str(out)]) == 0
    return out


@needs_browser
def test_browser_shows_the_runs_episodes_and_filters_work(run_dir: Path, page: Path) -> None:
    eps = load_run(run_dir)["episodes"]
    url = page.as_uri()
    at2 = [e for e in eps if e["step"] == 2 and e["source"] == "eval_greedy"]
    dom = dump(url)  # default: the last step, greedy eval
    assert [r["data-key"] for r in dom.rows] == [e["key"] for e in at2]
    assert {"curves", "detail", "compare"} <= dom.ids and "svg" in dom.tags
    assert "policy · turn 1" in " ".join(dom.text)

    def expect(pred: Callable[[dict[str, Any]], bool], frag: str, source: str = "eval_greedy", step: int = 2) -> None:
        want = [e["key"] for e in eps if e["step"] == step and (source == "*" or e["source"] == source) and pred(e)]
        got = [r["data-key"] for r in dump(f"{url}#step={step}&source={source}&{frag}").rows]
        assert got == want, frag

    expect(lambda e: e["success"], "filter=success")
    expect(lambda e: not e["success"], "filter=failed")
    expect(lambda e: e["tool_errors"] > 0 or any(t["kind"] == "invalid" for t in e["turns"]), "filter=tool_errors",
           source="train", step=1)
    expect(lambda e: e["end_reason"] in ("max_turns", "token_budget"), "filter=truncated", source="*")
    task = at2[1]["task"]["id"]
    expect(lambda e: e["task"]["id"] == task, f"task={task}", source="*")
    # filters must actually filter something in this run
    assert {e["success"] for e in eps} == {True, False} or {e["end_reason"] for e in eps} != {"answer"}
    # the same held-out task at step 0 and step 2, side by side
    dom = dump(f"{url}#step=2&ep={at2[0]['key']}")
    assert "compare-cols" in dom.ids
    assert "step 0 · eval_greedy" in " ".join(dom.text) and "step 2 · eval_greedy" in " ".join(dom.text)


@needs_browser
def test_served_page_and_screenshot(run_dir: Path, tmp_path: Path) -> None:
    server = make_server(run_dir, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        with urllib.request.urlopen(url, timeout=30) as resp:
            assert resp.status == 200 and b"rlf-data" in resp.read()
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(url + "etc/passwd", timeout=30)
        dom = dump(url)
        assert dom.rows
        shot = tmp_path / "viewer.png"
        chromium([f"--screenshot={shot}", "--window-size=1400,1000", "--hide-scrollbars"], url)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_rlf_train_view_still_imports_the_viewer() -> None:
    """Old scripts use `rlf_train.view`; it re-exports the viewer that moved to rlf_envs."""
    import rlf_train.view as legacy

    assert legacy.main is main and legacy.load_run is load_run
