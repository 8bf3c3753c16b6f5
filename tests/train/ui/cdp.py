"""A small Chrome DevTools Protocol client over aiohttp's websocket, to click through a page in the real headless
chromium (Debian's, the one `.ci/run` installs): launch it with `--remote-debugging-port=0`, open a tab, evaluate
JavaScript in it, wait for a condition, take a screenshot, close the tab (which fires the page's `pagehide`)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

DEVTOOLS = re.compile(rb"DevTools listening on (ws://\S+)")


class CDPError(RuntimeError):
    pass


class Browser:
    def __init__(self, proc: asyncio.subprocess.Process, profile: tempfile.TemporaryDirectory[str]) -> None:
        self.proc = proc
        self.profile = profile
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._stderr: asyncio.Task[None] | None = None

    @classmethod
    async def launch(cls, chromium: str, width: int = 1400, height: int = 1000) -> Browser:
        profile = tempfile.TemporaryDirectory()
        proc = await asyncio.create_subprocess_exec(
            chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
            "--disable-dev-shm-usage", "--hide-scrollbars", f"--window-size={width},{height}",
            f"--user-data-dir={profile.name}", "--remote-debugging-port=0", "about:blank",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        self = cls(proc, profile)
        assert proc.stderr is not None
        try:
            async with asyncio.timeout(60):
                while True:
                    line = await proc.stderr.readline()
                    if not line:
                        raise CDPError("chromium exited before it listened for DevTools")
                    m = DEVTOOLS.search(line)
                    if m:
                        url = m.group(1).decode()
                        break
        except BaseException:
            await self.close()
            raise
        self._stderr = asyncio.get_running_loop().create_task(self._drain(proc.stderr))
        self._http = aiohttp.ClientSession()
        self._ws = await self._http.ws_connect(url, max_msg_size=256 << 20)
        self._reader = asyncio.get_running_loop().create_task(self._read())
        return self

    @staticmethod
    async def _drain(stream: asyncio.StreamReader) -> None:
        while await stream.read(65536):
            pass

    async def _read(self) -> None:
        assert self._ws is not None
        async for msg in self._ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            fut = self._waiting.pop(data.get("id", -1), None)
            if fut is not None and not fut.done():
                if "error" in data:
                    fut.set_exception(CDPError(str(data["error"])))
                else:
                    fut.set_result(data.get("result", {}))
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(CDPError("the DevTools connection closed"))

    async def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
                   timeout: float = 60.0) -> Any:
        assert self._ws is not None
        i = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[i] = fut
        msg: dict[str, Any] = {"id": i, "method": method, "params": params or {}}
        if session is not None:
            msg["sessionId"] = session
        await self._ws.send_str(json.dumps(msg))
        async with asyncio.timeout(timeout):
            return await fut

    async def new_page(self, url: str) -> Page:
        target = (await self.send("Target.createTarget", {"url": "about:blank"}))["targetId"]
        session = (await self.send("Target.attachToTarget", {"targetId": target, "flatten": True}))["sessionId"]
        page = Page(self, target, session)
        await page.send("Page.enable")
        await page.send("Runtime.enable")
        await page.goto(url)
        return page

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            if self._ws is not None:
                await self.send("Browser.close", timeout=10)
        if self._reader is not None:
            self._reader.cancel()
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(20):
                await self.proc.wait()
        if self._stderr is not None:
            self._stderr.cancel()
        self.profile.cleanup()


class Page:
    def __init__(self, browser: Browser, target: str, session: str) -> None:
        self.browser = browser
        self.target = target
        self.session = session

    async def send(self, method: str, params: dict[str, Any] | None = None, timeout: float = 60.0) -> Any:
        return await self.browser.send(method, params, self.session, timeout)

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", {"url": url})
        await self.wait("document.readyState === 'complete'", timeout=60)

    async def eval(self, expr: str, timeout: float = 60.0) -> Any:
        """The value of a JS expression (awaited if it is a promise)."""
        r = await self.send("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True},
                            timeout=timeout)
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            raise CDPError(f"{expr[:200]}: {d.get('exception', {}).get('description') or d.get('text')}")
        return r.get("result", {}).get("value")

    async def wait(self, expr: str, timeout: float = 60.0, every: float = 0.2) -> Any:
        """Poll `expr` until it is truthy; its value."""
        last: Any = None
        try:
            async with asyncio.timeout(timeout):
                while True:
                    last = await self.eval(expr)
                    if last:
                        return last
                    await asyncio.sleep(every)
        except TimeoutError:
            raise AssertionError(f"waited {timeout:g}s for: {expr} (last value: {last!r})") from None

    async def set_value(self, selector: str, value: str) -> None:
        """Type `value` into an input/textarea/select (as the user would: input and change events)."""
        await self.eval(f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
            if (!e) throw new Error('no element ' + {json.dumps(selector)});
            e.value = {json.dumps(value)};
            e.dispatchEvent(new Event('input', {{bubbles: true}}));
            e.dispatchEvent(new Event('change', {{bubbles: true}})); return true; }})()""")

    async def click(self, selector: str) -> None:
        await self.eval(f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
            if (!e) throw new Error('no element ' + {json.dumps(selector)});
            if (e.disabled) throw new Error('disabled: ' + {json.dumps(selector)});
            e.click(); return true; }})()""")

    async def text(self, selector: str) -> str:
        return str(await self.eval(f"(document.querySelector({json.dumps(selector)}) || {{}}).textContent || ''"))

    async def screenshot(self, path: Path, full_page: bool = True) -> Path:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            metrics = await self.send("Page.getLayoutMetrics")
            size = metrics.get("cssContentSize") or metrics["contentSize"]
            params["clip"] = {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], 4000),
                              "scale": 1}
            params["captureBeyondViewport"] = True
        data = await self.send("Page.captureScreenshot", params)
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    async def close(self) -> None:
        """Close the tab the way a user does (the page gets `pagehide`)."""
        await self.browser.send("Target.closeTarget", {"targetId": self.target})
