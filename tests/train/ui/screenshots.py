"""The docs' screenshots of `python -m rlf_train.ui` (docs/guides/web-ui.md), taken in the real headless chromium:

    python tests/train/ui/screenshots.py docs/assets

A pool (mcp-server-time from PyPI, a server that does not start, a Python tool), a tool env set up from it and
checked by the dry run, and a quickstart run long enough for its curves to move (5-10 minutes on 2 CPU cores).
Not a test (pytest does not collect it); the tests take the same steps in tests/train/ui/test_ui_browser.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "support")]

from tests.envs.test_view import CHROMIUM  # noqa: E402
from tests.train.ui.cdp import Browser  # noqa: E402
from tests.train.ui.test_ui_browser import call_tool, card  # noqa: E402

BIN = Path(sys.executable).parent
SERVERS = {"mcpServers": {
    "time": {"command": "mcp-server-time", "args": ["--local-timezone", "UTC"], "autoApprove": ["get_current_time"]},
    "weather": {"command": "weather-mcp-server", "args": ["--units", "metric"], "env": {"WEATHER_API_KEY": "..."}},
}}


async def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp())
    log = root / "app.out"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    with log.open("wb") as f:
        app = subprocess.Popen([sys.executable, "-m", "rlf_train.ui", "--port", "0", "--runs-dir", str(root / "runs")],
                               cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
    while "serving http" not in log.read_text():
        time.sleep(0.1)
    url = log.read_text().split("serving ")[1].split()[0]
    assert CHROMIUM is not None
    browser = await Browser.launch(CHROMIUM, 1400, 1000)
    try:
        page = await browser.new_page(url)
        await page.wait("document.body.dataset.ready === '1'")
        await page.set_value("#servers-text", json.dumps(SERVERS, indent=1))
        await page.click("#add-servers")
        await page.wait("document.querySelectorAll('#sources .source').length === 2 && "
                        "!document.querySelector('#add-servers').disabled", timeout=120)
        await page.set_value("#python-spec", "rlf_envs.envs.demo")
        await page.click("#add-python")
        await page.wait(f"!!{card('python:rlf_envs.envs.demo')}", timeout=60)
        await call_tool(page, "mcp:time", "convert_time",
                        {"source_timezone": "Europe/Paris", "time": "09:30", "target_timezone": "Asia/Tokyo"})
        await page.eval("window.scrollTo(0, 0)")
        await page.screenshot(out / "web-ui-pool.png")

        await page.eval("location.hash = 'setup'")
        await page.wait("document.querySelector('#config-state').textContent === 'valid'")
        await page.eval("document.querySelector('input[name=env-source][value=pool]').click()")
        await page.eval("document.querySelector('#env-pool-sources input[value=\"mcp:weather\"]').click()")
        await page.set_value("#env-tasks-path", "configs/mcp/time_tasks.jsonl")
        await page.set_value("#reward-kind", "format_em")
        await page.set_value("#t-sft", "on")
        await page.set_value("#t-sft-demos", "configs/mcp/time_demos.jsonl")
        await page.set_value("#t-steps", "20")
        await page.set_value("#run-name", "time-tools")
        await page.wait("document.querySelector('#config-state').textContent === 'valid' && "
                        "document.querySelector('#config-yaml').textContent.includes('name: time-tools')")
        await page.click("#dry-run")
        await page.wait("document.querySelector('#dry-run-result').dataset.ok !== undefined && "
                        "!document.querySelector('#dry-run').disabled", timeout=300)
        await page.eval("window.scrollTo(0, 0)")
        await page.screenshot(out / "web-ui-setup.png")

        # a quickstart run long enough to move: its SFT warm start (1500 steps), then 40 GRPO steps, eval every 10
        await page.eval("document.querySelector('input[name=env-source][value=config]').click()")
        await page.set_value("#reward-kind", "config")
        await page.set_value("#t-sft-demos", "")
        for sel, value in (("#run-name", "quickstart-ui"), ("#t-steps", "40"), ("#t-eval-every", "10"),
                           ("#t-eval-tasks", "64"), ("#t-save-every", "10"),
                           ("#overrides", "logging.trajectories_every=5")):
            await page.set_value(sel, value)
        await page.wait("document.querySelector('#config-state').textContent === 'valid' && "
                        "document.querySelector('#config-yaml').textContent.includes('name: quickstart-ui')")
        await page.click("#start-run")
        await page.wait("document.querySelector('#run-state').textContent.startsWith('finished')", timeout=1800,
                        every=2.0)
        await asyncio.sleep(2)
        await page.eval("window.scrollTo(0, 0)")
        await page.screenshot(out / "web-ui-run.png")
        await page.eval("document.querySelector('#viewer-details').open = true")
        await asyncio.sleep(4)
        await page.eval("document.querySelector('#viewer-details').scrollIntoView()")
        await page.screenshot(out / "web-ui-viewer.png", full_page=False)
    finally:
        await browser.close()
        app.send_signal(signal.SIGINT)
        app.wait(120)
    print(f"wrote {', '.join(sorted(p.name for p in out.glob('web-ui-*.png')))} to {out}")


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/assets")))
