"""Trajectory records of a real short training run, and the viewer on them in a real headless browser
(Debian's `chromium`): the page loads, lists the run's episodes, the filters work, the same task is shown at
two steps, hostile trajectory text stays text, and a screenshot is taken."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from rlf_envs.records import TrajectoryRecord, list_steps, read_records, write_records
from rlf_envs.types import Action, ActionKind, EndReason, Task, ToolCall, ToolResult, ToolStatus, Trajectory, Turn
from rlf_train.trainer import Trainer
from rlf_train.view import ViewError, load_run, main, make_server, render_html
from tests.test_train_loop import _cfg, register

pytestmark = pytest.mark.train


def find_chromium() -> str | None:
    for name in (os.environ.get("RLF_CHROMIUM"), "chromium", "chromium-browser", "google-chrome", "chrome"):
        if name and (path := shutil.which(name)):
            return path
    return None


CHROMIUM = find_chromium()
needs_browser = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium found (apt-get install chromium, or set RLF_CHROMIUM); browser tests skipped")


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


# ------------------------------------------------------------------------------------------ hostile text
PWN = "<img id=pwn src=x onerror=\"document.title='pwned'\">"
CLOSE = "</script><script>document.title='pwned'</script><!--"
HOSTILE = [PWN, CLOSE, "\u2028\u2029", "'\"><svg id=pwn2 onload=\"document.title='pwned'\">", "&lt;b&gt;&amp;"]


def hostile_run(root: Path) -> Path:
    """Records with markup in every text field a policy or tool could fill."""
    text = " ".join(HOSTILE)
    recs = []
    for k in range(3):
        task = Task(id=f"t{k}{CLOSE}", question=f"Q{k} {text}", ground_truth=[text])
        call = ToolCall(f"search{PWN}", {"query": text, PWN: CLOSE})
        turns = [
            Turn(Action(ActionKind.TOOL_CALLS, f"<search>{text}</search>", calls=(call,)),
                 results=[ToolResult(call, f"Doc 1 {text}", ToolStatus.ERROR, 0.01)], observation=text, reward=0.5),
            Turn(Action(ActionKind.INVALID, text, error=text), observation=text),
            Turn(Action(ActionKind.ANSWER, f"<answer>{text}</answer>", answer=text)),
        ]
        traj = Trajectory(task=task, prompt=f"prompt {text}", turns=turns, answer=text, end=EndReason.ANSWER,
                          reward=float(k == 0))
        recs.append(TrajectoryRecord.from_trajectory(traj, source=f"eval{CLOSE}", step=k % 2, index=k, error=text))
    write_records(root / "trajectories" / "step_0.jsonl", [r for r in recs if r.step == 0])
    write_records(root / "trajectories" / "step_1.jsonl", [r for r in recs if r.step == 1])
    (root / "metrics.jsonl").write_text('{"stage": "rl", "step": 1, "reward_mean": 0.5, "note": "' +
                                        PWN.replace('"', "'") + '"}\n{torn line')
    return root


def test_page_source_never_holds_raw_markup_from_records(tmp_path: Path) -> None:
    html = render_html(load_run(hostile_run(tmp_path)))
    assert html.count("</script>") == 2  # the data block's and the script's own
    assert "<img" not in html and "<svg" not in html and "\u2028" not in html
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', html)
    assert csp and "default-src 'none'" in csp.group(1) and "unsafe-inline" not in csp.group(1).split(";")[1]


# ------------------------------------------------------------------------------------------ the browser
class DOM(HTMLParser):
    """The few things the tests read from a dumped DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, str]] = []
        self.body: dict[str, str] = {}
        self.ids: set[str] = set()
        self.tags: list[str] = []
        self.title = ""
        self._in_title = False
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.tags.append(tag)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "tr" and "data-key" in a:
            self.rows.append(a)
        if tag == "body":
            self.body = a
        self._in_title = tag == "title"

    def handle_endtag(self, tag: str) -> None:
        self._in_title = False

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
        self.text.append(data)


def chromium(args: list[str], url: str) -> str:
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory() as profile:
        cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
               "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--virtual-time-budget=10000", *args, url]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def dump(url: str) -> DOM:
    dom = DOM()
    dom.feed(chromium(["--dump-dom"], url))
    assert dom.body.get("data-ready") == "1", "the page's script did not finish rendering"
    return dom


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
def test_browser_keeps_hostile_text_as_text(tmp_path: Path) -> None:
    out = tmp_path / "h.html"
    assert main([str(hostile_run(tmp_path / "run")), "--out", str(out)]) == 0
    for frag in ("", "#step=1&source=*", "#filter=tool_errors&source=*"):
        dom = dump(out.as_uri() + frag)
        assert dom.title.startswith("rlf viewer") and "pwned" not in dom.title
        assert "pwn" not in dom.ids and "pwn2" not in dom.ids and "img" not in dom.tags
        assert dom.rows, "the hostile episodes are listed"
        assert PWN in "".join(dom.text)  # shown, as text


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


def test_an_api_eval_dir_is_viewable(tmp_path: Path) -> None:
    """`python -m rlf_envs.eval` writes records and a summary.json, no metrics.jsonl: the viewer shows both."""
    hostile_run(tmp_path)
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "summary.json").write_text('{"success_rate": 0.25, "reward_mean": 0.5}')
    data = load_run(tmp_path)
    assert data["metrics"]["eval"] == [{"step": 0, "success_api": 0.25, "reward_api": 0.5}]
    assert len(data["episodes"]) == 3
