"""`python -m rlf_train.ui` end to end in a real headless browser (Debian's `chromium`, driven over the DevTools
protocol: tests/train/ui/cdp.py), on the quickstart: a pool with a real MCP server from PyPI (mcp-server-time) and a
Python tool, tried from the page; a server that does not start, a bad tool schema and hostile names and outputs;
the config's errors inline and the dry run's; a short run started, its curves growing, stopped, resumed to its end,
its trajectories in the viewer; the last page closing stops its run and its servers; the app's exit leaves nothing.

RLF_UI_SCREENSHOTS=DIR saves the docs' screenshots (docs/assets/web-ui-*.png) on the way."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from repo_paths import REPO

from rlf_train.config import ConfigError, load_config
from tests.envs.test_view import CHROMIUM, needs_browser
from tests.train.ui.cdp import Browser, Page
from tests.train.ui.hostile_mcp import CLOSE, PWN

pytestmark = needs_browser

BIN = Path(sys.executable).parent
TIME = {"command": str(BIN / "mcp-server-time"), "args": ["--local-timezone", "UTC"]}
EXITS = {"command": sys.executable, "args": ["-c", "import sys; sys.stderr.write('boom: no API key set\\n'); "
                                                  "sys.exit(3)"]}
HOSTILE_NAME = "<svg id=pwn2 onload=\"document.title='pwned'\">"
SHOTS = Path(os.environ["RLF_UI_SCREENSHOTS"]) if os.environ.get("RLF_UI_SCREENSHOTS") else None
#: a quickstart run kept short on 2 CPU cores (SFT warm start of a few steps; checkpoints every step)
SHORT = {"steps": 200, "sft": "on", "sft_steps": 8, "prompts_per_step": 2, "samples_per_prompt": 4, "eval_every": 0,
         "eval_num_tasks": 8, "save_every": 1}
SHORT_SETS = "sft.num_demos=64\nsft.batch_size=16\nrollout.batch_size=8\nlogging.trajectories=4\n" \
             "logging.trajectories_every=1\nlogging.tensorboard=false"


@dataclass
class App:
    proc: subprocess.Popen[bytes]
    url: str
    runs_dir: Path
    out: Path

    def log(self) -> str:
        return self.out.read_text(errors="replace")

    def api(self, method: str, path: str, body: Any = None) -> Any:
        req = urllib.request.Request(self.url + path.lstrip("/"), method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"X-RLF-UI": "1", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())

    def tree(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []


def gone(procs: list[psutil.Process], timeout: float = 60.0) -> list[psutil.Process]:
    deadline = time.time() + timeout
    left = procs
    while time.time() < deadline:
        left = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left:
            return []
        time.sleep(0.2)
    return left


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    root = tmp_path_factory.mktemp("ui")
    out = root / "app.out"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    with out.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "rlf_train.ui", "--port", "0", "--runs-dir", str(root / "runs"),
                                 "--page-grace", "2", "--stop-grace", "30"],
                                cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 120
    while "serving http" not in out.read_text() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    text = out.read_text()
    assert "serving http" in text, text
    url = text.split("serving ")[1].split()[0]
    a = App(proc, url, root / "runs", out)
    try:
        yield a
    finally:
        tree = a.tree()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
        assert not gone(tree), f"left running after the app exited: {tree}"


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def browser(loop: asyncio.AbstractEventLoop) -> Iterator[Browser]:
    assert CHROMIUM is not None
    b = loop.run_until_complete(Browser.launch(CHROMIUM, 1400, 1000))
    yield b
    loop.run_until_complete(b.close())


@pytest.fixture(scope="module")
def page(loop: asyncio.AbstractEventLoop, browser: Browser, app: App) -> Page:
    p = loop.run_until_complete(browser.new_page(app.url))
    loop.run_until_complete(p.wait("document.body.dataset.ready === '1'"))
    return p


async def shot(page: Page, name: str) -> None:
    if SHOTS is not None:
        SHOTS.mkdir(parents=True, exist_ok=True)
        await page.eval("window.scrollTo(0, 0)")
        await asyncio.sleep(0.3)
        await page.screenshot(SHOTS / f"web-ui-{name}.png")


def card(key: str) -> str:
    return f"document.querySelector({json.dumps(f'#sources [data-source={json.dumps(key)}]')})"


async def call_tool(page: Page, key: str, tool: str, arguments: dict[str, Any]) -> tuple[str, str]:
    """Open the tool's trial form (if closed), type the arguments, call it, wait for the result."""
    row = f"{card(key)}.querySelector({json.dumps(f'[data-tool={json.dumps(tool)}]')})"
    await page.eval(f"""(() => {{ const row = {row};
        if (row.querySelector('.trial').hidden) row.querySelector('.head button').click();
        row.querySelector('textarea').value = {json.dumps(json.dumps(arguments))};
        delete row.querySelector('.trial-result').dataset.status;
        row.querySelector('.trial button').click(); return true; }})()""")
    status = await page.wait(f"{row}.querySelector('.trial-result').dataset.status")
    return status, await page.eval(f"{row}.querySelector('.trial-result').textContent")


def test_a_pool_with_a_real_mcp_server_a_python_tool_and_bad_input(loop: asyncio.AbstractEventLoop, page: Page,
                                                                   app: App) -> None:
    async def go() -> None:
        text = json.dumps({"mcpServers": {"time": TIME, "broken": EXITS, HOSTILE_NAME: {
            "command": sys.executable, "args": [str(Path(__file__).parent / "hostile_mcp.py")]}}})
        await page.set_value("#servers-text", text)
        await page.click("#add-servers")
        await page.wait("document.querySelectorAll('#sources .source').length === 3 && "
                        "!document.querySelector('#sources .source.checking') && !document.querySelector("
                        "'#add-servers').disabled", timeout=120)
        assert await page.eval(f"{card('mcp:time')}.classList.contains('ok')")
        tools = await page.eval(f"Array.from({card('mcp:time')}.querySelectorAll('[data-tool]'))"
                                ".map(e => e.dataset.tool)")
        assert set(tools) == {"get_current_time", "convert_time"}
        schema = await page.eval(f"{card('mcp:time')}.querySelector('[data-tool=convert_time] details pre')"
                                 ".textContent")
        assert "source_timezone" in json.loads(schema)["properties"]  # the schema as the server lists it
        status, out = await call_tool(page, "mcp:time", "convert_time",
                                      {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"})
        assert status == "ok" and "+9.0h" in out and "Asia/Tokyo" in out
        status, out = await call_tool(page, "mcp:time", "convert_time", {"time": "12:00"})
        assert status == "invalid_args" and "required property" in out
        # a server that does not start: why, and its stderr
        broken = await page.eval(f"{card('mcp:broken')}.querySelector('pre.error').textContent")
        assert "failed to start: the server process exited" in broken and "boom: no API key set" in broken
        # hostile names, descriptions and outputs stay text; a broken schema is flagged
        hostile = f"mcp:{HOSTILE_NAME}"
        assert await page.eval(f"{card(hostile)}.querySelector('.name').textContent") == HOSTILE_NAME
        flagged = await page.eval(f"{card(hostile)}.querySelector('[data-tool=bad_schema] pre.error').textContent")
        assert flagged.startswith("bad tool schema: not a valid JSON Schema at properties/x/type")
        status, out = await call_tool(page, hostile, "echo", {"text": PWN})
        assert status == "ok" and PWN in out and CLOSE in out
        await no_injection(page)
        # Python tools: one whose schema cannot be made is refused with rlf's reason; a typed one is added and tried
        await page.set_value("#python-spec", "tests.train.ui.tool_samples:untyped")
        await page.click("#add-python")
        err = await page.wait("!document.querySelector('#pool-error').hidden && "
                              "document.querySelector('#pool-error').textContent")
        assert "bad tool schema: tool 'untyped': parameter 'x' has no type hint" in err
        await page.set_value("#python-spec", "tests.train.ui.tool_samples:shout")
        await page.click("#add-python")
        key = "python:tests.train.ui.tool_samples:shout"
        await page.wait(f"{card(key)} && {card(key)}.classList.contains('ok')")
        assert (await call_tool(page, key, "shout", {"text": "hi"}))[1].endswith("HI!")
        await page.eval(f"{card(hostile)}.querySelector('.head button.danger').click()")
        await page.wait(f"!{card(hostile)}")
        await shot(page, "pool")
        await page.eval(f"{card('mcp:broken')}.querySelector('.head button.danger').click()")
        await page.wait(f"!{card('mcp:broken')}")

    loop.run_until_complete(go())


async def no_injection(page: Page) -> None:
    assert await page.eval("document.title") == "rlf ui"
    assert await page.eval("!document.getElementById('pwn') && !document.getElementById('pwn2')")
    assert await page.eval("document.querySelectorAll('#sources img, #sources script, #sources svg').length") == 0
    assert PWN in await page.eval("document.body.textContent")


def test_the_configs_errors_inline_and_the_dry_runs(loop: asyncio.AbstractEventLoop, page: Page) -> None:
    async def go() -> None:
        await page.eval("location.hash = 'setup'")
        await page.wait("document.querySelector('#config-state').textContent === 'valid'")
        assert await page.eval("document.querySelector('#base-config').value") == "configs/quickstart.yaml"
        await page.set_value("#overrides", "algorithm.stepz=3")
        shown = await page.wait("document.querySelector('#config-state').textContent === 'invalid' && "
                                "document.querySelector('#config-error').textContent")
        with pytest.raises(ConfigError) as cli:
            load_config(REPO / "configs/quickstart.yaml", ["algorithm.stepz=3"])
        assert shown == str(cli.value)  # the command line's words
        assert await page.eval("document.querySelector('#start-run').disabled")
        await page.set_value("#overrides", "")
        await page.wait("document.querySelector('#config-state').textContent === 'valid'")
        # a tool env from the pool: the time server and the Python tool, the MCP example's tasks, the format reward
        await page.eval("document.querySelector('input[name=env-source][value=pool]').click()")
        await page.set_value("#env-tasks-path", "configs/mcp/time_tasks.jsonl")
        await page.set_value("#reward-kind", "format_em")
        await page.set_value("#t-sft", "off")
        await page.set_value("#t-steps", "1")
        yaml_text = await page.wait("document.querySelector('#config-state').textContent === 'valid' && "
                                    "document.querySelector('#config-yaml').textContent.includes('rlf_ui/Pool-v0') && "
                                    "document.querySelector('#config-yaml').textContent")
        assert "mcp_servers.json" in yaml_text and "tests.train.ui.tool_samples:shout" in yaml_text
        await page.click("#dry-run")
        await page.wait("document.querySelector('#dry-run-result').dataset.ok !== undefined && "
                        "!document.querySelector('#dry-run').disabled", timeout=240)
        result = await page.text("#dry-run-result")
        assert await page.eval("document.querySelector('#dry-run-result').dataset.ok") == "1", result
        assert "dry run passed" in result and "env: rlf_ui/Pool-v0" in result
        await shot(page, "setup")
        # what only the env knows is found by the dry run, in the command line's words
        await page.eval("document.querySelector('input[name=env-source][value=registered]').click()")
        await page.set_value("#env-id", "rlf/Search-v0")
        await page.set_value("#env-kwargs", "world: quickstart\nworldd: 1\nformat: search_r1")
        await page.set_value("#reward-kind", "config")
        await page.wait("document.querySelector('#config-state').textContent === 'valid'")
        await page.eval("delete document.querySelector('#dry-run-result').dataset.ok")
        await page.click("#dry-run")
        await page.wait("document.querySelector('#dry-run-result').dataset.ok !== undefined && "
                        "!document.querySelector('#dry-run').disabled", timeout=240)
        result = await page.text("#dry-run-result")
        assert await page.eval("document.querySelector('#dry-run-result').dataset.ok") == "0"
        assert "dry run failed" in result and "'worldd' is not an option of rlf/Search-v0" in result
        assert "did you mean 'world'?" in result

    loop.run_until_complete(go())


async def fill_quickstart(page: Page, name: str, steps: int = 200) -> None:
    await page.eval("location.hash = 'setup'")
    await page.eval("document.querySelector('input[name=env-source][value=config]').click()")
    await page.set_value("#reward-kind", "config")
    await page.set_value("#run-name", name)
    ids = {"steps": "t-steps", "sft": "t-sft", "sft_steps": "t-sft-steps", "prompts_per_step": "t-prompts",
           "samples_per_prompt": "t-samples", "eval_every": "t-eval-every", "eval_num_tasks": "t-eval-tasks",
           "save_every": "t-save-every"}
    for key, value in {**SHORT, "steps": steps}.items():
        await page.set_value(f"#{ids[key]}", str(value))
    await page.set_value("#overrides", SHORT_SETS)
    await page.wait(f"document.querySelector('#config-state').textContent === 'valid' && "
                    f"document.querySelector('#config-yaml').textContent.includes('name: {name}')")


def rl_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if r.get("stage") == "rl"]


def test_start_watch_stop_and_resume_a_quickstart_run(loop: asyncio.AbstractEventLoop, page: Page, app: App) -> None:
    async def go() -> None:
        await fill_quickstart(page, "qs")
        await page.click("#start-run")
        await page.wait("location.hash === '#runs/qs'")
        await page.wait("['running', 'finished'].includes(document.querySelector('#run-state').textContent)")
        # the curves grow while it trains (metrics.jsonl read on, polled by the page)
        n1 = int(await page.wait("Number(document.querySelector('#chart-reward').dataset.n) >= 4 && "
                                 "Number(document.querySelector('#chart-reward').dataset.n)", timeout=240))
        n2 = int(await page.wait(f"Number(document.querySelector('#chart-reward').dataset.n) > {n1} && "
                                 "Number(document.querySelector('#chart-reward').dataset.n)", timeout=120))
        assert n2 > n1
        assert "RL step" in await page.text("#run-progress")
        await page.wait("Number(document.querySelector('#chart-tools').dataset.n) > 0")
        await shot(page, "run")
        await page.click("#run-stop")
        await page.wait("document.querySelector('#run-state').textContent.startsWith('stopped')", timeout=90)
        run_dir = app.runs_dir / "qs"
        stopped_at = rl_steps(run_dir)[-1]
        assert 2 <= stopped_at < 200
        # the run dir reproduces it from the command line: its config and the command that ran
        assert load_config(run_dir / "config.yaml").name == "qs"
        assert f"--config {run_dir / 'config.yaml'}" in (run_dir / "ui.log").read_text()
        await page.wait("!document.querySelector('#run-resume').disabled")
        await page.set_value("#resume-steps", str(stopped_at + 2))
        await page.click("#run-resume")
        await page.wait("document.querySelector('#run-state').textContent.startsWith('finished')", timeout=240)
        steps = rl_steps(run_dir)
        assert steps == list(range(1, stopped_at + 3)) or steps[-2:] == [stopped_at + 1, stopped_at + 2], steps
        assert len(steps) == len(set(steps))  # resumed from its checkpoint: each step once
        assert "--resume" in (run_dir / "ui.log").read_text()
        shown = await page.wait(f"Number(document.querySelector('#chart-reward').dataset.n) === {2 * len(steps)} && "
                                "document.querySelector('#chart-reward').dataset.n")
        assert int(shown) == 2 * len(steps)  # reward_mean and success_rate at every step, after the resume's rewrite
        assert "stored training episode" in await page.text("#tool-stats-note")
        # the trajectories, in rlf_envs' viewer (served by the app, embedded and linked)
        await page.eval("document.querySelector('#viewer-details').open = true")
        await page.wait("document.querySelector('#viewer-frame').getAttribute('src') === '/runs/qs/viewer'")
        viewer = await page.browser.new_page(app.url + "runs/qs/viewer")
        await viewer.wait("document.body.dataset.ready === '1'")
        assert await viewer.eval("document.querySelectorAll('tr[data-key]').length") > 0
        await viewer.close()

    loop.run_until_complete(go())


def test_closing_the_last_page_stops_its_run_and_servers(loop: asyncio.AbstractEventLoop, page: Page,
                                                         app: App) -> None:
    async def go() -> None:
        await page.eval("location.hash = 'pool'")
        await page.eval(f"{card('mcp:time')}.querySelector('.head button').click()")
        await page.wait(f"{card('mcp:time')}.classList.contains('ok')", timeout=60)
        await fill_quickstart(page, "qs-close", steps=100_000)
        await page.click("#start-run")
        await page.wait("document.querySelector('#run-state').textContent === 'running' && "
                        "Number(document.querySelector('#chart-reward').dataset.n) >= 2", timeout=240)
        tree = app.tree()
        assert any("mcp-server-time" in " ".join(p.cmdline()) for p in tree)  # the pool's connection
        assert any("rlf_train" in p.cmdline() and "--config" in p.cmdline() for p in tree)  # the run
        await page.close()
        assert not gone(tree, timeout=90), "the run or the pool's server outlived the page"
        said = "the last page closed: stopped 1 run(s) ['qs-close']"
        deadline = time.time() + 30
        while said not in app.log() and time.time() < deadline:
            await asyncio.sleep(0.2)
        assert said in app.log()
        assert app.api("GET", "/api/runs/qs-close")["run"]["state"] == "stopped"
        assert app.proc.poll() is None  # the app itself keeps serving: a new page can resume the run

    loop.run_until_complete(go())


def test_the_apps_exit_stops_what_it_started(app: App) -> None:
    spec = {"name": "qs-exit", "base": "configs/quickstart.yaml", "training": {**SHORT, "steps": 100_000},
            "overrides": SHORT_SETS}
    assert app.api("POST", "/api/runs", spec)["state"] == "running"
    assert app.api("POST", "/api/pool/check", {"key": "mcp:time"})["source"]["status"] == "ok"
    deadline = time.time() + 240
    while time.time() < deadline and not (app.runs_dir / "qs-exit" / "metrics.jsonl").exists():
        time.sleep(0.5)
    tree = app.tree()
    assert len(tree) >= 2
    app.proc.send_signal(signal.SIGINT)
    assert app.proc.wait(90) == 0
    assert not gone(tree, timeout=30), "left running after the app exited"
    log = app.log()
    assert "stopping run(s) ['qs-exit']" in log and log.rstrip().endswith("rlf ui: stopped")
    assert "interrupted; checkpoints written so far are complete" in (app.runs_dir / "qs-exit" / "ui.log").read_text()


def test_with_a_token_the_printed_link_opens_the_page_and_the_viewer(loop: asyncio.AbstractEventLoop,
                                                                      browser: Browser, tmp_path: Path) -> None:
    """A token-guarded app (as beyond loopback): the printed link works, its token moves into the cookie, the
    page and its embedded (sandboxed) viewer load with it; without it nothing does."""
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("name: r1\n")
    (run / "metrics.jsonl").write_text('{"stage": "rl", "step": 1, "reward_mean": 0.5, "success_rate": 0.25}\n')
    out = tmp_path / "app.out"
    with out.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "rlf_train.ui", "--port", "0", "--runs-dir", str(run.parent),
                                 "--token", "t0ken-for-tests"], cwd=REPO, stdout=f, stderr=subprocess.STDOUT)

    async def go() -> None:
        deadline = time.time() + 120
        while "serving http" not in out.read_text() and time.time() < deadline:
            await asyncio.sleep(0.1)
        link = out.read_text().split("serving ")[1].split()[0]
        assert link.endswith("/?token=t0ken-for-tests")
        bare = link.split("?")[0]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(bare + "api/pool", timeout=30)
        assert refused.value.code == 401
        page = await browser.new_page(link)
        await page.wait("document.body.dataset.ready === '1'")
        assert await page.eval("location.href") == bare  # the token left the address bar
        await page.eval("location.hash = 'runs/r1'")
        await page.wait("Number(document.querySelector('#chart-reward').dataset.n) === 2")
        await page.eval("document.querySelector('#viewer-details').open = true")
        frame = None
        for _ in range(100):
            targets = (await browser.send("Target.getTargets"))["targetInfos"]
            frame = next((t["targetId"] for t in targets if t["type"] == "iframe" and "/runs/r1/viewer" in t["url"]),
                         None)
            if frame is not None:
                break
            await asyncio.sleep(0.1)
        assert frame is not None, "the viewer's frame did not load"
        session = (await browser.send("Target.attachToTarget", {"targetId": frame, "flatten": True}))["sessionId"]
        ready = "document.body && document.body.dataset.ready === '1' && document.title"
        for _ in range(100):
            title = (await browser.send("Runtime.evaluate", {"expression": ready, "returnByValue": True},
                                        session))["result"].get("value")
            if title:
                break
            await asyncio.sleep(0.1)
        assert title == "rlf viewer: r1"
        await page.close()

    try:
        loop.run_until_complete(go())
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
