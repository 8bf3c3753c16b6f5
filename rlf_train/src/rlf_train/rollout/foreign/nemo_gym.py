"""NeMo-Gym environments through rlf: `rollout.environment: "nemo_gym:<config>"`.

`<config>` is what `ng_run "+config_paths=[...]"` takes: a NeMo-Gym config YAML (a path, resolved as NeMo-Gym
resolves it: from the project directory first, then NeMo-Gym's install), or the name of a resources server
(`example_tool_call_multireward`: its `configs/<name>.yaml`). The config names the agent server (e.g. NeMo-Gym's
`simple_agent`), its resources server and its datasets (JSONL rows: `responses_create_params` + task fields).

NeMo-Gym needs Python >= 3.12 and the trainer runs on its own interpreter, so rlf runs NeMo-Gym in the one the
config names (`env.kwargs.options.python`, else `$RLF_NEMO_GYM_PYTHON`): a small launcher (`_LAUNCHER`, run there)
starts the servers as `ng_run` does, with NeMo-Gym's own `RunHelper` (the way NeMo-RL drives it): its head server,
the config's resources and agent servers, and a model server rlf adds, `policy_model`, NeMo-Gym's `vllm_model`
(Responses API -> chat completions), whose upstream is rlf's policy endpoint; on free loopback ports, every server
in that interpreter (NeMo-Gym's `skip_venv_if_present`: no per-server venvs are built), a Ray cluster of one CPU
for them (NeMo-Gym's servers connect to one; `options.ray_address` names an existing cluster instead).

Each episode POSTs its dataset row to the agent's `/run` (what NeMo-Gym's rollout collection does): the agent runs
the whole rollout (seed_session, model calls, tool calls, `/verify`) and answers with `/verify`'s response. Its
`reward` is the episode's; its other numeric fields (and `reward_components`) are kept as named scores. Every model
call of the episode reaches the episode's own session on rlf's endpoint: the row's
`responses_create_params.metadata` carries the episode's key (`rlf_session`), which NeMo-Gym's model server passes
through to its chat-completions request, and a loopback router in the trainer (`SessionRouter`) forwards the
request to that session (token-exact: the endpoint renders and records the tokens, as for any agent).

Sampling is rlf's (the endpoint ignores what the requests ask, as for agents). A request refused for an rlf budget
(`rollout.max_total_tokens`, `agent_max_calls`) is the policy's: it reaches NeMo-Gym's model server in the words vLLM
uses for a context overflow, so the agent ends the rollout as it does on vLLM's refusal and `/verify` scores what
there is (counted in `foreign_budget_exceeded`). A `/run` that fails (a
`/verify` that raises or returns NaN or a non-number, a server that died) is an infrastructure failure.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import copy
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlf_envs.types import Task
from rlf_train.config import ConfigError
from rlf_train.rollout.foreign import Backend, Episode, ForeignHostFailed, Outcome, free_port

log = logging.getLogger(__name__)

NEMO_GYM_VERSION = "0.4.0"
MIN_PYTHON = (3, 12)
PYTHON_ENV = "RLF_NEMO_GYM_PYTHON"
#: what NeMo-Gym's servers and its `ng_run` machinery import, installed beside `pip install --no-deps
#: nemo-gym==0.4.0` (every nemo-gym release pins mcp<2; the full dependency set adds mlflow, datasets, ...)
REQUIREMENTS = (
    "fastapi", "uvicorn", "itsdangerous", "python-multipart>=0.0.22", "omegaconf", "hydra-core", "rich",
    "openai<=2.7.2", "anthropic<=0.109.2", "orjson", "aiohttp>=3.14.1", "ray>=2.55.1", "wandb", "yappi",
    "gprof2dot", "pydot", "pandas", "devtools", "tqdm", "psutil",
)
#: how to get a NeMo-Gym interpreter, in short (the whole list: docs/guides/foreign-envs.md, REQUIREMENTS)
INSTALL = (f"a Python >= 3.12 venv with `pip install --no-deps nemo-gym=={NEMO_GYM_VERSION}` and the packages its "
           "servers import (docs/guides/foreign-envs.md#nemo-gym)")
MODEL_SERVER = "policy_model"  # the name NeMo-Gym's agent configs give their model server
SESSION_KEY = "rlf_session"  # the key in a row's responses_create_params.metadata that names the episode
SERVER_TYPES = ("responses_api_agents", "resources_servers", "responses_api_models")
#: rlf's endpoint refusing a request for a budget of the episode: the policy's failure, not the host's
BUDGET_CODES = ("context_length_exceeded", "session_call_limit", "session_timeout", "session_closed")
#: statuses NeMo-Gym's model client retries as rate limits, without end (nemo_gym.openai_utils)
RETRIED_FOR_EVER = (429, 502, 503, 504, 520)
#: rlf's names for eval splits and NeMo-Gym's dataset types
SPLIT_ALIASES = {"test": ("validation",), "eval": ("validation",), "validation": ("test",), "val": ("validation",)}
KNOWN_OPTIONS = {"python", "agent", "config_paths", "config", "model_server", "datasets", "project_dir",
                 "env_yaml", "max_tasks", "ray_address", "startup_timeout_s", "run_timeout_s"}


class ServerFailed(ForeignHostFailed):
    """NeMo-Gym's servers failed (did not start, or stopped): the host's failure."""


# ---------------------------------------------------------------------------------------------- the interpreter
@dataclass(frozen=True)
class Interpreter:
    """The Python that runs NeMo-Gym: its version and the nemo-gym it has."""

    path: str
    version: tuple[int, int, int]
    nemo_gym: str | None


_PROBE = ("import sys, json\nr = {'version': list(sys.version_info[:3]), 'nemo_gym': None}\ntry:\n"
          "    import importlib.metadata as m\n    r['nemo_gym'] = m.version('nemo-gym')\nexcept Exception:\n"
          "    pass\nprint(json.dumps(r))\n")


def find_interpreter(given: str | None) -> Interpreter:
    """The NeMo-Gym interpreter `options.python` or `$RLF_NEMO_GYM_PYTHON` names, checked: a ConfigError saying how
    to get one otherwise."""
    how = f"name one in env.kwargs.options.python or ${PYTHON_ENV}: {INSTALL}"
    path = given or os.environ.get(PYTHON_ENV)
    if not path:
        raise ConfigError(f"nemo_gym: NeMo-Gym runs in a Python >= 3.12 of its own and none is named: {how}")
    where = "env.kwargs.options.python" if given else f"${PYTHON_ENV}"
    exe = shutil.which(path) or path
    if not os.path.isfile(exe) or not os.access(exe, os.X_OK):
        raise ConfigError(f"nemo_gym: {where} {path!r} is not an executable file; {how}")
    try:
        r = subprocess.run([exe, "-I", "-c", _PROBE], capture_output=True, text=True, timeout=60)
        got = json.loads(r.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
        raise ConfigError(f"nemo_gym: {where} {path!r} did not run as a Python interpreter "
                          f"({type(e).__name__}: {e}); {how}") from None
    version = tuple(int(x) for x in got["version"])
    if version[:2] < MIN_PYTHON:
        raise ConfigError(f"nemo_gym: {where} {path!r} is Python {'.'.join(map(str, version))}; NeMo-Gym needs "
                          f">= 3.12: {how}")
    if not got.get("nemo_gym"):
        raise ConfigError(f"nemo_gym: {where} {path!r} has no nemo-gym installed; {how}")
    return Interpreter(exe, version, got["nemo_gym"])  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- the launcher
#: run by the NeMo-Gym interpreter (`python launcher.py spec.json`): `resolve` parses the config with NeMo-Gym's own
#: parser and writes what it names; `serve` starts the servers with NeMo-Gym's RunHelper, writes their addresses,
#: polls them (a server that stops ends all of them, as `ng_run` does) and shuts them down on SIGTERM or when its
#: stdin closes (the trainer is gone).
_LAUNCHER = r'''
import difflib, json, os, signal, socket, sys, threading, time, traceback
from pathlib import Path

SERVER_TYPES = ("responses_api_agents", "resources_servers", "responses_api_models")


class Refused(Exception):
    pass


def write(out, obj):
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(out)


def config_path(target):
    """A config path as NeMo-Gym takes it, or a resources server's name -> its config."""
    from nemo_gym import PARENT_DIR
    if target.endswith((".yaml", ".yml")) or "/" in target:
        return target
    roots = [Path.cwd(), PARENT_DIR]
    for root in roots:
        d = root / "resources_servers" / target / "configs"
        if d.is_dir():
            named = d / f"{target}.yaml"
            yamls = sorted(d.glob("*.yaml"))
            if named.is_file():
                return str(named)
            if len(yamls) == 1:
                return str(yamls[0])
            raise Refused(f"resources server {target!r} has {len(yamls)} configs in {d}; name one: "
                          + ", ".join(str(y.relative_to(root)) for y in yamls))
    names = sorted({p.parent.name for root in roots for p in (root / "resources_servers").glob("*/configs")})
    close = difflib.get_close_matches(target, names, n=5, cutoff=0.5)
    raise Refused(f"no resources server named {target!r} here or in NeMo-Gym's install ({PARENT_DIR}); "
                  + (f"did you mean {', '.join(close)}? " if close else "")
                  + f"{len(names)} are installed (resources_servers/*), or give a config path (.yaml)")


def parse(spec):
    from omegaconf import DictConfig
    from nemo_gym.global_config import GlobalConfigDictParserConfig, get_global_config_dict
    initial = dict(spec["global"])
    initial["config_paths"] = [config_path(t) for t in spec["configs"]]
    env_yaml = spec.get("env_yaml")
    return get_global_config_dict(global_config_dict_parser_config=GlobalConfigDictParserConfig(
        initial_global_config_dict=DictConfig(initial), skip_load_from_cli=True,
        dotenv_path=Path(env_yaml) if env_yaml else None, skip_load_from_dotenv=not env_yaml)), initial


def servers(g):
    from omegaconf import OmegaConf
    from nemo_gym import _resolve_under_cwd_or_install
    from nemo_gym.cli.env import _resolve_server_dir
    from nemo_gym.global_config import GlobalConfigDictParser
    out = {}
    for inst in GlobalConfigDictParser().filter_for_server_instance_configs(g):
        impl = list(getattr(inst, inst.SERVER_TYPE))[0]
        inner = OmegaConf.to_container(inst.get_inner_run_server_config_dict(), resolve=True)
        d = _resolve_server_dir(Path(inst.SERVER_TYPE, impl))
        refs = {k: v["name"] for k, v in inner.items()
                if isinstance(v, dict) and v.get("type") in SERVER_TYPES and isinstance(v.get("name"), str)}
        datasets = [{"name": str(x.get("name")), "type": str(x.get("type")),
                     "path": str(_resolve_under_cwd_or_install(x["jsonl_fpath"]))}
                    for x in inner.get("datasets") or [] if isinstance(x, dict) and x.get("jsonl_fpath")]
        entry = str(inner.get("entrypoint") or "")
        out[inst.name] = {"type": inst.SERVER_TYPE, "impl": impl, "dir": str(d), "entrypoint": entry,
                          "exists": (d / entry).is_file(), "host": inner.get("host"), "port": inner.get("port"),
                          "refs": refs, "datasets": datasets}
    return out


def shims(root, found, python):
    """A venv per server as NeMo-Gym's skip_venv_if_present looks for it (bin/python, bin/activate), each the
    interpreter running this: the servers run in it, no per-server venv is built."""
    for s in found.values():
        b = Path(root, s["type"], s["impl"], ".venv", "bin")
        b.mkdir(parents=True, exist_ok=True)
        (b / "python").write_text(f'#!/bin/sh\nexec "{python}" "$@"\n')
        (b / "python").chmod(0o755)
        (b / "activate").write_text(f'export PATH="{b}:$PATH"\n')


def serve(spec, out):
    import ray
    import nemo_gym.cli.env as ng_env
    from nemo_gym.cli.env import RunHelper
    from nemo_gym.global_config import GlobalConfigDictParserConfig
    from omegaconf import DictConfig
    # ng_run checks its servers every 3 s while they start; a trainer waiting on them checks every 0.2 s
    ng_env.sleep = lambda s: time.sleep(min(s, 0.2))
    started_ray = False
    if spec.get("ray_address"):
        address = spec["ray_address"]
    else:  # a Ray cluster for NeMo-Gym's servers to connect to (they do, at start), as NeMo-RL gives them its own
        ray.init(include_dashboard=False, num_cpus=1, log_to_driver=False, configure_logging=False)
        started_ray = True
        address = ray.get_runtime_context().gcs_address
    spec["global"]["ray_head_node_address"] = address
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        spec["global"]["head_server"] = {"host": "127.0.0.1", "port": s.getsockname()[1]}
    g, initial = parse(spec)
    found = servers(g)
    shims(spec["global"]["uv_venv_dir"], found, sys.executable)
    rh = RunHelper()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    code = 0
    try:
        rh.start(GlobalConfigDictParserConfig(initial_global_config_dict=DictConfig(initial), skip_load_from_cli=True,
                                              skip_load_from_dotenv=True))
        urls = {n: f"http://{s['host']}:{s['port']}" for n, s in servers(g).items()}
        write(out, {"servers": urls, "pid": os.getpid()})
        print("rlf: NeMo-Gym's servers are up: " + ", ".join(f"{n} {u}" for n, u in urls.items()), flush=True)
        while not stop.wait(0.25):
            try:
                rh.poll()
            except Exception as e:
                (out.parent / "stopping").write_text(str(e))  # (before the shutdown: the trainer reads it)
                print(f"rlf: a NeMo-Gym server stopped, so all of them stop (as ng_run does): {e}", flush=True)
                code = 3
                break
    except Exception as e:
        traceback.print_exc()
        write(out, {"error": f"{type(e).__name__}: {e}"})
        code = 2
    finally:
        try:
            if getattr(rh, "_processes", None) is not None and getattr(rh, "_head_server", None) is not None:
                rh.shutdown()
        except Exception:
            traceback.print_exc()
        if started_ray:
            ray.shutdown()
    return code


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    try:
        if spec["mode"] == "resolve":
            g, _ = parse(spec)
            from nemo_gym import PARENT_DIR, __version__
            write(out, {"servers": servers(g), "parent_dir": str(PARENT_DIR), "nemo_gym": __version__})
            return 0
        return serve(spec, out)
    except Refused as e:
        write(out, {"error": str(e), "config": True})
        return 2
    except Exception as e:
        config = type(e).__name__.endswith("Error") and type(e).__module__.startswith("nemo_gym")
        if not config:
            traceback.print_exc()
        write(out, {"error": f"{type(e).__name__}: {e}", "config": config})
        return 2


if __name__ == "__main__":
    sys.exit(main())
'''


@dataclass(frozen=True)
class Dataset:
    name: str
    type: str
    path: str


@dataclass(frozen=True)
class Server:
    """A server of the resolved NeMo-Gym config (`type`: responses_api_agents / resources_servers /
    responses_api_models; `impl`: e.g. simple_agent)."""

    name: str
    type: str
    impl: str
    dir: str
    exists: bool
    refs: dict[str, str]
    datasets: tuple[Dataset, ...]


def _launcher_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0", RAY_DISABLE_IMPORT_WARNING="1")
    return env


def _log_errors(path: Path | None) -> str:
    """The exceptions NeMo-Gym's processes printed (each traceback's last line), oldest first, at most 6."""
    if path is None or not path.is_file():
        return ""
    found: list[str] = []
    for line in path.read_bytes().decode(errors="replace").splitlines():
        line = line.strip()
        if re.match(r"^(\(\S+\) )?[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b(: .+)?$", line) \
                and line not in found:
            found.append(line)
    return "; ".join(found[-6:])


def _log_tail(path: Path | None, n: int = 3000) -> str:
    if path is None or not path.is_file():
        return ""
    data = path.read_bytes()[-n:].decode(errors="replace")
    return "\n".join(line.rstrip() for line in data.splitlines() if line.strip())


# ---------------------------------------------------------------------------------------------- the router
@dataclass
class Route:
    """One episode's session on rlf's endpoint, and what the router saw of it."""

    base_url: str
    api_key: str
    calls: int = 0
    budget: str | None = None  # the endpoint refused a call for an rlf budget (the policy's)


class SessionRouter:
    """NeMo-Gym's model server's upstream (`base_url` of its `policy_model`): each chat-completions request carries
    its episode's key in `metadata.rlf_session` (the row's, passed through by NeMo-Gym's model server) and is
    forwarded to that episode's session on rlf's endpoint, the key removed. A call the endpoint refuses for an rlf
    budget comes back as vLLM says a context overflow ("maximum context length"), which NeMo-Gym's `vllm_model` turns
    into an incomplete response (the agent stops, `/verify` scores the rollout); statuses NeMo-Gym would retry for ever
    (429, 502, ...) come back as 500."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.url = ""
        self._runner: Any = None
        self._client: Any = None
        self.unrouted = 0

    async def start(self) -> None:
        import aiohttp
        from aiohttp import web

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes([web.post("/v1/chat/completions", self.chat)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}/v1"
        self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                             connector=aiohttp.TCPConnector(limit=0))

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def chat(self, request: Any) -> Any:
        from aiohttp import web

        def refuse(status: int, message: str) -> Any:
            return web.json_response({"error": {"message": message, "type": "invalid_request_error",
                                                "code": "rlf_unrouted"}}, status=status)

        try:
            body = await request.json()
        except ValueError:
            return refuse(400, "the body is not JSON")
        meta = body.get("metadata") if isinstance(body, dict) else None
        key = meta.pop(SESSION_KEY, None) if isinstance(meta, dict) else None
        route = self.routes.get(key) if isinstance(key, str) else None
        if route is None:
            self.unrouted += 1
            return refuse(404, f"no rlf episode {key!r}: every request must carry its episode's key in "
                               f"metadata.{SESSION_KEY} (the row's responses_create_params.metadata)")
        if not meta:
            body.pop("metadata", None)
        route.calls += 1
        assert self._client is not None
        import aiohttp

        try:
            async with self._client.post(f"{route.base_url}/chat/completions", json=body,
                                         headers={"Authorization": f"Bearer {route.api_key}"}) as r:
                raw = await r.read()
                status = r.status
        except aiohttp.ClientError as e:
            return refuse(500, f"rlf's policy endpoint did not answer: {type(e).__name__}: {e}")
        if 400 <= status < 500:
            try:
                err = json.loads(raw).get("error") or {}
            except (ValueError, AttributeError):
                err = {}
            code = str(err.get("code") or "")
            if code in BUDGET_CODES:
                # an rlf budget ends the episode, scored as its scorer scores it: said as vLLM says a context
                # overflow, NeMo-Gym's vllm_model answers an incomplete response, the agent stops and calls /verify
                # (and a 429 would be retried for ever, as a rate limit)
                route.budget = f"{code}: {err.get('message', '')}"
                msg = f"This model's maximum context length is reached (rlf {code}): {err.get('message', '')}"
                return web.json_response({"object": "error", "message": msg, "type": "BadRequestError",
                                          "code": 400, "error": {**err, "message": msg}}, status=400)
        if status in RETRIED_FOR_EVER:  # NeMo-Gym retries these as rate limits, without end: a plain failure
            status = 500
        return web.Response(body=raw, status=status, content_type="application/json")


# ---------------------------------------------------------------------------------------------- the backend
def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float):
        return float(v)
    return None


def scores_of(verify: dict[str, Any], row: dict[str, Any]) -> dict[str, float]:
    """`/verify`'s numeric fields other than `reward` and the row's own (bools as 0/1), and its
    `reward_components`, as named scores."""
    out: dict[str, float] = {}
    for k, v in verify.items():
        if k == "reward" or k in row or k.startswith("_"):
            continue
        x = _number(v)
        if x is not None:
            out[k] = x
    comps = verify.get("reward_components")
    if isinstance(comps, dict):
        for k, v in comps.items():
            x = _number(v)
            if x is not None:
                out.setdefault(str(k), x)
    return out


def refusal(error: str, said: str) -> str:
    """NeMo-Gym's config error in a line: an AlmostServerError's reasons are in what it printed (rich's table)."""
    first = " ".join(error.split()) or "no answer"
    if "AlmostServerError" not in error:
        return first[:1000]
    first = first.split(" Found global config dict yaml:")[0]
    text = " ".join(said.split())
    out = []
    for m in re.finditer(r"Almost-Server Detected: '([^']+)' This server configuration failed validation: (.*?) "
                         r"This server will NOT be started", text):
        reasons = [r.strip() for r in m.group(2).split(" - ") if r.strip() and "BenchmarkDatasetConfig" not in r]
        reasons = [re.sub(r"function-after(\[[^\]]*\])?(\s*->\s*|:\s*)", "", r).lstrip("- ") for r in reasons]
        out.append(f"server {m.group(1)!r} does not validate: {'; '.join(reasons[:3])}")
    return "; ".join(out) or first


def run_error(text: str) -> str:
    """What failed, from a NeMo-Gym server's 500 answer: its agent wraps an inner server's error as "Hit an exception
    in X calling an inner server: b'...'", a server's own error is the exception's repr (a JSON string)."""
    detail = text
    for _ in range(3):
        with contextlib.suppress(ValueError, SyntaxError):
            got = json.loads(detail) if detail[:1] in "\"[{" else ast.literal_eval(detail) \
                if detail[:2] in ("b'", 'b"') else None
            if isinstance(got, bytes):
                got = got.decode(errors="replace")
            if isinstance(got, str):
                detail = got
                continue
        m = re.match(r"Hit an exception in \S+ calling an inner server: (.*)", detail, re.S)
        if not m:
            break
        detail = m.group(1).strip()
    return " ".join(detail.split())


def _last_user_text(rcp: dict[str, Any]) -> str:
    inp = rcp.get("input")
    if isinstance(inp, str):
        return inp
    for m in reversed(inp if isinstance(inp, list) else []):
        if isinstance(m, dict) and m.get("role") == "user":
            c = m.get("content")
            if isinstance(c, str):
                return c
            if isinstance(c, list):
                return " ".join(str(p.get("text", "")) for p in c if isinstance(p, dict))
    return ""


@dataclass
class _Launch:
    proc: subprocess.Popen[bytes]
    dir: Path
    log: Path
    servers: dict[str, str] = field(default_factory=dict)


class NemoGymBackend(Backend):
    ecosystem = "nemo_gym"

    def __init__(self, target: str, options: dict[str, Any]) -> None:
        super().__init__(target, options)
        o = self.options
        unknown = sorted(set(o) - KNOWN_OPTIONS)
        if unknown:
            raise ConfigError(f"env.kwargs.options: {', '.join(map(repr, unknown))} are not options of the nemo_gym "
                              f"ecosystem; known: {', '.join(sorted(KNOWN_OPTIONS))}")
        for k in ("config", "model_server", "datasets"):
            if not isinstance(o.get(k, {}), dict):
                raise ConfigError(f"env.kwargs.options.{k} must be a mapping, got {o[k]!r}")
        self.python = find_interpreter(o.get("python"))
        self.configs = [t.strip() for t in target.split(",") if t.strip()]
        extra = o.get("config_paths") or []
        if isinstance(extra, str):
            extra = [extra]
        self.configs += [str(x) for x in extra]
        # a path from where the trainer runs is made absolute (NeMo-Gym runs from the project directory)
        self.configs = [str(Path(c).expanduser().resolve()) if Path(c).expanduser().is_file() else c
                        for c in self.configs]
        self.project_dir = str(Path(o["project_dir"]).expanduser().resolve()) if o.get("project_dir") else \
            self._project_dir()
        if not Path(self.project_dir).is_dir():
            raise ConfigError(f"env.kwargs.options.project_dir {self.project_dir!r} is not a directory")
        self.router = SessionRouter()
        self.launch: _Launch | None = None
        self.parent_dir = ""  # NeMo-Gym's install (its shipped servers and data)
        self.servers = self._resolve()
        self.agent = self._agent()
        self.rows: dict[str | None, dict[str, dict[str, Any]]] = {}
        self.rollout_index: Counter[str] = Counter()
        self.dead: asyncio.Event | None = None
        self._watch: asyncio.Task[None] | None = None
        self._http: Any = None
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ the config
    def _project_dir(self) -> str:
        """Where NeMo-Gym looks for the config's local servers (`resources_servers/<name>/` beside the config, as in
        a NeMo-Gym checkout) and relative paths: the folder holding the config's `resources_servers/...` path, else
        the working directory."""
        for c in self.configs:
            p = Path(c).expanduser()
            if not p.is_absolute():
                p = Path.cwd() / p
                if not p.is_file():  # (a name, or a path in NeMo-Gym's install)
                    continue
            parts = p.parts
            for k, part in enumerate(parts):
                if part in SERVER_TYPES and k > 0:
                    return str(Path(*parts[:k]))
        return os.getcwd()

    def _global(self, uv_venv_dir: str, router_url: str) -> dict[str, Any]:
        """The global config rlf gives NeMo-Gym (the `initial_global_config_dict` NeMo-RL gives it too): the
        policy model server (NeMo-Gym's vllm_model, upstream rlf's router), the options' overrides, venvs."""
        model = {"entrypoint": "app.py", "base_url": router_url, "api_key": "rlf", "model": "rlf-policy",
                 "return_token_id_information": False, "uses_reasoning_parser": False}
        model.update(self.options.get("model_server") or {})
        g = copy.deepcopy(dict(self.options.get("config") or {}))
        g[MODEL_SERVER] = {"responses_api_models": {"vllm_model": model}}
        g.update(policy_base_url=router_url, policy_api_key="rlf", policy_model_name="rlf-policy",
                 skip_venv_if_present=True, uv_venv_dir=uv_venv_dir, default_host="127.0.0.1")
        return g

    def _run_launcher(self, mode: str, d: Path, router_url: str, stdin: Any = None) -> subprocess.Popen[bytes]:
        spec = {"mode": mode, "out": str(d / "out.json"), "configs": self.configs,
                "global": self._global(str(d / "venvs"), router_url), "ray_address": self.options.get("ray_address"),
                "env_yaml": self.options.get("env_yaml")}
        (d / "spec.json").write_text(json.dumps(spec, default=str))
        (d / "launcher.py").write_text(_LAUNCHER)
        logf = open(d / "log.txt", "wb")  # noqa: SIM115  (the child holds it; closed below)
        try:
            return subprocess.Popen([self.python.path, str(d / "launcher.py"), str(d / "spec.json")],
                                    cwd=self.project_dir, env=_launcher_env(), stdin=stdin,
                                    stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            logf.close()

    def _resolve(self) -> dict[str, Server]:
        """The config as NeMo-Gym's parser reads it (in the NeMo-Gym interpreter; nothing starts)."""
        with tempfile.TemporaryDirectory(prefix="rlf-nemo-gym-") as tmp:
            d = Path(tmp)
            proc = self._run_launcher("resolve", d, "http://127.0.0.1:9/v1", stdin=subprocess.DEVNULL)
            try:
                proc.wait(timeout=float(self.options.get("startup_timeout_s", 300)))
            except subprocess.TimeoutExpired:
                _kill_tree(proc)
                raise ConfigError(f"nemo_gym: NeMo-Gym did not read its config "
                                  f"in time: {_log_tail(d / 'log.txt')}") from None
            out = d / "out.json"
            got = json.loads(out.read_text()) if out.is_file() else {"error": _log_tail(d / "log.txt")}
            said = _log_tail(d / "log.txt", 20_000)
        if "error" in got:
            raise ConfigError(f"nemo_gym: NeMo-Gym refused the config: {refusal(str(got['error']), said)}")
        self.parent_dir = str(got.get("parent_dir") or "")
        found = {}
        for name, s in got["servers"].items():
            found[name] = Server(name, s["type"], s["impl"], s["dir"], bool(s["exists"]), dict(s["refs"]),
                                 tuple(Dataset(**x) for x in s["datasets"]))
        missing = [f"{s.name} ({s.type}/{s.impl}: {s.dir})" for s in found.values() if not s.exists]
        if missing:
            raise ConfigError(f"nemo_gym: no server code for "
                              f"{', '.join(missing)}: a local server lives under the project directory "
                              f"({self.project_dir}, env.kwargs.options.project_dir), as in a NeMo-Gym checkout")
        return found

    def _agent(self) -> Server:
        agents = {n: s for n, s in self.servers.items() if s.type == "responses_api_agents"}
        want = self.options.get("agent")
        if want is not None:
            if want not in agents:
                raise ConfigError(f"env.kwargs.options.agent {want!r}: the config's agent servers are "
                                  f"{', '.join(sorted(agents)) or '(none)'}")
            return agents[want]
        if len(agents) != 1:
            raise ConfigError(f"nemo_gym: the config has "
                              f"{len(agents)} agent servers ({', '.join(sorted(agents)) or 'none'}): name the one "
                              "to train in env.kwargs.options.agent")
        return next(iter(agents.values()))

    # ------------------------------------------------------------------ the tasks
    def _dataset_for(self, split: str | None) -> str:
        given = self.options.get("datasets") or {}
        if split in given:  # a relative path as NeMo-Gym reads one: the project's, else its install's
            p = Path(str(given[split])).expanduser()
            if p.is_absolute():
                return str(p)
            mine = Path(self.project_dir) / p
            return str(mine if mine.exists() or not self.parent_dir else Path(self.parent_dir) / p)
        ds = self.agent.datasets
        names = [split, *SPLIT_ALIASES.get(split or "", ())] if split else ["train"]
        for n in names:
            hit = [d for d in ds if d.name == n] or [d for d in ds if d.type == n]
            if hit:
                return hit[0].path
        examples = [d for d in ds if d.type == "example"]
        if examples and not any(d.type in ("train", "validation") for d in ds):
            if "example" not in self._warned:
                self._warned.add("example")
                log.warning("nemo_gym:%s: the agent %s has only example data (%s): train and eval both use it "
                            "(give env.kwargs.options.datasets for other rows)", self.target, self.agent.name,
                            examples[0].path)
            return examples[0].path
        listed = ", ".join(f"{d.name} ({d.type})" for d in ds) or "none"
        raise ConfigError(f"nemo_gym: the agent {self.agent.name} has no dataset "
                          f"for split {split!r} (its datasets: {listed}); set env.train_split / env.eval_split to one "
                          "of them or give its JSONL in env.kwargs.options.datasets.<split>")

    def tasks(self, split: str | None) -> list[Task]:
        path = Path(self._dataset_for(split))
        if not path.is_file():
            raise ConfigError(f"nemo_gym: the {split} dataset {path} is not "
                              "there; NeMo-Gym's configs name datasets they fetch (`gym dataset download`, "
                              "`ng_download_dataset_from_gitlab`): get it, or give a JSONL in "
                              f"env.kwargs.options.datasets.{split}")
        limit = int(self.options.get("max_tasks", 1_000_000))
        table: dict[str, dict[str, Any]] = {}
        out: list[Task] = []
        for k, line in enumerate(path.read_text().splitlines()):
            if len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"{path}:{k + 1}: not a JSON row ({e})") from None
            rcp = row.get("responses_create_params") if isinstance(row, dict) else None
            if not isinstance(rcp, dict) or "input" not in rcp:
                raise ConfigError(f"{path}:{k + 1}: a NeMo-Gym row needs responses_create_params.input")
            tid = f"{split or 'all'}-{row.get('id', len(out))}"
            if tid in table:
                tid = f"{tid}#{len(out)}"
            table[tid] = row
            out.append(Task(id=tid, question=_last_user_text(rcp), meta={"index": len(out), "split": split or "",
                                                                         "dataset": str(path)}))
        if not out:
            raise ConfigError(f"nemo_gym: {path} holds no rows")
        self.rows[split] = table
        return out

    # ------------------------------------------------------------------ the servers
    async def start(self) -> None:
        import aiohttp

        if self.launch is not None:
            return
        await self.router.start()
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
            total=float(self.options["run_timeout_s"]) if self.options.get("run_timeout_s") else None),
            connector=aiohttp.TCPConnector(limit=0))
        d = Path(tempfile.mkdtemp(prefix="rlf-nemo-gym-"))
        proc = self._run_launcher("serve", d, self.router.url, stdin=subprocess.PIPE)
        self.launch = _Launch(proc, d, d / "log.txt")
        got = await asyncio.to_thread(self._wait_ready, self.launch)
        self.launch.servers = dict(got["servers"])
        self.dead = asyncio.Event()
        self._watch = asyncio.ensure_future(self._watch_launcher())
        log.info("nemo_gym:%s: NeMo-Gym's servers are up (agent %s at %s)", self.target, self.agent.name,
                 self.launch.servers.get(self.agent.name))

    def _wait_ready(self, launch: _Launch) -> dict[str, Any]:
        timeout = float(self.options.get("startup_timeout_s", 300))
        deadline = time.monotonic() + timeout
        out = launch.dir / "out.json"
        while True:
            if out.is_file():
                got = json.loads(out.read_text())
                if "error" in got:
                    self._stop(launch)
                    raise ServerFailed(f"NeMo-Gym's servers did not start: {got['error']}; what its processes raised: "
                                       f"{_log_errors(launch.log)}\n--- its log (the end) ---\n"
                                       f"{_log_tail(launch.log)}")
                return dict(got)
            if launch.proc.poll() is not None:
                self._stop(launch)
                raise ServerFailed(f"NeMo-Gym's launcher exited with status {launch.proc.returncode} before the "
                                   f"servers were up; what its processes raised: {_log_errors(launch.log)}\n"
                                   f"--- its log (the end) ---\n{_log_tail(launch.log)}")
            if time.monotonic() > deadline:
                self._stop(launch)
                raise ServerFailed(f"NeMo-Gym's servers were not up within {timeout:g} s "
                                   f"(env.kwargs.options.startup_timeout_s)\n--- its log (the end) ---\n"
                                   f"{_log_tail(launch.log)}")
            time.sleep(0.2)

    async def _watch_launcher(self) -> None:
        assert self.launch is not None and self.dead is not None
        while self.launch is not None and self.launch.proc.poll() is None:
            await asyncio.sleep(0.25)
        self.dead.set()

    def _stop(self, launch: _Launch) -> None:
        """SIGTERM to the launcher (it shuts NeMo-Gym's servers and its Ray cluster down), then SIGKILL to whatever of
        its process tree is left."""
        tree = _descendants(launch.proc.pid)
        if launch.proc.poll() is None:
            with contextlib.suppress(OSError):
                if launch.proc.stdin is not None:
                    launch.proc.stdin.close()
            with contextlib.suppress(ProcessLookupError):
                os.kill(launch.proc.pid, signal.SIGTERM)
            try:
                launch.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        _kill_tree(launch.proc, tree)

    async def close(self) -> None:
        launch, self.launch = self.launch, None
        try:
            if self._watch is not None:
                self._watch.cancel()
                self._watch = None
            if launch is not None:
                await asyncio.to_thread(self._stop, launch)
        finally:
            if self._http is not None:
                await self._http.close()
                self._http = None
            await self.router.close()
            if launch is not None:
                shutil.rmtree(launch.dir, ignore_errors=True)

    async def _stopping(self) -> bool:
        """Whether the launcher is stopping NeMo-Gym's servers (one of them died): then wait for it to be done."""
        assert self.launch is not None and self.dead is not None
        if not self.dead.is_set() and not (self.launch.dir / "stopping").exists():
            return False
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.dead.wait(), 30)
        return True

    def _dead_error(self) -> str:
        """Which server stopped (the launcher's poll says, as ng_run's does), then the end of the log."""
        assert self.launch is not None
        tail = _log_tail(self.launch.log, 20_000)
        stopping = self.launch.dir / "stopping"
        said = stopping.read_text(errors="replace") if stopping.is_file() else tail
        which = re.findall(r"Process `([^`]+)` finished unexpectedly", said)
        head = f"the server {which[-1]} stopped, so NeMo-Gym's servers stopped" if which else \
            "NeMo-Gym's servers stopped"
        return (f"nemo_gym: {head} (launcher exit status {self.launch.proc.returncode}); what its processes "
                f"raised: {_log_errors(self.launch.log) or 'nothing'}; its log ends: {' '.join(tail[-800:].split())}")

    # ------------------------------------------------------------------ an episode
    async def episode(self, ep: Episode) -> Outcome:
        if self.launch is None or self.dead is None:
            raise ServerFailed("NeMo-Gym's servers are not running (the backend was not started)")
        if self.dead.is_set():
            return Outcome(infra_error=self._dead_error()[:2000])
        split = ep.task.meta.get("split") or None
        row = copy.deepcopy(self.rows[split][ep.task.id])
        key = uuid.uuid4().hex
        rcp = row["responses_create_params"]
        meta = dict(rcp.get("metadata") or {})
        meta[SESSION_KEY] = key
        rcp["metadata"] = meta
        # what NeMo-Gym's rollout collection stamps on a row: its task and rollout index, its agent
        row.setdefault("_ng_task_index", int(ep.task.meta.get("index", 0)))
        row["_ng_rollout_index"] = self.rollout_index[ep.task.id]
        self.rollout_index[ep.task.id] += 1
        ref = row.get("agent_ref") if isinstance(row.get("agent_ref"), dict) else None
        agent = ref.get("name") if ref and ref.get("name") in self.launch.servers else self.agent.name
        row["agent_ref"] = {"type": "responses_api_agents", "name": agent}
        route = self.router.routes[key] = Route(ep.base_url, ep.api_key)
        try:
            return await self._run(agent, row, route)
        finally:
            self.router.routes.pop(key, None)

    async def _run(self, agent: str, row: dict[str, Any], route: Route) -> Outcome:
        import aiohttp

        assert self.launch is not None and self.dead is not None and self._http is not None
        url = f"{self.launch.servers[agent]}/run"

        async def post() -> tuple[int, bytes]:
            async with self._http.post(url, json=row) as r:
                return r.status, await r.read()

        call = asyncio.ensure_future(post())
        dead = asyncio.ensure_future(self.dead.wait())
        try:
            await asyncio.wait({call, dead}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            dead.cancel()
            if not call.done():
                call.cancel()
        if not call.done() or call.cancelled():
            return Outcome(infra_error=self._dead_error()[:2000])
        try:
            status, raw = call.result()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            if await self._stopping():
                return Outcome(infra_error=self._dead_error()[:2000])
            return Outcome(infra_error=f"nemo_gym: the agent's /run failed: {type(e).__name__}: {e}"[:2000])
        text = raw.decode(errors="replace")
        if status != 200 and await self._stopping():  # (its servers answer errors as the launcher stops them)
            return Outcome(infra_error=self._dead_error()[:2000])
        if status != 200:
            if route.budget is not None:  # the endpoint refused the policy a call: the episode's own failure
                return Outcome(budget_error=route.budget, metrics={"model_calls": float(route.calls)})
            return Outcome(infra_error=f"nemo_gym: {run_error(text)} (the agent {agent}'s /run answered "
                                       f"{status})"[:2000])
        try:
            verify = json.loads(raw)
        except ValueError:
            return Outcome(infra_error=f"nemo_gym: the agent {agent}'s /run answered with no JSON: {text[:500]}")
        if not isinstance(verify, dict) or "reward" not in verify:
            return Outcome(infra_error=f"nemo_gym: the agent {agent}'s /run answered without a reward: "
                                       f"{text[:500]}")
        reward = verify["reward"]
        if not isinstance(reward, int | float) or isinstance(reward, bool):
            return Outcome(infra_error=f"nemo_gym: /verify gave a reward that is not a number: {reward!r}")
        output = ((verify.get("response") or {}).get("output") or []) if isinstance(verify.get("response"),
                                                                                    dict) else []
        calls = sum(1 for o in output if isinstance(o, dict) and o.get("type") == "function_call")
        return Outcome(reward=float(reward), scores=scores_of(verify, row), budget_error=route.budget,
                       metrics={"model_calls": float(route.calls), "tool_calls": float(calls)},
                       info={"output_items": len(output)})


# ---------------------------------------------------------------------------------------------- processes
def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(p))
    return kids


def _descendants(pid: int) -> list[int]:
    """Every process under `pid` now (Ray's workers run in process groups of their own)."""
    if not os.path.isdir("/proc"):
        return []
    kids, out, todo = _children_map(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_tree(proc: subprocess.Popen[bytes], tree: list[int] | None = None) -> None:
    tree = list(tree or []) + _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


BACKEND = NemoGymBackend
