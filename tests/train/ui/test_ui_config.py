"""The web UI without a browser: a run's setup becomes the config the command line reads (with the command line's
own errors), the pool env resolves Python tools by import path and refuses bad schemas, the pool's live checks
explain why a server did not start, and the server's guards (Host, same-origin writes, the token)."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import gymnasium
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer
from procs_support import leftover_children
from repo_paths import REPO

from rlf_envs import runtime
from rlf_envs.tools.base import ToolSpec
from rlf_envs.tools.python import FunctionTool
from rlf_train.config import ConfigError, load_config
from rlf_train.ui.app import Settings, UiApp, make_app
from rlf_train.ui.pool import PoolError, ToolPool, parse_servers_text
from rlf_train.ui.pool_env import ToolSchemaError, ToolSourceError, load_python_tools, schema_problem
from rlf_train.ui.spec import POOL_ENV, PoolSnapshot, RewardChoice, RunSpec, compose

QUICKSTART = "configs/quickstart.yaml"
TIME = {"command": str(Path(sys.executable).parent / "mcp-server-time"), "args": ["--local-timezone", "UTC"]}
HOSTILE_SERVER = str(Path(__file__).parent / "hostile_mcp.py")


def _compose(tmp_path: Path, pool: PoolSnapshot | None = None, **spec: Any) -> Any:
    return compose(RunSpec.model_validate({"name": "r1", **spec}), cwd=REPO, runs_dir=tmp_path,
                   pool=pool or PoolSnapshot())


# ----------------------------------------------------------------------------------------------- compose
def test_the_composed_config_is_what_the_command_line_reads(tmp_path: Path) -> None:
    c = _compose(tmp_path, base=QUICKSTART, training={"steps": 3, "sft": "off", "save_every": 1},
                 model={"kind": "tiny", "hidden_size": 32}, overrides="rollout.max_turns=2\n# a comment\n")
    assert c.error is None, c.error
    path = tmp_path / "c.yaml"
    path.write_text(c.yaml)
    cfg = load_config(path)
    want = load_config(REPO / QUICKSTART, ["algorithm.steps=3", "sft.enabled=false", "logging.save_every=1",
                                           "model.tiny.hidden_size=32", "rollout.max_turns=2", "name=r1",
                                           f"logging.run_dir={tmp_path / 'r1'}"])
    assert cfg == want
    assert c.command == f"python -m rlf_train --config {tmp_path / 'r1' / 'config.yaml'}"
    assert "stage 2 grpo: 3 steps" in c.plan and "algorithm.steps=3" in c.overrides


@pytest.mark.parametrize("override", ["algorithm.stepz=3", "algorithm.steps=-1", "rollout.mode=sometimes",
                                      "model=3", "novalue"])
def test_a_config_error_reads_as_the_command_lines(tmp_path: Path, override: str) -> None:
    c = _compose(tmp_path, base=QUICKSTART, overrides=override)
    with pytest.raises(ConfigError) as cli:
        load_config(REPO / QUICKSTART, [override])
    assert c.error == str(cli.value) and c.config is None


def test_bad_setups_are_refused_with_the_key(tmp_path: Path) -> None:
    assert "a run's name is its directory" in _compose(tmp_path, **{"name": "../etc"}).error
    assert "config file not found" in _compose(tmp_path, base="configs/nope.yaml").error
    bad = _compose(tmp_path, base=QUICKSTART, reward={"kind": "yaml", "yaml": "type: exact_matc"})
    assert "env.kwargs.verifier" in bad.error and "did you mean 'exact_match'" in bad.error
    assert "not a Hugging Face model dir" in _compose(tmp_path, model={"kind": "hf", "path": str(tmp_path)}).error
    assert "pick a registered env id" in _compose(tmp_path, env={"source": "registered"}).error
    assert "needs tools" in _compose(tmp_path, env={"source": "pool", "tasks_path": "t.jsonl"}).error
    pool = PoolSnapshot(servers={"time": TIME})
    assert "needs a task file" in _compose(tmp_path, pool, env={"source": "pool"}).error
    assert "no server(s) ['nope']" in _compose(tmp_path, pool, env={"source": "pool", "servers": ["nope"]}).error
    moved = _compose(tmp_path, base=QUICKSTART, overrides="logging.run_dir=/elsewhere")
    assert "change the run's name" in moved.error


@pytest.mark.parametrize("reward", [
    {"kind": "exact_match"}, {"kind": "format_em"},
    {"kind": "judge", "base_url": "http://127.0.0.1:9/v1", "model": "m", "api_key_env": "KEY"},
    {"kind": "tool_check", "tool": "convert_time", "arguments": '{"time": "{answer}"}', "pattern": "\\d+"},
    {"kind": "yaml", "yaml": "reward:\n  type: max\n  verifiers: [{type: exact_match}, {type: token_f1}]"},
])
def test_each_reward_kind_becomes_the_envs_verifier(tmp_path: Path, reward: dict[str, Any]) -> None:
    c = _compose(tmp_path, base=QUICKSTART, reward=reward)
    assert c.error is None, c.error
    verifier = c.config.env.kwargs["verifier"]
    assert verifier["type"] == {"format_em": "gate", "yaml": "max"}.get(reward["kind"], reward["kind"])
    assert c.config.env.kwargs["world"] == "quickstart"  # the rest of the base env is kept


def test_the_group_judge_is_the_trainers_group_reward(tmp_path: Path) -> None:
    c = _compose(tmp_path, base=QUICKSTART, reward={"kind": "group_judge", "base_url": "http://127.0.0.1:9/v1",
                                                   "model": "judge", "rubric": "correct is best"})
    assert c.error is None and c.config.group_reward["rubric"] == "correct is best"
    assert "verifier" not in c.config.env.kwargs
    bad = _compose(tmp_path, base=QUICKSTART, reward=RewardChoice(kind="group_judge").model_dump())
    assert "group_reward" in bad.error


def test_a_pool_env_gets_the_pools_servers_python_tools_and_task_file(tmp_path: Path) -> None:
    pool = PoolSnapshot(servers={"time": TIME, "other": {"url": "http://127.0.0.1:9/mcp"}},
                        python=["tests.train.ui.tool_samples:shout"])
    c = _compose(tmp_path, pool, base=QUICKSTART, env={"source": "pool", "servers": ["time"],
                                                       "tasks_text": '{"question": "q", "answer": "a"}'},
                 reward={"kind": "format_em"}, training={"sft": "off"})
    assert c.error is None, c.error
    env = c.config.env
    assert env.id == POOL_ENV and "rlf_train.ui.pool_env" in env.imports
    assert env.train_split is None and env.eval_split is None and "world" not in env.kwargs
    assert env.kwargs["python_tools"] == ["tests.train.ui.tool_samples:shout"]
    assert env.kwargs["mcp_servers"] == str(tmp_path / "r1" / "mcp_servers.json")
    assert json.loads(c.files["mcp_servers.json"]) == {"mcpServers": {"time": TIME}}
    assert env.kwargs["tasks"] == str(tmp_path / "r1" / "tasks.jsonl") and c.files["tasks.jsonl"].endswith("\n")
    only_mcp = _compose(tmp_path, pool, env={"source": "pool", "python_tools": [], "tasks_path": "configs/x.jsonl"})
    assert only_mcp.config.env.id == "rlf/Tools-v0" and only_mcp.config.env.kwargs["tasks"] == str(
        REPO / "configs" / "x.jsonl")


# ----------------------------------------------------------------------------------------------- pool env
def test_python_tools_by_import_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    (shout,) = load_python_tools("tests.train.ui.tool_samples:shout")
    assert shout.spec.parameters["properties"]["text"] == {"type": "string", "description": "what to say"}
    assert load_python_tools("tests.train.ui.tool_samples:shout")[0] is shout  # one toolbox for every env
    names = {t.name for t in load_python_tools("rlf_envs.envs.demo")}
    assert names == {"population", "calculator"}  # a module: its Tool objects
    with pytest.raises(ToolSchemaError, match="bad tool schema: tool 'untyped': parameter 'x' has no type hint"):
        load_python_tools("tests.train.ui.tool_samples:untyped")
    with pytest.raises(ToolSourceError, match="no module named 'no_such_module'"):
        load_python_tools("no_such_module:f")
    with pytest.raises(ToolSourceError, match="has no attribute 'nope'"):
        load_python_tools("tests.train.ui.tool_samples:nope")
    with pytest.raises(ToolSourceError, match="has no rlf Tool objects"):
        load_python_tools("json")
    with pytest.raises(ToolSourceError, match="give a module"):
        load_python_tools("not a module")
    assert schema_problem({"type": "object", "properties": {"x": {"type": "strnig"}}}).startswith(
        "not a valid JSON Schema at properties/x/type")
    assert "type 'object' at its root" in schema_problem({"type": "string"})
    tool = FunctionTool(lambda: "x")
    tool.spec = ToolSpec("broken", "", {"type": "object", "required": "x"})
    import tests.train.ui.tool_samples as samples

    monkeypatch.setattr(samples, "BROKEN", tool, raising=False)
    with pytest.raises(ToolSchemaError, match="tool 'broken': bad tool schema: not a valid JSON Schema"):
        load_python_tools("tests.train.ui.tool_samples:BROKEN")


def test_the_pool_env_id_makes_a_tool_env_with_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    import rlf_train.ui.pool_env  # noqa: F401  (registers the id, as env.imports does)

    env = gymnasium.make(POOL_ENV, python_tools=["tests.train.ui.tool_samples:shout", "rlf_envs.envs.demo"],
                         tasks=[{"question": "q", "answer": "a"}]).unwrapped
    assert set(env.toolbox.tools) == {"shout", "population", "calculator"}
    from rlf_envs.registration import env_options

    assert {"python_tools", "mcp_servers", "tasks", "verifier"} <= (env_options(POOL_ENV) or set())


# ----------------------------------------------------------------------------------------------- pool checks
@pytest.fixture()
def pool(tmp_path: Path) -> Any:
    before = {c.pid for c in leftover_children()}  # what earlier tests of the session keep up (shared MCP servers)

    def ours() -> list[Any]:
        return [c for c in leftover_children() if c.pid not in before]

    p = ToolPool(tmp_path / "pool.json", log_dir=tmp_path / "logs")
    yield p
    runtime.run(p.disconnect_all())
    deadline = time.time() + 10
    while ours() and time.time() < deadline:
        time.sleep(0.05)
    assert ours() == [], "MCP server processes left behind"


def test_the_pool_checks_servers_live_and_says_why_one_did_not_start(pool: ToolPool, tmp_path: Path) -> None:
    exits = [sys.executable, "-c", "import sys; sys.stderr.write('boom: no API key\\n'); sys.exit(3)"]
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)  # not MCP
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        views = runtime.run(pool.add_servers({
            "time": TIME, "missing": {"command": "no-such-mcp-server-xyz"},
            "exits": {"command": exits[0], "args": exits[1:]}, "refused": {"url": "http://127.0.0.1:9/mcp"},
            "taken": {"url": f"http://127.0.0.1:{web.server_address[1]}/mcp", "startup_timeout_s": 10},
            "hostile": {"command": sys.executable, "args": [HOSTILE_SERVER]}}))
    finally:
        web.shutdown()
        web.server_close()
    by = {v.name: v for v in views}
    assert by["time"].status == "ok" and {t.name for t in by["time"].tools} == {"get_current_time", "convert_time"}
    assert "command 'no-such-mcp-server-xyz' not found" in by["missing"].error
    assert "exited (or closed its output) before it answered" in by["exits"].error
    assert "boom: no API key" in by["exits"].error  # its stderr, shown
    assert "nothing answers at http://127.0.0.1:9/mcp" in by["refused"].error
    assert "/mcp answered, but not as an MCP server" in by["taken"].error  # its port holds another server
    bad = next(t for t in by["hostile"].tools if t.name == "bad_schema")
    assert bad.schema_error is not None and "strnig" in bad.schema_error
    ok = runtime.run(pool.try_tool("mcp:time", "convert_time", json.dumps(
        {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"})))
    assert ok.status == "ok" and "21:00" in ok.content
    invalid = runtime.run(pool.try_tool("mcp:time", "convert_time", '{"time": "12:00"}'))
    assert invalid.status == "invalid_args" and "required property" in invalid.content
    with pytest.raises(PoolError, match="not valid JSON"):
        runtime.run(pool.try_tool("mcp:time", "convert_time", "{time: 12}"))
    with pytest.raises(PoolError, match="is not connected"):
        runtime.run(pool.try_tool("mcp:missing", "x", "{}"))
    # the entries persist (0600: env values may be keys); a new pool lists them unchecked
    assert oct(os.stat(tmp_path / "pool.json").st_mode & 0o777) == "0o600"
    again = ToolPool(tmp_path / "pool.json")
    assert {v.name: v.status for v in again.views()}["time"] == "unchecked"


def test_mcp_servers_texts(tmp_path: Path) -> None:
    claude = {"mcpServers": {"time": {**TIME, "autoApprove": ["convert_time"]}}}  # a client-only key: ignored
    assert parse_servers_text(json.dumps(claude)) == {"time": claude["mcpServers"]["time"]}
    assert parse_servers_text(yaml.safe_dump({"time": TIME})) == {"time": TIME}  # a bare map
    for text, msg in (("", "empty"), ("{nope", "not valid JSON"), ('{"servers": {}}', "mcpServers"),
                      ('{"mcpServers": {"x": {"command": "a", "url": "http://h"}}}', "exactly one of"),
                      ('{"mcpServers": {"x": {"command": "a", "colour": 1}}}', "colour")):
        with pytest.raises(PoolError, match=msg):
            parse_servers_text(text)


# ----------------------------------------------------------------------------------------------- guards
async def _client(settings: Settings) -> tuple[TestClient[Any, Any], UiApp]:
    ui = UiApp(settings)
    client = TestClient(TestServer(make_app(ui), host="127.0.0.1"))
    await client.start_server()
    ui.port = client.server.port or 0
    return client, ui


def test_loopback_guards(tmp_path: Path) -> None:
    async def go() -> None:
        client, ui = await _client(Settings(runs_dir=tmp_path, cwd=REPO))
        try:
            assert (await client.get("/api/pool")).status == 200
            assert (await client.get("/", headers={"Host": f"evil.example:{ui.port}"})).status == 421  # rebinding
            assert (await client.post("/api/shutdown")).status == 403  # no X-RLF-UI: not the app's own page
            r = await client.post("/api/shutdown", headers={"X-RLF-UI": "1", "Origin": "http://evil.example"})
            assert r.status == 403 and not ui.stop_event.is_set()
            page = await client.get("/")
            assert "script-src 'self'" in page.headers["Content-Security-Policy"]
            assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
            assert (await client.get("/static/../app.py")).status == 404
            r = await client.post("/api/pool/servers", headers={"X-RLF-UI": "1"}, data="not json")
            assert r.status == 400 and "not JSON" in (await r.json())["error"]
        finally:
            await client.close()
            await ui.close()

    asyncio.run(go())


def test_a_token_is_checked_on_every_request(tmp_path: Path) -> None:
    async def go() -> None:
        client, ui = await _client(Settings(host="0.0.0.0", runs_dir=tmp_path, cwd=REPO, token="s3cret-token"))
        try:
            for path in ("/", "/static/app.js", "/api/pool", "/runs/x/viewer"):
                assert (await client.get(path)).status == 401, path
            assert (await client.get("/api/pool", headers={"X-RLF-Token": "s3cret-tokex"})).status == 401
            assert (await client.get("/api/pool", headers={"X-RLF-Token": "s3cret-token"})).status == 200
            r = await client.get("/?token=s3cret-token", allow_redirects=False)
            assert r.status == 302 and "token" not in r.headers["Location"]
            cookie = r.cookies["rlf_ui_token"]
            assert cookie["httponly"] and cookie["samesite"] == "Strict"
            assert (await client.get("/api/pool")).status == 200  # the cookie now
        finally:
            await client.close()
            await ui.close()

    asyncio.run(go())


def test_the_command_line_prints_a_token_beyond_loopback_and_refuses_a_port_in_use(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "rlf_train.ui", "--runs-dir", str(tmp_path), "--host", "0.0.0.0", "--port", "0"]
    first = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert first.stdout is not None
        line = first.stdout.readline()
        assert "serving http://127.0.0.1:" in line and "?token=" in line, line
        port = line.split("http://127.0.0.1:")[1].split("/")[0]
        second = subprocess.run([*cmd[:-1], port], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        assert f"cannot serve on 0.0.0.0:{port}: the port is in use" in second.stderr
        assert "--port 0 for any free port" in second.stderr
    finally:
        first.send_signal(signal.SIGINT)
        out, _ = first.communicate(timeout=60)
    assert first.returncode == 0 and "stopped" in out


def test_the_page_ships_in_the_package_and_never_parses_text_as_html() -> None:
    from rlf_train.ui.app import STATIC, STATIC_FILES

    html = (STATIC / "index.html").read_text()
    for name in STATIC_FILES:
        assert f"/static/{name}" in html and (STATIC / name).is_file()
    js = (STATIC / "app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in js, sink  # everything from the server is set as text
    assert "<script>" not in html and " on" not in html.split("<body", 1)[1].split(">", 1)[0]  # no inline script


def test_runs_stop_only_when_the_last_page_is_gone_for_the_grace(tmp_path: Path) -> None:
    async def go() -> None:
        ui = UiApp(Settings(runs_dir=tmp_path, cwd=REPO, page_grace_s=0.5))
        closed: list[float] = []

        async def last_page_closed() -> None:
            closed.append(time.monotonic())

        ui.on_last_page_closed = last_page_closed  # type: ignore[method-assign]
        await ui.start(None)  # type: ignore[arg-type]
        try:
            ui.seen("a")
            ui.seen("b")
            ui.pages.pop("a")  # one of two tabs closed
            await asyncio.sleep(1.2)
            assert not closed
            ui.pages.pop("b")
            await asyncio.sleep(0.3)
            ui.seen("c")  # a reload: the page is back within the grace
            await asyncio.sleep(1.2)
            assert not closed
            ui.pages.pop("c")
            gone = time.monotonic()
            await asyncio.sleep(3.0)
            assert len(closed) == 1 and closed[0] - gone >= 0.5
        finally:
            await ui.close()

    asyncio.run(go())
