"""The web UI's server (aiohttp) and its command line: `python -m rlf_train.ui [--host H] [--port N] [--runs-dir D]`.

Who may use it: bound to a loopback address (the default), anyone on this machine; bound anywhere else, only who
has the token (printed at start, or `--token` / RLF_UI_TOKEN), checked on every request with a constant-time
compare (a cookie set from the first `?token=` link, or the `X-RLF-Token` header). Whoever passes can run commands
here (an MCP server is a command), so the checks come first on every request: the Host header must be the
app's own on a loopback bind (DNS rebinding), and a request that changes anything must carry `X-RLF-UI: 1` and a
same-origin Origin (no other site's page can make it): `rlf_train.ui.security`.

Lifetime: runs started here are stopped (SIGINT, then killed after a grace) and the pool's servers closed when the
app exits, and also when its last page closes (the page says goodbye on `pagehide`; one not heard from for
`--page-timeout` seconds counts as closed) unless `--keep-runs`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic
from aiohttp import web

from rlf_train.config import ConfigError, load_config
from rlf_train.ui.pool import PoolError, ToolPool, check_name, parse_servers_text
from rlf_train.ui.runs import RunError, RunManager
from rlf_train.ui.security import error_response, is_loopback, make_guard
from rlf_train.ui.spec import POOL_ENV, DryRuns, PoolSnapshot, RunSpec, compose, write_files

STATIC = Path(__file__).parent / "static"
STATIC_FILES = {"app.js": "text/javascript", "app.css": "text/css"}
DEFAULT_PORT = 8766
PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
            "frame-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    runs_dir: Path = Path("runs")
    cwd: Path = field(default_factory=Path.cwd)
    token: str | None = None
    keep_runs: bool = False
    page_timeout_s: float = 180.0
    page_grace_s: float = 10.0
    stop_grace_s: float = 30.0
    dry_run_timeout_s: float = 300.0

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def state_dir(self) -> Path:
        return self.runs_dir / ".rlf-ui"


class ServerEntry(pydantic.BaseModel):
    """One MCP server filled in on the page (command/args/env for stdio, or a URL)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    name: str
    command: str = ""
    args: list[str] = []
    env: dict[str, str] = {}
    url: str = ""
    headers: dict[str, str] = {}
    timeout: float | None = None

    def entry(self) -> dict[str, Any]:
        e: dict[str, Any] = {}
        if self.command.strip():
            e["command"] = self.command.strip()
            if self.args:
                e["args"] = self.args
            if self.env:
                e["env"] = self.env
        if self.url.strip():
            e["url"] = self.url.strip()
            if self.headers:
                e["headers"] = self.headers
        if self.timeout is not None:
            e["timeout"] = self.timeout
        return e


class UiApp:
    """State of one app: the pool, the runs, the dry runs, the pages that are open."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.s.runs_dir = self.s.runs_dir if self.s.runs_dir.is_absolute() else (self.s.cwd / self.s.runs_dir)
        self.pool = ToolPool(settings.state_dir / "pool.json", log_dir=settings.state_dir / "logs")
        self.runs = RunManager(self.s.runs_dir, self.s.cwd, stop_grace_s=settings.stop_grace_s)
        self.dry_runs = DryRuns(self.s.cwd, timeout_s=settings.dry_run_timeout_s)
        self.pages: dict[str, float] = {}
        self.pages_gone_since: float | None = None
        self.had_pages = False
        self.port = settings.port
        self.stop_event = asyncio.Event()
        self._ticker: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def host(self) -> str:
        return self.s.host

    @property
    def token(self) -> str | None:
        return self.s.token

    def say(self, msg: str) -> None:
        print(f"rlf ui: {msg}", flush=True)

    # -- the page's lifecycle ------------------------------------------------------------------------
    def seen(self, page: str | None) -> None:
        if page and len(page) <= 64:
            if not self.pages:
                self.pages_gone_since = None
            self.pages[page] = time.monotonic()
            self.had_pages = True

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                self.runs.tick()
                now = time.monotonic()
                for page, t in list(self.pages.items()):
                    if now - t > self.s.page_timeout_s:
                        self.pages.pop(page, None)
                if self.had_pages and not self.pages:
                    if self.pages_gone_since is None:
                        self.pages_gone_since = now
                    elif now - self.pages_gone_since > self.s.page_grace_s:
                        self.had_pages = False
                        await self.on_last_page_closed()
            except Exception as e:  # the ticker must not die
                self.say(f"ticker: {type(e).__name__}: {e}")

    async def on_last_page_closed(self) -> None:
        stopped = [] if self.s.keep_runs else await self.runs.stop_all()
        closed = await self.pool.disconnect_all()
        if stopped or closed:
            self.say(f"the last page closed: stopped {len(stopped)} run(s) {stopped} (their checkpoints are kept; "
                     f"--keep-runs keeps runs going without a page), closed {closed} MCP server connection(s)")

    async def start(self, app: web.Application) -> None:
        self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def close(self, app: web.Application | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        running = self.runs.running()
        if running:
            self.say(f"stopping run(s) {running} (SIGINT; killed after {self.s.stop_grace_s:g}s)")
        await self.runs.stop_all()
        await self.dry_runs.aclose()
        await self.pool.disconnect_all()

    def pool_snapshot(self) -> PoolSnapshot:
        return PoolSnapshot(servers=self.pool.servers_file(None)["mcpServers"], python=self.pool.python_specs())


# ----------------------------------------------------------------------------------------------- handlers
async def _body(request: web.Request) -> dict[str, Any]:
    try:
        data = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        raise web.HTTPBadRequest(text=json.dumps({"error": "the request body is not JSON"}),
                                 content_type="application/json") from None
    if not isinstance(data, dict):
        raise web.HTTPBadRequest(text=json.dumps({"error": "the request body must be a JSON object"}),
                                 content_type="application/json")
    return data


def _spec(data: Any) -> RunSpec:
    try:
        return RunSpec.model_validate(data)
    except pydantic.ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
        raise PoolError(f"the run setup is incomplete: {problems}") from None


def routes(ui: UiApp) -> web.RouteTableDef:
    r = web.RouteTableDef()

    def api(fn: Callable[[web.Request], Awaitable[Any]]) -> Handler:
        async def wrapped(request: web.Request) -> web.StreamResponse:
            try:
                out = await fn(request)
            except web.HTTPException:
                raise
            except RunError as e:
                return error_response(409, str(e))
            except (PoolError, ConfigError, ValueError) as e:
                return error_response(400, str(e))
            except Exception as e:  # a bug: say what, keep serving
                return error_response(500, f"{type(e).__name__}: {e}")
            if isinstance(out, web.StreamResponse):
                return out
            return web.json_response(out, dumps=lambda o: json.dumps(o, default=str))

        return wrapped

    @r.get("/")
    async def index(request: web.Request) -> web.StreamResponse:
        resp = web.FileResponse(STATIC / "index.html")
        resp.headers["Content-Security-Policy"] = PAGE_CSP
        resp.headers["Content-Type"] = "text/html; charset=utf-8"
        return resp

    @r.get("/static/{name}")
    async def static(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in STATIC_FILES:
            raise web.HTTPNotFound(text="no such file")
        return web.Response(body=(STATIC / name).read_bytes(), content_type=STATIC_FILES[name], charset="utf-8")

    @r.get("/api/state")
    @api
    async def state(request: web.Request) -> Any:
        return {"cwd": str(ui.s.cwd), "runs_dir": str(ui.s.runs_dir), "keep_runs": ui.s.keep_runs,
                "token_required": ui.s.token is not None, "python": sys.executable,
                "configs": _configs(ui.s.cwd), "envs": _envs(), "page_timeout_s": ui.s.page_timeout_s}

    @r.post("/api/hello")
    @api
    async def hello(request: web.Request) -> Any:
        return {"pages": len(ui.pages)}

    @r.post("/api/bye")
    @api
    async def bye(request: web.Request) -> Any:
        ui.pages.pop(request.headers.get("X-RLF-Page", ""), None)
        return {"pages": len(ui.pages)}

    # -- pool
    @r.get("/api/pool")
    @api
    async def pool(request: web.Request) -> Any:
        return {"sources": [v.model_dump() for v in ui.pool.views()]}

    @r.post("/api/pool/servers")
    @api
    async def add_servers(request: web.Request) -> Any:
        data = await _body(request)
        if "entry" in data:
            try:
                e = ServerEntry.model_validate(data["entry"])
            except pydantic.ValidationError as err:
                raise PoolError("; ".join(f"{'.'.join(str(x) for x in x_['loc'])}: {x_['msg']}"
                                          for x_ in err.errors())) from None
            entries = {check_name(e.name.strip()): e.entry()}
        else:
            entries = parse_servers_text(str(data.get("text", "")))
        views = await ui.pool.add_servers(entries)
        return {"added": [v.model_dump() for v in views], "sources": [v.model_dump() for v in ui.pool.views()]}

    @r.post("/api/pool/python")
    @api
    async def add_python(request: web.Request) -> Any:
        v = await ui.pool.add_python(str((await _body(request)).get("spec", "")))
        return {"added": v.model_dump(), "sources": [x.model_dump() for x in ui.pool.views()]}

    @r.post("/api/pool/check")
    @api
    async def check(request: web.Request) -> Any:
        v = await ui.pool.check(str((await _body(request)).get("key", "")))
        return {"source": v.model_dump(), "sources": [x.model_dump() for x in ui.pool.views()]}

    @r.post("/api/pool/remove")
    @api
    async def remove(request: web.Request) -> Any:
        await ui.pool.remove(str((await _body(request)).get("key", "")))
        return {"sources": [x.model_dump() for x in ui.pool.views()]}

    @r.post("/api/pool/try")
    @api
    async def try_tool(request: web.Request) -> Any:
        data = await _body(request)
        res = await ui.pool.try_tool(str(data.get("key", "")), str(data.get("tool", "")),
                                     str(data.get("arguments", "{}")))
        return res.model_dump()

    # -- config
    @r.get("/api/config/base")
    @api
    async def base(request: web.Request) -> Any:
        return _base_summary(ui.s.cwd, request.query.get("path", ""))

    @r.post("/api/config/preview")
    @api
    async def preview(request: web.Request) -> Any:
        spec = _spec(await _body(request))
        return compose(spec, cwd=ui.s.cwd, runs_dir=ui.s.runs_dir, pool=ui.pool_snapshot()).view()

    @r.post("/api/config/check")
    @api
    async def check_config(request: web.Request) -> Any:
        spec = _spec(await _body(request))
        staging = ui.s.state_dir / "check" / spec.name if spec.name else ui.s.state_dir / "check" / "_"
        c = compose(spec, cwd=ui.s.cwd, runs_dir=ui.s.runs_dir, pool=ui.pool_snapshot(), files_dir=staging)
        if c.error is not None or c.config is None:
            return {"composed": c.view(), "dry_run": None}
        write_files(c, staging)
        result = await ui.dry_runs.run(c.yaml, staging)
        return {"composed": c.view(), "dry_run": result.model_dump()}

    # -- runs
    @r.get("/api/runs")
    @api
    async def runs(request: web.Request) -> Any:
        return {"runs": [ui.runs.view(n).model_dump() for n in ui.runs.names()]}

    @r.post("/api/runs")
    @api
    async def start(request: web.Request) -> Any:
        spec = _spec(await _body(request))
        c = compose(spec, cwd=ui.s.cwd, runs_dir=ui.s.runs_dir, pool=ui.pool_snapshot())
        if c.error is not None:
            raise ConfigError(c.error)
        return ui.runs.start(spec.name, c.yaml, c.files).model_dump()

    @r.get("/api/runs/{name}")
    @api
    async def details(request: web.Request) -> Any:
        name = request.match_info["name"]
        try:
            offset = max(0, int(request.query.get("offset", "0")))
            inode = int(request.query["inode"]) if request.query.get("inode") else None
        except ValueError:
            raise PoolError("offset and inode must be integers") from None
        try:
            return await asyncio.to_thread(ui.runs.details, name, offset, inode)
        except RunError as e:
            return error_response(404, str(e))

    @r.post("/api/runs/{name}/stop")
    @api
    async def stop(request: web.Request) -> Any:
        return ui.runs.stop(request.match_info["name"]).model_dump()

    @r.post("/api/runs/{name}/resume")
    @api
    async def resume(request: web.Request) -> Any:
        steps = (await _body(request)).get("steps")
        if steps in (None, ""):
            steps = None
        elif not isinstance(steps, int) or isinstance(steps, bool):
            try:
                steps = int(str(steps))
            except ValueError:
                raise PoolError(f"steps {steps!r}: give a whole number of RL steps") from None
        return ui.runs.resume(request.match_info["name"], steps).model_dump()

    @r.get("/runs/{name}/viewer")
    async def viewer(request: web.Request) -> web.StreamResponse:
        from rlf_envs.view import ViewError, load_run, render_html

        try:
            run_dir = ui.runs.run_dir(request.match_info["name"])
            html = await asyncio.to_thread(lambda: render_html(load_run(run_dir)))
        except (ViewError, RunError) as e:
            return web.Response(status=404, text=f"rlf viewer: {e}", content_type="text/plain")
        resp = web.Response(text=html, content_type="text/html", charset="utf-8")
        resp.headers["Content-Security-Policy"] = "frame-ancestors 'self'"  # the page's own CSP does the rest
        return resp

    @r.post("/api/shutdown")
    @api
    async def shutdown(request: web.Request) -> Any:
        ui.stop_event.set()
        return {"ok": True}

    return r


def _configs(cwd: Path) -> list[dict[str, str]]:
    out = []
    for p in sorted((cwd / "configs").glob("*.yaml")):
        first = ""
        with contextlib.suppress(OSError):
            for line in p.read_text(encoding="utf-8").splitlines():
                if line.startswith("#"):
                    first = line.lstrip("# ").strip()
                    break
        out.append({"path": str(p.relative_to(cwd)), "about": first[:200]})
    return out


def _envs() -> list[str]:
    import gymnasium

    import rlf_envs  # noqa: F401  (registers rlf's ids and every installed env package's)

    ids = []
    for env_id, spec in gymnasium.registry.items():
        entry = spec.entry_point if isinstance(spec.entry_point, str) else ""
        if "/" in env_id and env_id != POOL_ENV and not entry.startswith("gymnasium."):
            ids.append(env_id)
    return sorted(ids, key=lambda i: (not i.startswith("rlf/"), i))


def _base_summary(cwd: Path, path: str) -> dict[str, Any]:
    import yaml

    cfg = load_config((cwd / path) if path else None)
    return {"env_id": cfg.env.id, "env_kwargs": yaml.safe_dump(cfg.env.kwargs, sort_keys=False) if cfg.env.kwargs
            else "", "model": cfg.model.name_or_path, "device": cfg.model.device, "dtype": cfg.model.dtype,
            "hidden_size": cfg.model.tiny.hidden_size, "num_layers": cfg.model.tiny.num_layers,
            "seed": cfg.seed, "steps": cfg.algorithm.steps, "sft": cfg.sft.enabled, "sft_steps": cfg.sft.steps,
            "prompts_per_step": cfg.rollout.prompts_per_step, "samples_per_prompt": cfg.rollout.samples_per_prompt,
            "eval_every": cfg.eval.every, "eval_num_tasks": cfg.eval.num_tasks, "save_every": cfg.logging.save_every,
            "verifier": "verifier" in cfg.env.kwargs, "group_reward": cfg.group_reward is not None, "name": cfg.name}


def make_app(ui: UiApp) -> web.Application:
    app = web.Application(middlewares=[make_guard(ui)], client_max_size=16 << 20)
    app.add_routes(routes(ui))
    app.on_startup.append(ui.start)
    app.on_shutdown.append(ui.close)
    return app


# ----------------------------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlf_train.ui", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1: this machine only; "
                                                       "any other address needs the token)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free one)")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"), help="where runs go (default ./runs)")
    p.add_argument("--token", default=os.environ.get("RLF_UI_TOKEN"),
                   help="the access token (default: RLF_UI_TOKEN, else a new one when --host is not loopback)")
    p.add_argument("--keep-runs", action="store_true", help="keep runs going when the last page closes (they still "
                                                           "stop when the app exits)")
    p.add_argument("--page-timeout", type=float, default=180.0, help="seconds without a word from a page before it "
                                                                     "counts as closed (default 180)")
    p.add_argument("--page-grace", type=float, default=10.0, help="seconds after the last page closed before its "
                                                                   "runs are stopped (a reload comes back sooner)")
    p.add_argument("--stop-grace", type=float, default=30.0, help="seconds a stopped run gets to exit after SIGINT "
                                                                  "before it is killed (default 30)")
    return p


async def serve(settings: Settings) -> int:
    ui = UiApp(settings)
    app = make_app(ui)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        where = f"{settings.host}:{settings.port}"
        if e.errno == errno.EADDRINUSE:
            print(f"error: cannot serve on {where}: the port is in use (another rlf ui, or another server); pick "
                  "another with --port N, or --port 0 for any free port", file=sys.stderr)
        else:
            print(f"error: cannot serve on {where}: {e.strerror or e}", file=sys.stderr)
        return 2
    if runner.addresses:
        ui.port = int(runner.addresses[0][1])
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    url = f"http://{'127.0.0.1' if settings.host in ('0.0.0.0', '::') else host}:{ui.port}/"
    if settings.token is not None:
        url += f"?token={settings.token}"
    ui.say(f"serving {url}  (runs in {ui.s.runs_dir}; Ctrl-C stops the app and every run it started)")
    if settings.token is not None and not settings.loopback:
        ui.say("bound beyond this machine: every request needs the token above; whoever has it can run commands here")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, ui.stop_event.set)
    try:
        await ui.stop_event.wait()
    finally:
        ui.say("shutting down")
        await runner.cleanup()  # on_shutdown: ui.close (runs stopped, servers closed)
        await ui.close()
    ui.say("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    token = args.token
    if token is not None and not token.strip():
        token = None
    if token is None and not is_loopback(args.host):
        token = secrets.token_urlsafe(24)
    settings = Settings(host=args.host, port=args.port, runs_dir=args.runs_dir, token=token,
                        keep_runs=args.keep_runs, page_timeout_s=args.page_timeout, page_grace_s=args.page_grace,
                        stop_grace_s=args.stop_grace)
    try:
        return asyncio.run(serve(settings))
    except KeyboardInterrupt:
        return 130
