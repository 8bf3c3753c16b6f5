"""What the page sends to set up a run (`RunSpec`), how it becomes the one training config (`compose`), and the
dry-run check (`DryRuns`).

`compose` starts from a config file (or the defaults), applies the page's choices with `rlf_train.config`'s own
`apply_override` (what `--set key=value` does) and validates with `config_from_dict`, so a mistake reads exactly as
`python -m rlf_train` says it. `dry_run` runs `python -m rlf_train --config C --dry-run` itself: its errors are the
errors, word for word. The YAML a run gets is the base file's mapping with those overrides applied: what
`python -m rlf_train --config BASE --set ...` would read (the trainer then writes its resolved dump over it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml

from rlf_envs.rewards.config import VerifierConfigError, parse_verifier_config
from rlf_train.config import ConfigError, TrainConfig, apply_override, config_from_dict, load_config

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TOOLS_ENV, POOL_ENV, POOL_ENV_MODULE = "rlf/Tools-v0", "rlf_ui/Pool-v0", "rlf_train.ui.pool_env"
SERVERS_FILE, TASKS_FILE = "mcp_servers.json", "tasks.jsonl"
#: the reward of configs/mcp/reward.yaml: an answer in <answer></answer>, then exact match
FORMAT_EM: dict[str, Any] = {"type": "gate", "gate": {"type": "format", "require_answer": True},
                             "inner": {"type": "exact_match"}}


class _Choice(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")


class EnvChoice(_Choice):
    """`config`: the base config's env. `registered`: a gymnasium id with kwargs (a YAML mapping). `pool`: a tool
    env (rlf/Tools-v0, or rlf_ui/Pool-v0 with Python tools) on the pool's servers and tools plus a task file."""

    source: Literal["config", "registered", "pool"] = "config"
    id: str = ""
    kwargs: str = ""
    imports: list[str] = []
    servers: list[str] | None = None  # pool: the servers to give the env (None: all)
    python_tools: list[str] | None = None  # pool: the Python sources (None: all)
    tasks_path: str = ""
    tasks_text: str = ""  # an uploaded task file's text (JSONL)
    format: Literal["qwen3", "hermes"] = "qwen3"


class RewardChoice(_Choice):
    """The env's verifier (`env.kwargs.verifier`) or, for `group_judge`, the trainer's `group_reward`."""

    kind: Literal["config", "exact_match", "format_em", "judge", "group_judge", "tool_check", "yaml"] = "config"
    base_url: str = ""
    model: str = ""
    api_key_env: str = ""
    rubric: str = ""
    tool: str = ""
    arguments: str = "{}"
    expect: str = ""
    pattern: str = ""
    yaml: str = ""


class ModelChoice(_Choice):
    kind: Literal["config", "tiny", "hf"] = "config"
    path: str = ""
    device: str = ""
    dtype: Literal["", "float32", "bfloat16", "float16"] = ""
    hidden_size: int | None = None
    num_layers: int | None = None


class TrainingChoice(_Choice):
    """Each field left empty keeps the base config's value."""

    seed: int | None = None
    steps: int | None = None
    sft: Literal["config", "on", "off"] = "config"
    sft_steps: int | None = None
    sft_demos_path: str = ""
    prompts_per_step: int | None = None
    samples_per_prompt: int | None = None
    eval_every: int | None = None
    eval_num_tasks: int | None = None
    save_every: int | None = None


class RunSpec(_Choice):
    name: str
    base: str = ""  # a config file (relative to the app's directory); "": the defaults
    env: EnvChoice = EnvChoice()
    reward: RewardChoice = RewardChoice()
    model: ModelChoice = ModelChoice()
    training: TrainingChoice = TrainingChoice()
    overrides: str = ""  # `--set` lines: key=value, one a line


@dataclass
class PoolSnapshot:
    """What compose needs of the tool pool: the mcpServers map of its servers, its Python sources."""

    servers: dict[str, dict[str, Any]] = field(default_factory=dict)
    python: list[str] = field(default_factory=list)


@dataclass
class Composed:
    run_dir: Path
    config: TrainConfig | None = None
    yaml: str = ""
    error: str | None = None
    files: dict[str, str] = field(default_factory=dict)  # file name (in the run dir) -> text
    command: str = ""
    plan: str = ""
    overrides: list[str] = field(default_factory=list)

    def view(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "yaml": self.yaml, "error": self.error, "files": sorted(self.files),
                "command": self.command, "plan": self.plan, "overrides": self.overrides, "ok": self.error is None}


def check_name(name: str) -> str:
    if not NAME.fullmatch(name or ""):
        raise ConfigError(f"name {name!r}: a run's name is its directory: letters, digits, '.', '_' and '-' (at most "
                          "64, starting with a letter or digit)")
    return name


def read_base(path: Path) -> dict[str, Any]:
    """The base config's mapping, refused with `load_config`'s own message when it is not one."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        data = None
    if not isinstance(data, dict):
        load_config(path)  # raises the CLI's error for this file
        data = {}
    return data


def _set(data: dict[str, Any], key: str, value: Any, applied: list[str]) -> None:
    """`--set key=value` (the value as JSON, which YAML reads as the same value)."""
    text = f"{key}={json.dumps(value, ensure_ascii=False)}"
    apply_override(data, text)
    applied.append(text)


def _abs(cwd: Path, text: str) -> str:
    p = Path(text.strip()).expanduser()
    return str(p if p.is_absolute() else (cwd / p).resolve())


def _mapping(text: str, what: str) -> dict[str, Any]:
    if not text.strip():
        return {}
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{what}: not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: must be a mapping (key: value), got {type(data).__name__}")
    return data


def _verifier(r: RewardChoice) -> dict[str, Any] | None:
    """The verifier mapping of the choice (None: keep the config's), checked by rlf_envs' own parser."""
    if r.kind in ("config", "group_judge"):
        return None
    if r.kind == "exact_match":
        v: dict[str, Any] = {"type": "exact_match"}
    elif r.kind == "format_em":
        v = json.loads(json.dumps(FORMAT_EM))
    elif r.kind == "judge":
        v = {"type": "judge", "base_url": r.base_url.strip(), "model": r.model.strip()}
        if r.api_key_env.strip():
            v["api_key_env"] = r.api_key_env.strip()
    elif r.kind == "tool_check":
        try:
            args = json.loads(r.arguments or "{}")
        except json.JSONDecodeError as e:
            raise ConfigError(f"reward tool_check: the arguments are not valid JSON ({e.msg}, line {e.lineno})"
                              ) from None
        v = {"type": "tool_check", "tool": r.tool.strip(), "arguments": args}
        if r.expect.strip():
            v["expect"] = r.expect.strip()
        if r.pattern.strip():
            v["pattern"] = r.pattern.strip()
    else:
        v = _mapping(r.yaml, "reward YAML")
        if "reward" in v and "type" not in v:  # a reward file (configs/mcp/reward.yaml) as it is
            v = v["reward"]
            if not isinstance(v, dict):
                raise ConfigError("reward YAML: `reward` must be a mapping with a `type`")
    try:
        parse_verifier_config(v, path="env.kwargs.verifier")
    except VerifierConfigError as e:
        raise ConfigError(str(e)) from None
    return v


def _group_reward(r: RewardChoice) -> dict[str, Any]:
    g: dict[str, Any] = {"type": "group_judge", "base_url": r.base_url.strip(), "model": r.model.strip()}
    if r.rubric.strip():
        g["rubric"] = r.rubric.strip()
    if r.api_key_env.strip():
        g["api_key_env"] = r.api_key_env.strip()
    try:
        parse_verifier_config(g, path="group_reward")
    except VerifierConfigError as e:
        raise ConfigError(str(e)) from None
    return g


def _pool_env(e: EnvChoice, pool: PoolSnapshot, cwd: Path, files_dir: Path, files: dict[str, str]) -> dict[str, Any]:
    names = list(pool.servers) if e.servers is None else e.servers
    missing = [n for n in names if n not in pool.servers]
    if missing:
        raise ConfigError(f"env: the pool has no server(s) {missing}; it has {sorted(pool.servers)}")
    python = list(pool.python) if e.python_tools is None else e.python_tools
    if not names and not python:
        raise ConfigError("env: a tool env from the pool needs tools: add an MCP server or a Python tool to the pool "
                          "first (or pick a registered env)")
    kwargs: dict[str, Any] = {"format": e.format}
    if names:
        files[SERVERS_FILE] = json.dumps({"mcpServers": {n: pool.servers[n] for n in names}}, indent=2) + "\n"
        kwargs["mcp_servers"] = str(files_dir / SERVERS_FILE)
    if e.tasks_text.strip():
        files[TASKS_FILE] = e.tasks_text if e.tasks_text.endswith("\n") else e.tasks_text + "\n"
        kwargs["tasks"] = str(files_dir / TASKS_FILE)
    elif e.tasks_path.strip():
        kwargs["tasks"] = _abs(cwd, e.tasks_path)
    else:
        raise ConfigError("env: a tool env from the pool needs a task file: give its path or upload one (JSONL, one "
                          '{"question": ..., "answer": ...} a line)')
    env: dict[str, Any] = {"id": TOOLS_ENV, "kwargs": kwargs, "train_split": None, "eval_split": None,
                           "imports": ["rlf_envs"]}
    if python:
        env.update(id=POOL_ENV, imports=["rlf_envs", POOL_ENV_MODULE])
        kwargs["python_tools"] = python
    return env


def compose(spec: RunSpec, *, cwd: Path, runs_dir: Path, pool: PoolSnapshot, files_dir: Path | None = None) -> Composed:
    """The config of `spec` (never raises for bad input: `error` holds the message the CLI would print). Files the
    config names (the pool's servers, an uploaded task file) are returned in `files`, to be written to `files_dir`
    (default: the run dir)."""
    run_dir = (runs_dir / spec.name).resolve() if NAME.fullmatch(spec.name or "") else runs_dir.resolve()
    out = Composed(run_dir=run_dir)
    files_dir = files_dir or run_dir
    applied: list[str] = []
    data: dict[str, Any] = {}
    try:
        check_name(spec.name)
        if spec.base.strip():
            data = read_base(Path(_abs(cwd, spec.base)))
        e = spec.env
        if e.source == "registered":
            if not e.id.strip():
                raise ConfigError("env.id: pick a registered env id")
            data["env"] = {"id": e.id.strip(), "kwargs": _mapping(e.kwargs, "env.kwargs"),
                           "imports": list(dict.fromkeys(["rlf_envs", *[m for m in e.imports if m.strip()]]))}
        elif e.source == "pool":
            data["env"] = _pool_env(e, pool, cwd, files_dir, out.files)
        verifier = _verifier(spec.reward)
        if verifier is not None:
            env = data.setdefault("env", {})
            if not isinstance(env, dict):
                raise ConfigError("env: must be a section (a mapping)")
            kwargs = env.setdefault("kwargs", {})
            if not isinstance(kwargs, dict):
                raise ConfigError("env.kwargs: must be a mapping")
            kwargs["verifier"] = verifier
        if spec.reward.kind == "group_judge":
            data["group_reward"] = _group_reward(spec.reward)
        m = spec.model
        if m.kind == "tiny":
            _set(data, "model.name_or_path", "tiny", applied)
            for key, v in (("hidden_size", m.hidden_size), ("num_layers", m.num_layers)):
                if v is not None:
                    _set(data, f"model.tiny.{key}", v, applied)
        elif m.kind == "hf":
            path = Path(_abs(cwd, m.path)) if m.path.strip() else None
            if path is None or not (path / "config.json").is_file():
                raise ConfigError(f"model.name_or_path: {m.path!r} is not a Hugging Face model dir (no config.json "
                                  "in it); give the local directory of a transformers model")
            _set(data, "model.name_or_path", str(path), applied)
        if m.device.strip():
            _set(data, "model.device", m.device.strip(), applied)
        if m.dtype:
            _set(data, "model.dtype", m.dtype, applied)
        t = spec.training
        if t.sft != "config":
            _set(data, "sft.enabled", t.sft == "on", applied)
        if t.sft_demos_path.strip():
            _set(data, "sft.demos_path", _abs(cwd, t.sft_demos_path), applied)
        for key, v in (("seed", t.seed), ("algorithm.steps", t.steps), ("sft.steps", t.sft_steps),
                       ("rollout.prompts_per_step", t.prompts_per_step),
                       ("rollout.samples_per_prompt", t.samples_per_prompt), ("eval.every", t.eval_every),
                       ("eval.num_tasks", t.eval_num_tasks), ("logging.save_every", t.save_every)):
            if v is not None:
                _set(data, key, v, applied)
        _set(data, "name", spec.name, applied)
        _set(data, "logging.run_dir", str(run_dir), applied)
        for line in spec.overrides.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                apply_override(data, line.strip())
                applied.append(line.strip())
        cfg = config_from_dict(data)
        if cfg.resolved_run_dir().resolve() != run_dir:
            raise ConfigError(f"logging.run_dir: the app keeps runs in {runs_dir}/<name>; change the run's name "
                              "instead of logging.run_dir")
    except ConfigError as err:
        out.error = str(err)
        out.yaml = yaml.safe_dump(data, sort_keys=False) if data else ""
        return out
    from rlf_train.cli import plan

    out.config = cfg
    # what --set would have made of the base file (the trainer writes the resolved dump itself when it starts)
    source = spec.base.strip() or "rlf_train's defaults"
    out.yaml = (f"# python -m rlf_train.ui: {source} with the page's choices; reproduce with\n"
                f"#   cd {cwd} && python -m rlf_train --config {run_dir / 'config.yaml'}\n"
                + yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    out.plan = plan(cfg)
    out.overrides = applied
    out.command = f"python -m rlf_train --config {run_dir / 'config.yaml'}"
    return out


def write_files(c: Composed, where: Path) -> None:
    where.mkdir(parents=True, exist_ok=True)
    for name, text in c.files.items():
        (where / name).write_text(text, encoding="utf-8")
        if name == SERVERS_FILE:
            os.chmod(where / name, 0o600)  # server entries may hold env values (API keys)


# ---------------------------------------------------------------------------------------------- the dry run
class DryRunResult(pydantic.BaseModel):
    ok: bool
    rc: int | None
    error: str | None
    output: str
    command: str
    seconds: float


class DryRuns:
    """`python -m rlf_train --dry-run` processes, each in its own process group, ended on `aclose`."""

    def __init__(self, cwd: Path, timeout_s: float = 300.0) -> None:
        self.cwd = cwd
        self.timeout_s = timeout_s
        self._procs: set[asyncio.subprocess.Process] = set()

    async def run(self, config_yaml: str, staging: Path) -> DryRunResult:
        import time

        staging.mkdir(parents=True, exist_ok=True)
        path = staging / "config.yaml"
        path.write_text(config_yaml, encoding="utf-8")
        argv = [sys.executable, "-m", "rlf_train", "--config", str(path), "--dry-run"]
        command = f"python -m rlf_train --config {path} --dry-run"
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=self.cwd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._procs.add(proc)
        try:
            async with asyncio.timeout(self.timeout_s):
                raw, _ = await proc.communicate()
        except TimeoutError:
            self._kill(proc)
            await proc.wait()
            return DryRunResult(ok=False, rc=None, output="", command=command, seconds=time.monotonic() - t0,
                                error=f"the dry run did not finish within {self.timeout_s:g}s (stopped)")
        finally:
            self._procs.discard(proc)
        text = raw.decode("utf-8", "replace")
        error = None
        if proc.returncode != 0:
            lines = text.splitlines()
            first = next((i for i, line in enumerate(lines) if line.startswith("error: ")), None)
            error = ("\n".join(lines[first:])[len("error: "):] if first is not None
                     else f"exit status {proc.returncode}:\n" + "\n".join(lines[-30:]))
        return DryRunResult(ok=proc.returncode == 0, rc=proc.returncode, error=error, output=text[-20_000:],
                            command=command, seconds=time.monotonic() - t0)

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    async def aclose(self) -> None:
        procs = list(self._procs)
        for p in procs:
            self._kill(p)
        for p in procs:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(10):
                    await p.wait()
