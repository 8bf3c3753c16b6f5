"""The trajectory viewer (`python -m rlf_envs.view`, `rlf-view`) without the trainer: no torch. Records are built
from env types, the page is rendered and opened in a real headless browser (Debian's `chromium`): hostile
trajectory text stays text, an API-eval directory (`python -m rlf_envs.eval`) is viewable, the CLI runs, bad
directories are refused with the reason, and the page's assets ship inside rlf_envs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

from rlf_envs.records import TrajectoryRecord, write_records
from rlf_envs.types import Action, ActionKind, EndReason, Task, ToolCall, ToolResult, ToolStatus, Trajectory, Turn
from rlf_envs.view import ASSETS, ViewError, load_run, main, render_html


def find_chromium() -> str | None:
    for name in (os.environ.get("RLF_CHROMIUM"), "chromium", "chromium-browser", "google-chrome", "chrome"):
        if name and (path := shutil.which(name)):
            return path
    return None


CHROMIUM = find_chromium()
needs_browser = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium found (apt-get install chromium, or set RLF_CHROMIUM); browser tests skipped")


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


def test_an_api_eval_dir_is_viewable(tmp_path: Path) -> None:
    """`python -m rlf_envs.eval` writes records and a summary.json, no metrics.jsonl: the viewer shows both."""
    hostile_run(tmp_path)
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "summary.json").write_text('{"success_rate": 0.25, "reward_mean": 0.5}')
    data = load_run(tmp_path)
    assert data["metrics"]["eval"] == [{"step": 0, "success_api": 0.25, "reward_api": 0.5}]
    assert len(data["episodes"]) == 3


def test_load_run_refuses_what_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(ViewError, match="not a directory"):
        load_run(tmp_path / "missing")
    with pytest.raises(ViewError, match="no trajectories"):
        load_run(tmp_path)


def test_cli_writes_the_page_without_torch(tmp_path: Path) -> None:
    """`python -m rlf_envs.view DIR --out F` in a fresh interpreter: a page, and torch never imported."""
    run = hostile_run(tmp_path / "run")
    out = tmp_path / "page.html"
    code = ("import runpy, sys; sys.argv = ['rlf_envs.view', sys.argv[1], '--out', sys.argv[2]]\n"
            "try:\n    runpy.run_module('rlf_envs.view', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'the viewer imported torch'")
    proc = subprocess.run([sys.executable, "-c", code, str(run), str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rlf-data" in out.read_text()
    bad = subprocess.run([sys.executable, "-m", "rlf_envs.view", str(tmp_path / "nope"), "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "not a directory" in bad.stderr


def test_viewer_assets_live_in_the_rlf_envs_package() -> None:
    """The wheel of rlf-envs ships src/rlf_envs entirely (hatch), so the assets must sit inside the package."""
    import rlf_envs

    pkg = Path(rlf_envs.__file__).parent
    assert ASSETS.is_relative_to(pkg)
    assert {p.name for p in ASSETS.iterdir()} >= {"viewer.html", "viewer.js", "viewer.css"}


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the viewer's JavaScript")
def test_viewer_counts_agree_in_number() -> None:
    """The run header said "at 1 steps": counts go through one helper that writes "1 step", "2 steps"."""
    js = (ASSETS / "viewer.js").read_text()
    m = re.search(r"^  function count\(n, noun\) \{.*?\}$", js, re.M)
    assert m is not None
    code = m.group(0) + '\nconsole.log([count(1, "step"), count(2, "step"), count(0, "stored episode")].join("|"));'
    out = subprocess.run(["node", "-e", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "1 step|2 steps|0 stored episodes"
    assert not re.search(r'\+ " (steps|tokens|stored episodes)', js)  # no count spelt by hand
