"""Run processes and what a run dir says about them.

A run is the command line's own process: `python -m rlf_train --config RUN_DIR/config.yaml` (or `--resume
RUN_DIR`), started in its own session and process group, its output appended to `RUN_DIR/ui.log`. Stop is SIGINT
to the group (the trainer's Ctrl-C path: it closes its engine and tool servers and exits; checkpoints are written
atomically), then, after `stop_grace_s`, SIGKILL to every process the run started (found through /proc, in any
session: MCP servers lead sessions of their own). On Linux a run also gets SIGINT if the app dies without
stopping it (PR_SET_PDEATHSIG).

Watching: progress from the log's progress lines and metrics.jsonl, curves from metrics.jsonl (read on from the
last offset; a resumed run rewrites the file, which starts the reading over), tool-call stats from the stored
trajectories (`rlf_envs.records`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pydantic

from rlf_envs.errors import RlfError

LOG_FILE = "ui.log"
PROGRESS = re.compile(r"^(?P<stage>[A-Za-z][\w.-]*) (?P<done>\d+)/(?P<total>\d+) \((?P<pct>\d+)%\)")
State = Literal["running", "stopping", "finished", "stopped", "failed", "ready", "idle"]
MAX_METRIC_ROWS = 5000  # rows sent to the page in one answer (a long run's page reads on from there)


class RunError(RlfError, ValueError):
    """A run that cannot be started, stopped or resumed as asked (the message says why and what to do)."""


# ----------------------------------------------------------------------------------------------- processes
@dataclass(frozen=True)
class Proc:
    pid: int
    start: int  # start time in clock ticks (/proc/PID/stat field 22): a pid reused later is not this process


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time) of a live pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
        if rest[0] == b"Z":
            return None
        return int(rest[1]), int(rest[19])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> list[Proc]:
    """Every live descendant of `pid` (Linux /proc; [] elsewhere), whatever session or group it moved to."""
    if not os.path.isdir("/proc"):
        return []
    children: dict[int, list[Proc]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                children.setdefault(st[0], []).append(Proc(int(name), st[1]))
    out: list[Proc] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child.pid)
    return out


def alive(p: Proc) -> bool:
    st = _stat(p.pid)
    return st is not None and st[1] == p.start


def _kill(p: Proc, sig: int) -> None:
    if alive(p):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p.pid, sig)


try:  # looked up here, not in the forked child (which must not load anything before exec)
    _prctl: Any = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _prctl = None


def _parent_death_signal() -> None:  # in the child, before exec: SIGINT when the app dies
    if _prctl is not None:
        _prctl(1, int(signal.SIGINT))  # PR_SET_PDEATHSIG


@dataclass
class RunProcess:
    popen: subprocess.Popen[bytes]
    argv: list[str]
    started: float
    resumed: bool
    stop_requested: float | None = None
    killed: bool = False
    tree: set[Proc] = field(default_factory=set)

    @property
    def rc(self) -> int | None:
        return self.popen.poll()


# ----------------------------------------------------------------------------------------------- run dirs
class MetricsChunk(pydantic.BaseModel):
    offset: int
    reset: bool
    rows: list[dict[str, Any]]


def read_metrics(run_dir: Path, offset: int = 0, inode: int | None = None) -> tuple[MetricsChunk, int | None]:
    """metrics.jsonl rows from `offset` on (numbers and `stage` only; a torn last line waits for the next read).
    A different file (a resume rewrote it) or a shorter one starts over at 0 with `reset`."""
    path = run_dir / "metrics.jsonl"
    try:
        st = path.stat()
    except OSError:
        return MetricsChunk(offset=0, reset=offset > 0, rows=[]), None
    reset = False
    if (inode is not None and st.st_ino != inode) or st.st_size < offset:
        offset, reset = 0, True
    rows: list[dict[str, Any]] = []
    with path.open("rb") as f:
        f.seek(offset)
        while len(rows) < MAX_METRIC_ROWS:
            line = f.readline()
            if not line.endswith(b"\n"):
                break
            offset += len(line)
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("stage"), str):
                row = {k: v for k, v in rec.items()
                       if isinstance(v, int | float) and not isinstance(v, bool) and len(k) <= 80}
                row["stage"] = rec["stage"][:16]
                rows.append(row)
    return MetricsChunk(offset=offset, reset=reset, rows=rows), st.st_ino


class ToolStat(pydantic.BaseModel):
    tool: str
    calls: int = 0
    ok: int = 0
    failed: dict[str, int] = {}
    latency_mean_s: float = 0.0


class ToolStats(pydantic.BaseModel):
    """Tool calls of the stored training episodes (`logging.trajectories`), per tool: over all stored steps and at
    the latest one."""

    episodes: int = 0
    steps: list[int] = []
    tools: list[ToolStat] = []
    latest_step: int | None = None
    latest: list[ToolStat] = []


def _tool_table(records: list[Any]) -> list[ToolStat]:
    stats: dict[str, ToolStat] = {}
    latency: dict[str, float] = {}
    for rec in records:
        for turn in rec.turns:
            for r in turn.results:
                s = stats.setdefault(r.name, ToolStat(tool=r.name[:200]))
                s.calls += 1
                if r.status == "ok":
                    s.ok += 1
                else:
                    s.failed[r.status] = s.failed.get(r.status, 0) + 1
                latency[r.name] = latency.get(r.name, 0.0) + float(r.latency_s)
    for name, s in stats.items():
        s.latency_mean_s = latency[name] / s.calls if s.calls else 0.0
    return sorted(stats.values(), key=lambda s: -s.calls)[:50]


class _StatsCache:
    def __init__(self) -> None:
        self._files: dict[Path, tuple[tuple[float, int], list[Any]]] = {}

    def records(self, path: Path) -> list[Any]:
        from rlf_envs.records import RecordError, read_records

        try:
            st = path.stat()
        except OSError:
            return []
        key = (st.st_mtime, st.st_size)
        hit = self._files.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        try:
            recs = [r for r in read_records(path) if r.source == "train"]
        except (RecordError, OSError, ValueError):
            recs = []
        self._files[path] = (key, recs)
        return recs

    def stats(self, run_dir: Path, last_files: int = 20) -> ToolStats:
        from rlf_envs.records import list_steps

        steps = list_steps(run_dir)[-last_files:]
        by_step = [(s, self.records(p)) for s, p in steps]
        by_step = [(s, r) for s, r in by_step if r]
        every = [r for _, recs in by_step for r in recs]
        out = ToolStats(episodes=len(every), steps=[s for s, _ in by_step], tools=_tool_table(every))
        if by_step:
            out.latest_step, out.latest = by_step[-1][0], _tool_table(by_step[-1][1])
        return out


class Progress(pydantic.BaseModel):
    stage: str | None = None  # "SFT", "GRPO", ... (the log's progress line)
    done: int = 0
    total: int = 0
    line: str = ""
    rl_step: int = 0  # metrics.jsonl's last RL row
    rl_steps: int = 0
    sft_steps: int = 0


class RunView(pydantic.BaseModel):
    name: str
    run_dir: str
    state: State
    rc: int | None = None
    pid: int | None = None
    started: float | None = None
    command: str = ""
    error: str | None = None
    checkpoint: str | None = None
    resumable: bool = False
    progress: Progress = Progress()


def _tail(path: Path, limit: int) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", "replace")
    if size > limit and "\n" in text:
        text = text.split("\n", 1)[1]
    return text


def _last_rl_step(run_dir: Path) -> int:
    """The step of metrics.jsonl's last RL row (from the file's end)."""
    for line in reversed(_tail(run_dir / "metrics.jsonl", 32_000).splitlines()):
        if '"stage": "rl"' in line:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                return int(json.loads(line).get("step", 0))
    return 0


def _last_error(log: str) -> str | None:
    lines = log.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("error: "):
            return "\n".join(lines[i:i + 20])[len("error: "):]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback"):
            return "\n".join(lines[i:])[-4000:]
    return None


# ----------------------------------------------------------------------------------------------- the manager
class RunManager:
    """The runs under `runs_dir` and the processes this app started for them."""

    def __init__(self, runs_dir: Path, cwd: Path, stop_grace_s: float = 30.0) -> None:
        self.runs_dir = runs_dir
        self.cwd = cwd
        self.stop_grace_s = stop_grace_s
        self.procs: dict[str, RunProcess] = {}
        self._stats = _StatsCache()

    def run_dir(self, name: str) -> Path:
        from rlf_train.ui.spec import NAME

        if not NAME.fullmatch(name or ""):
            raise RunError(f"no run {name!r}: run names are letters, digits, '.', '_' and '-'")
        return (self.runs_dir / name).resolve()

    def command(self, argv: list[str]) -> str:
        shown = ["python", *argv[1:]]
        return f"cd {shlex.quote(str(self.cwd))} && {shlex.join(shown)}"

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self, name: str, config_yaml: str, files: dict[str, str]) -> RunView:
        """Write RUN_DIR/config.yaml (and the files it names) and start `python -m rlf_train --config` on it."""
        from rlf_train.ui.spec import SERVERS_FILE

        run_dir = self.run_dir(name)
        if name in self.procs and self.procs[name].rc is None:
            raise RunError(f"run {name!r} is running: stop it first")
        if (run_dir / "config.yaml").exists() or (run_dir / "metrics.jsonl").exists():
            raise RunError(f"{run_dir} already holds a run: resume it (Resume), or give this one another name")
        run_dir.mkdir(parents=True, exist_ok=True)
        for fname, text in files.items():
            (run_dir / fname).write_text(text, encoding="utf-8")
            if fname == SERVERS_FILE:
                os.chmod(run_dir / fname, 0o600)
        (run_dir / "config.yaml").write_text(config_yaml, encoding="utf-8")
        argv = [sys.executable, "-m", "rlf_train", "--config", str(run_dir / "config.yaml")]
        return self._spawn(name, run_dir, argv, resumed=False)

    def resume(self, name: str, steps: int | None = None) -> RunView:
        """`python -m rlf_train --resume RUN_DIR` (with `--set algorithm.steps=N` to train on to N steps)."""
        run_dir = self.run_dir(name)
        if name in self.procs and self.procs[name].rc is None:
            raise RunError(f"run {name!r} is still running: stop it first, then resume")
        if not (run_dir / "config.yaml").is_file():
            raise RunError(f"{run_dir} holds no run (no config.yaml): start it instead")
        argv = [sys.executable, "-m", "rlf_train", "--resume", str(run_dir)]
        if steps is not None:
            if steps < 0:
                raise RunError(f"steps {steps}: give the RL steps the run should have in all (>= 0)")
            argv += ["--set", f"algorithm.steps={int(steps)}"]
        return self._spawn(name, run_dir, argv, resumed=True)

    def _spawn(self, name: str, run_dir: Path, argv: list[str], resumed: bool) -> RunView:
        log = (run_dir / LOG_FILE).open("ab")
        try:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log.write(f"\n# {stamp} rlf ui: {self.command(argv)}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                argv, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                preexec_fn=_parent_death_signal if _prctl is not None else None)
        finally:
            log.close()
        self.procs[name] = RunProcess(popen=popen, argv=argv, started=time.time(), resumed=resumed)
        return self.view(name)

    def stop(self, name: str) -> RunView:
        """SIGINT to the run's process group (the clean stop); `tick` kills what is left after the grace."""
        p = self.procs.get(name)
        if p is None or p.rc is not None:
            raise RunError(f"run {name!r} is not running (from this app)")
        if p.stop_requested is None:
            p.stop_requested = time.monotonic()
            p.tree |= set(descendants(p.popen.pid))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.popen.pid, signal.SIGINT)
        return self.view(name)

    def tick(self) -> None:
        """Called every second or so: remember each run's processes; kill a stop that outlived its grace, and what
        a run that ended left behind."""
        now = time.monotonic()
        for p in self.procs.values():
            if p.rc is None:
                p.tree |= set(descendants(p.popen.pid))
                if p.stop_requested is not None and now - p.stop_requested > self.stop_grace_s and not p.killed:
                    self._kill_all(p)
            elif p.tree:
                left = [q for q in p.tree if alive(q)]
                for q in left:
                    _kill(q, signal.SIGKILL)
                p.tree = set()

    def _kill_all(self, p: RunProcess) -> None:
        p.killed = True
        p.tree |= set(descendants(p.popen.pid))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.popen.pid, signal.SIGKILL)
        for q in p.tree:
            _kill(q, signal.SIGKILL)

    def running(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.rc is None]

    async def stop_all(self, wait_s: float | None = None) -> list[str]:
        """Stop every run this app started and wait for them (killed after the grace); returns their names."""
        import asyncio

        names = self.running()
        for n in names:
            self.stop(n)
        deadline = time.monotonic() + (self.stop_grace_s if wait_s is None else wait_s)
        while self.running() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            self.tick()
        for n in self.running():
            self._kill_all(self.procs[n])
        for p in self.procs.values():
            for _ in range(100):
                if p.rc is not None:
                    break
                await asyncio.sleep(0.1)
        self.tick()
        return names

    # -- views -----------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Runs on disk (a dir with config.yaml) and those this app started, newest first."""
        from rlf_train.ui.spec import NAME

        found: dict[str, float] = {}
        if self.runs_dir.is_dir():
            for d in self.runs_dir.iterdir():
                if d.is_dir() and NAME.fullmatch(d.name) and (d / "config.yaml").is_file():
                    found[d.name] = (d / "config.yaml").stat().st_mtime
        for n, p in self.procs.items():
            found[n] = max(found.get(n, 0.0), p.started)
        return sorted(found, key=lambda n: -found[n])

    def view(self, name: str) -> RunView:
        run_dir = self.run_dir(name)
        p = self.procs.get(name)
        log = _tail(run_dir / LOG_FILE, 64_000)
        error = None
        if p is None:
            state: State = "idle" if (run_dir / "metrics.jsonl").exists() else "ready"
            if (run_dir / "summary.json").is_file():
                state = "finished"
        elif p.rc is None:
            state = "stopping" if p.stop_requested is not None else "running"
        elif p.rc == 0:
            state = "finished"
        elif p.stop_requested is not None or p.rc in (130, -signal.SIGINT):
            state = "stopped"
        else:
            state = "failed"
            error = _last_error(log) or f"exit status {p.rc}"
        ckpt = None
        latest = run_dir / "checkpoints" / "latest"
        with contextlib.suppress(OSError):
            ckpt = latest.read_text().strip() or None
        return RunView(name=name, run_dir=str(run_dir), state=state, rc=None if p is None else p.rc,
                       pid=None if p is None else p.popen.pid, started=None if p is None else p.started,
                       command=self.command(p.argv) if p is not None else self.command(
                           [sys.executable, "-m", "rlf_train", "--config", str(run_dir / "config.yaml")]),
                       error=error, checkpoint=ckpt, progress=self._progress(run_dir, log),
                       resumable=state not in ("running", "stopping") and (run_dir / "config.yaml").is_file())

    def _progress(self, run_dir: Path, log: str) -> Progress:
        out = Progress(rl_step=_last_rl_step(run_dir))
        for line in reversed(log.splitlines()[-400:]):
            m = PROGRESS.match(line)
            if m:
                out.stage, out.done, out.total, out.line = m["stage"], int(m["done"]), int(m["total"]), line[:300]
                break
        try:
            import yaml

            cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}
            out.rl_steps = int((cfg.get("algorithm") or {}).get("steps", 0))
            sft = cfg.get("sft") or {}
            out.sft_steps = int(sft.get("steps", 0)) if sft.get("enabled") else 0
        except (OSError, ValueError, TypeError, AttributeError):
            pass
        return out

    def details(self, name: str, offset: int, inode: int | None) -> dict[str, Any]:
        """The view plus metrics from `offset`, tool stats and the log's tail: what the page polls."""
        run_dir = self.run_dir(name)
        if not (run_dir / "config.yaml").is_file() and name not in self.procs:
            raise RunError(f"no run {name!r} in {self.runs_dir}")
        chunk, ino = read_metrics(run_dir, offset, inode)
        v = self.view(name)
        return {"run": v.model_dump(), "metrics": chunk.model_dump(), "inode": ino,
                "tool_stats": self._stats.stats(run_dir).model_dump(), "log": _tail(run_dir / LOG_FILE, 12_000)}
