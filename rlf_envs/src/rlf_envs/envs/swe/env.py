"""`rlf/SWE-v0`: repair a real Python repository with a shell and file tools; hidden tests decide the reward.

Tools (shared by every env of the process; each call runs in the episode's own sandbox session, bound by the
env where no JSON argument can forge it): `bash(command)`, `read_file(path, start?, end?)`, `write_file(path,
text)`, `edit(path, old, new)` (exact, unique match), `submit()` (ends the episode; other calls of that turn are
not run). Outputs are capped with a marker saying what was cut.

The session (`rlf_envs.sandbox.sessions`) starts at the first tool call from the task's repository (its starting
state: base + bug), in the task's image. At the end of the episode (submit, a final answer, max turns or the
token budget) the env takes the workspace's diff and closes the session; `SweVerifier` applies the library part
of the diff to a FRESH session of the same repository and runs the hidden FAIL_TO_PASS + PASS_TO_PASS tests
there (`verify.py`: what the patch may not touch, how the run is guarded). Reward 1.0 when every one passes
(`partial_credit=True`: the F2P fraction when every P2P passes). A host failure (`SessionInfraError`) makes the
episode infrastructure-failed: `trajectory.infra_error` is set (the trainer drops such episodes from the loss),
`info["infra_failed"] = True`, `trajectory.score_info["infra_failed"] = 1.0`; its reward 0.0 is not a verdict.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import inspect
import logging
import shlex
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlf_envs import runtime
from rlf_envs.env.tool_env import PendingStep, StepReturn, ToolEnv
from rlf_envs.envs.swe.tasks import HIDE_HISTORY, SweTask, load_swe_jsonl, load_swe_rows, repo_for, shipped_tasks
from rlf_envs.envs.swe.verify import MAX_PATCH_BYTES, Verdict, run_hidden_tests
from rlf_envs.rewards.base import Verifier
from rlf_envs.sandbox.sessions import (
    Session,
    SessionBackend,
    SessionClosed,
    SessionDiffTooLarge,
    SessionError,
    SessionExpired,
    SessionFileNotFound,
    SessionInfraError,
    SessionLimitExceeded,
    SessionLimits,
    SessionSpec,
    open_backend,
)
from rlf_envs.tasks.harbor import HarborError
from rlf_envs.tools.base import InvalidArguments, Tool, ToolError, ToolSpec
from rlf_envs.tools.caller import invoke
from rlf_envs.types import Action, ActionKind, EndReason, Score, Task, ToolCall, Trajectory

log = logging.getLogger(__name__)
SUBMIT = "submit"
SYSTEM_PROMPT = (
    "You are a software engineer fixing a bug in a Python repository. Use the tools to explore the code, run the "
    "tests, and edit files. Keep commands short; outputs are cut when long. Call submit() when the fix is done."
)

_BACKENDS: dict[str, SessionBackend] = {}
_LOCK = threading.Lock()


def shared_backend(name: str | SessionBackend) -> SessionBackend:
    """One session backend per name per process (closed at exit), or the instance given."""
    if isinstance(name, SessionBackend):
        return name
    with _LOCK:
        if name not in _BACKENDS:
            _BACKENDS[name] = open_backend(name)
            runtime.register_closer(_BACKENDS[name])
        return _BACKENDS[name]


def default_image() -> str:
    """The Debian test image (python3, git, pytest) when it was built, else the host's tools."""
    try:
        from rlf_envs.sandbox.sessions.images import debian_test_image

        return debian_test_image() or "host"
    except ImportError:
        return "host"


@dataclass(frozen=True)
class SweLimits:
    """Limits of the episode's session and of the hidden run. `output_chars`: what one tool call shows."""

    exec_timeout_s: float = 30.0
    memory_mb: int = 1024
    pids: int = 256
    disk_mb: int = 512
    session_timeout_s: float = 3600.0
    output_chars: int = 8000
    test_timeout_s: float = 300.0
    max_file_chars: int = 200_000
    #: the largest workspace patch judged (larger: reward 0, `failure/patch_too_large`; never kept in the answer)
    max_patch_bytes: int = MAX_PATCH_BYTES

    def session(self) -> SessionLimits:
        return SessionLimits(memory_mb=self.memory_mb, pids=self.pids, disk_mb=self.disk_mb,
                             exec_timeout_s=self.exec_timeout_s, session_timeout_s=self.session_timeout_s,
                             output_bytes=max(4096, self.output_chars * 4), diff_bytes=self.max_patch_bytes)


def session_spec(t: SweTask, image: str | None, limits: SweLimits,
                 backend: str | SessionBackend = "local") -> tuple[SessionSpec, list[tuple[Any, ...]]]:
    """The task's session spec and the steps replayed at each session start (Harbor tasks' Dockerfiles)."""
    if t.harbor is not None:
        from rlf_envs.envs.swe.harbor_run import harbor_spec

        name = backend if isinstance(backend, str) else getattr(backend, "name", "local")
        return harbor_spec(t.harbor, name, limits.session())
    img = t.image if t.image != "host" or image is None else image
    seed = repo_for(t)  # without its git history unless the task keeps it
    # a repository held by the image: its history is squashed to one commit when the workspace starts
    steps: list[tuple[Any, ...]] = [] if seed is not None or t.keep_history else [
        ("run", HIDE_HISTORY.replace('"$1"', shlex.quote(t.workdir)), t.workdir, ())]
    return SessionSpec(image=img, workdir=t.workdir, seed_dir=str(seed) if seed is not None else None,
                       env={"LANG": "C.UTF-8", "PYTHONPATH": f"{t.workdir}/{t.pythonpath}".rstrip("/."),
                            "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/tmp"},
                       network=False, limits=limits.session()), steps


class _NoBackend(SessionBackend):
    """The backend of a workspace whose environment could not be made (its infra_error says why)."""

    name = "none"

    async def create(self, spec: SessionSpec) -> Session:
        raise SessionInfraError("no session backend")

    def reap(self) -> int:
        return 0

    async def aclose(self) -> None:
        return None


class Workspace:
    """The episode's session, started at its first use (so a reset costs nothing) and closed at the end."""

    def __init__(self, backend: SessionBackend, spec: SessionSpec, steps: list[tuple[Any, ...]] | None = None) -> None:
        self.backend, self.spec, self.steps = backend, spec, steps or []
        self._session: Session | None = None
        self._lock = asyncio.Lock()
        self.infra_error: str | None = None
        self.closed = False

    @property
    def started(self) -> bool:
        return self._session is not None

    async def session(self) -> Session:
        async with self._lock:
            if self.closed:
                raise ToolError("the episode is over: its workspace is closed")
            if self.infra_error is not None:
                raise ToolError(f"infrastructure failure: {self.infra_error} (not your fault; the episode is "
                                "not scored)")
            if self._session is None:
                try:
                    session = await self.backend.create(self.spec)
                except SessionInfraError as e:
                    self.infra_error = str(e)[:300]
                    raise ToolError(f"infrastructure failure: could not start the workspace ({self.infra_error})"
                                    ) from None
                if self.steps:
                    from rlf_envs.envs.swe.harbor_run import prepare

                    try:
                        await prepare(session, self.steps)
                    except (SessionError, ValueError) as e:
                        await session.aclose()
                        self.infra_error = f"the task's environment could not be prepared: {str(e)[:300]}"
                        raise ToolError(f"infrastructure failure: {self.infra_error}") from None
                self._session = session
            return self._session

    def mark_infra(self, e: BaseException) -> None:
        self.infra_error = self.infra_error or f"{type(e).__name__}: {str(e)[:300]}"

    async def aclose(self) -> None:
        self.closed = True
        s, self._session = self._session, None
        if s is not None:
            try:
                await s.aclose()
            except Exception as e:  # close never raises by contract; a bad plugin must not break the step
                log.warning("session close failed: %r", e)


def failure_kind(e: SessionError) -> str:
    """The metrics name of a failure the episode caused itself (`failure/<kind>`)."""
    if isinstance(e, SessionDiffTooLarge):
        return "patch_too_large"
    if isinstance(e, SessionExpired):
        return "session_expired"
    if isinstance(e, SessionLimitExceeded):
        return f"limit_{e.limit}"
    return "session_error"


def cut(text: str, limit: int) -> str:
    """`text` within `limit` characters: head and tail kept, a marker says how much of the middle was cut."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    return (f"{text[:head]}\n...[output cut: {len(text) - limit} of {len(text)} characters removed from the "
            f"middle]...\n{text[-tail:]}")


class SweTool(Tool):
    """Base of the SWE tools: takes the workspace its env bound to the call (`context`), checks arguments, maps
    session errors."""

    validates_arguments = True
    takes_context = True
    allowed: tuple[str, ...] = ()
    required: tuple[str, ...] = ()

    def __init__(self, limits: SweLimits) -> None:
        self.limits = limits
        self.timeout_s = limits.exec_timeout_s + 60.0  # after the session's own deadline (and a cold start)

    def _ws(self, arguments: dict[str, Any], context: Any) -> Workspace:
        ws = context
        if not isinstance(ws, Workspace):
            raise ToolError(f"{self.name} runs only inside rlf/SWE-v0 (no workspace bound to this episode)")
        extra = sorted(set(arguments) - set(self.allowed))
        if extra:
            raise InvalidArguments(f"unknown argument(s) for {self.name}: {', '.join(extra)}; it takes "
                                   f"{', '.join(self.allowed) or 'no arguments'}")
        for k in self.required:
            if not isinstance(arguments.get(k), str):
                raise InvalidArguments(f"{self.name} needs a string argument {k!r}")
        return ws

    async def call(self, arguments: dict[str, Any], context: Any = None) -> str:
        ws = self._ws(arguments, context)
        session = await ws.session()
        try:
            return await self._run(session, arguments)
        except SessionInfraError as e:
            ws.mark_infra(e)
            raise ToolError(f"infrastructure failure: {ws.infra_error} (not your fault; the episode is not "
                            "scored)") from None
        except SessionFileNotFound:
            path = arguments.get("path", "")
            raise ToolError(f"no such file: {path} (relative paths start at {ws.spec.workdir})") from None
        except SessionError as e:
            raise ToolError(str(e)[:500]) from None

    async def _run(self, s: Session, arguments: dict[str, Any]) -> str:
        raise NotImplementedError


class Bash(SweTool):
    allowed = required = ("command",)

    def __init__(self, limits: SweLimits) -> None:
        super().__init__(limits)
        self.spec = ToolSpec("bash", f"Run a bash command in the repository (cwd: the repository root; no network; "
                                     f"killed after {limits.exec_timeout_s:.0f} s). Shows stdout, stderr and the "
                                     "exit code.",
                             {"type": "object", "properties": {"command": {"type": "string"}},
                              "required": ["command"]})

    async def _run(self, s: Session, arguments: dict[str, Any]) -> str:
        cmd = arguments["command"]
        if not cmd.strip():
            raise InvalidArguments("'command' is empty")
        if len(cmd) > self.limits.max_file_chars:
            raise InvalidArguments(f"'command' has {len(cmd)} characters (limit {self.limits.max_file_chars}): "
                                   "write long scripts with write_file and run them")
        r = await s.exec(cmd, timeout_s=self.limits.exec_timeout_s)
        parts = []
        if r.stdout:
            parts.append(r.stdout.rstrip("\n"))
        if r.stderr:
            parts.append("[stderr]\n" + r.stderr.rstrip("\n"))
        text = cut("\n".join(parts), self.limits.output_chars)
        if r.truncated:
            text += "\n[output cut by the session: more than its per-call output cap]"
        if r.timed_out:
            text += f"\n[timed out after {self.limits.exec_timeout_s:.0f} s: everything the command started was killed]"
        return f"{text}\n[exit code {r.exit_code}]".lstrip("\n")


class ReadFile(SweTool):
    allowed = ("path", "start", "end")
    required = ("path",)

    def __init__(self, limits: SweLimits) -> None:
        super().__init__(limits)
        self.spec = ToolSpec(
            "read_file", "Show a file with line numbers, optionally only lines start..end (1-based, inclusive).",
            {"type": "object", "properties": {"path": {"type": "string"}, "start": {"type": "integer"},
                                              "end": {"type": "integer"}}, "required": ["path"]})

    async def _run(self, s: Session, arguments: dict[str, Any]) -> str:
        start, end = arguments.get("start", 1), arguments.get("end")
        if not isinstance(start, int) or isinstance(start, bool) or start < 1:
            raise InvalidArguments("'start' must be a line number >= 1")
        if end is not None and (not isinstance(end, int) or isinstance(end, bool) or end < start):
            raise InvalidArguments("'end' must be a line number >= start")
        data = await s.read_file(arguments["path"])
        lines = data.decode("utf-8", "replace").splitlines()
        if start > max(len(lines), 1):
            raise ToolError(f"{arguments['path']} has {len(lines)} lines; start={start} is past its end")
        chosen = lines[start - 1:end]
        width = len(str(start + len(chosen)))
        body = "\n".join(f"{n:>{width}}  {line}" for n, line in enumerate(chosen, start))
        return cut(body, self.limits.output_chars) if body else "(empty file)"


class WriteFile(SweTool):
    allowed = required = ("path", "text")

    def __init__(self, limits: SweLimits) -> None:
        super().__init__(limits)
        self.spec = ToolSpec("write_file", "Create or overwrite a file with the given text.",
                             {"type": "object", "properties": {"path": {"type": "string"},
                                                               "text": {"type": "string"}},
                              "required": ["path", "text"]})

    async def _run(self, s: Session, arguments: dict[str, Any]) -> str:
        text = arguments["text"]
        if len(text) > self.limits.max_file_chars:
            raise InvalidArguments(f"'text' has {len(text)} characters; the limit is {self.limits.max_file_chars}")
        await s.write_file(arguments["path"], text)
        return f"wrote {len(text)} characters to {arguments['path']}"


class Edit(SweTool):
    allowed = required = ("path", "old", "new")

    def __init__(self, limits: SweLimits) -> None:
        super().__init__(limits)
        self.spec = ToolSpec(
            "edit", "Replace the exact text `old` with `new` in a file; `old` must occur exactly once (include "
                    "surrounding lines to make it unique).",
            {"type": "object", "properties": {"path": {"type": "string"}, "old": {"type": "string"},
                                              "new": {"type": "string"}}, "required": ["path", "old", "new"]})

    async def _run(self, s: Session, arguments: dict[str, Any]) -> str:
        path, old, new = arguments["path"], arguments["old"], arguments["new"]
        if not old:
            raise InvalidArguments("'old' is empty: give the exact text to replace (use write_file for a new file)")
        text = (await s.read_file(path)).decode("utf-8", "replace")
        n = text.count(old)
        if n == 0:
            raise ToolError(f"'old' was not found in {path} (it must match exactly, whitespace and indentation "
                            "included; read_file the lines first)")
        if n > 1:
            raise ToolError(f"'old' occurs {n} times in {path}; include more surrounding lines so it is unique")
        out = text.replace(old, new, 1)
        if len(out) > self.limits.max_file_chars * 5:
            raise ToolError(f"the edited file would have {len(out)} characters; too large")
        await s.write_file(path, out)
        line = text[:text.index(old)].count("\n") + 1
        return f"edited {path} at line {line} ({old.count(chr(10)) + 1} line(s) replaced by {new.count(chr(10)) + 1})"


class Submit(Tool):
    def __init__(self) -> None:
        self.spec = ToolSpec(SUBMIT, "Submit your changes for grading; ends the episode.",
                             {"type": "object", "properties": {}})

    async def call(self, arguments: dict[str, Any]) -> str:
        return "submitted"


_TOOLS: dict[SweLimits, tuple[Tool, ...]] = {}


def swe_tools(limits: SweLimits | None = None) -> tuple[Tool, ...]:
    """The process-wide SWE tools for these limits (envs share them, and so one Toolbox)."""
    limits = limits or SweLimits()
    with _LOCK:
        if limits not in _TOOLS:
            _TOOLS[limits] = (Bash(limits), ReadFile(limits), WriteFile(limits), Edit(limits), Submit())
        return _TOOLS[limits]


class SweVerifier(Verifier):
    """Scores a SWE episode: its patch (`trajectory.answer`) on a fresh session of the task's repository, hidden
    F2P + P2P tests (see `verify.py`). A host failure gives `info["infra_failed"] = 1.0`."""

    name = "swe"

    def __init__(self, backend: str | SessionBackend = "local", image: str | None = None,
                 limits: SweLimits | None = None, partial_credit: bool = False) -> None:
        self.backend = backend
        self.image = image
        self.limits = limits or SweLimits()
        self.partial_credit = partial_credit

    async def verdict(self, patch: str, task: Task) -> Verdict:
        """The hidden run's verdict on `patch`. Only a failure of the host (SessionInfraError, a task environment
        that cannot be built, a verifier session that fails before the patch is applied) is `infra_failed`; what
        the patch's code causes is its own `failure` (reward 0)."""
        t = SweTask.from_meta(task)
        if len(patch) > self.limits.max_patch_bytes:  # before any session: never applied, never kept
            return Verdict(f2p_total=len(t.FAIL_TO_PASS), p2p_total=len(t.PASS_TO_PASS)).fail(
                "patch_too_large", f"the patch is larger than {self.limits.max_patch_bytes} bytes")
        session = None
        try:
            spec, steps = session_spec(t, self.image, self.limits, self.backend)
            backend = shared_backend(self.backend)
            session = await backend.create(spec)
            if t.harbor is not None:
                from rlf_envs.envs.swe.harbor_run import run_harbor_verifier

                return await run_harbor_verifier(session, t.harbor, patch, steps)
            return await run_hidden_tests(session, t, patch, partial_credit=self.partial_credit,
                                          timeout_s=self.limits.test_timeout_s,
                                          max_patch_bytes=self.limits.max_patch_bytes)
        except (SessionInfraError, HarborError) as e:  # HarborError: the task's image could not be built/replayed
            return Verdict(f2p_total=len(t.FAIL_TO_PASS), p2p_total=len(t.PASS_TO_PASS), infra_failed=True,
                           error=f"{type(e).__name__}: {str(e)[:500]}")
        except SessionError as e:  # a call of rlf's own refused on the pristine session: the host's, not the patch's
            return Verdict(f2p_total=len(t.FAIL_TO_PASS), p2p_total=len(t.PASS_TO_PASS), infra_failed=True,
                           error=f"the verifier session failed: {type(e).__name__}: {str(e)[:500]}")
        finally:
            if session is not None:
                await session.aclose()

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        if trajectory.score_info.get("infra_failed"):
            return Score(0.0, info={"infra_failed": 1.0})
        own = {k: v for k, v in trajectory.score_info.items() if k.startswith("failure/")}
        if own:  # the episode failed by its own doing before a patch could be judged (env._patch)
            return Score(0.0, info={**own, "infra_failed": 0.0})
        v = await self.verdict(trajectory.answer or "", task)
        return Score(0.0 if v.infra_failed else v.value, info=v.info())


def load_tasks_once(tasks: Any) -> list[Task]:
    from rlf_envs.tasks import load_tasks

    return load_tasks(tasks)


class SweEnv(ToolEnv):
    """Repository repair with a shell, file tools and hidden tests.

    Args:
        split: "train" or "test" of rlf's shipped tasks (ignored when `tasks` or `task_file` is given).
        task_file: a SWE-bench-style JSONL/JSON file (see `rlf_envs.envs.swe.tasks`), or a directory of Harbor
            tasks (`rlf_envs.tasks.harbor`).
        backend: "local" (default), "docker", or a SessionBackend.
        image: the session image of tasks that name none ("host" tasks): default the Debian test image when it was
            built (`python -m rlf_envs.sandbox.sessions.images build-debian`), else the host's tools.
        limits: SweLimits or its dict (exec deadline, memory, output cap, hidden-run deadline...).
        partial_credit: reward the fraction of FAIL_TO_PASS tests that pass (when every PASS_TO_PASS passes).
        build_args, base_images: for a `task_file` directory of Harbor tasks: the Dockerfile's build ARGs, and root
            directories standing for its FROM images on the local backend (`rlf_envs.tasks.harbor.load_harbor_dir`).
        **kwargs: ToolEnv's (tasks, max_turns (default 30), max_total_tokens (default 32768), max_obs_tokens,
            tokenizer, format, system_prompt...).
    """

    def __init__(
        self,
        split: str = "train",
        task_file: str | None = None,
        backend: str | SessionBackend = "local",
        image: str | None = None,
        limits: SweLimits | dict[str, Any] | None = None,
        partial_credit: bool = False,
        format: Any = "qwen3",
        build_args: dict[str, str] | None = None,
        base_images: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        _refuse_unknown_kwargs(kwargs)
        lim = swe_limits(limits)
        if task_file is not None:
            if kwargs.get("tasks") is not None:
                raise ValueError("give tasks= or task_file=, not both")
            from pathlib import Path

            if Path(task_file).is_dir():
                from rlf_envs.tasks.harbor import load_harbor_dir

                kwargs["tasks"] = load_harbor_dir(task_file, build_args=_str_map(build_args, "build_args"),
                                                  base_images=_str_map(base_images, "base_images"))
            else:
                if build_args or base_images:
                    raise ValueError("build_args/base_images are for a task_file directory of Harbor tasks; "
                                     f"{task_file!r} is a SWE-bench-style file")
                kwargs["tasks"] = load_swe_jsonl(task_file)
        elif kwargs.get("tasks") is None:
            kwargs["tasks"] = shipped_tasks(split)
        else:
            tasks = kwargs["tasks"]
            if not isinstance(tasks, str) and all(isinstance(t, dict) and "instance_id" in t for t in tasks):
                kwargs["tasks"] = load_swe_rows(tasks)
        self.backend_name = backend
        backend_kind = backend if isinstance(backend, str) else getattr(backend, "name", "")
        if image is None and backend_kind == "docker" and any(
                SweTask.from_meta(t).image == "host" and SweTask.from_meta(t).harbor is None
                for t in load_tasks_once(kwargs["tasks"])):
            raise ValueError("the docker backend needs image='docker:<ref>' (an image with python3, git and pytest, "
                             "e.g. the Debian test image loaded into the engine) for tasks that name no image")
        self.image = image if image is not None else default_image()
        self.limits = lim
        self._tools = swe_tools(lim)
        kwargs.setdefault("verifier", SweVerifier(backend, self.image, lim, partial_credit))
        kwargs.setdefault("system_prompt", SYSTEM_PROMPT)
        if isinstance(format, str) and format in ("qwen3", "hermes"):  # the episode ends with submit(), not a tag
            kwargs["format_kwargs"] = {"answer_instruction": None, **(kwargs.get("format_kwargs") or {})}
        kwargs.setdefault("max_turns", 30)
        kwargs.setdefault("max_total_tokens", 32768)
        kwargs.setdefault("max_obs_tokens", 2048)
        super().__init__(tools=[*self._tools, *kwargs.pop("tools", ())], format=format, **kwargs)
        self._names = frozenset(t.name for t in self._tools if t.name != SUBMIT)
        self._ws: Workspace | None = None
        check_host(backend, self.image, lim, [SweTask.from_meta(t) for t in self.tasks])

    @property
    def workspace(self) -> Workspace | None:
        return self._ws

    def parse_action(self, text: str) -> Action:
        """A turn that calls submit() ends the episode (its other calls are not run)."""
        action = super().parse_action(text)
        if action.kind is ActionKind.TOOL_CALLS and any(c.name == SUBMIT for c in action.calls):
            return Action(ActionKind.ANSWER, action.text, calls=action.calls, answer=SUBMIT)
        return action

    def _workspace(self) -> Workspace:
        if self._ws is None:
            t = SweTask.from_meta(self.trajectory.task)
            try:
                spec, steps = session_spec(t, self.image, self.limits, self.backend_name)
                self._ws = Workspace(shared_backend(self.backend_name), spec, steps)
            except (SessionInfraError, HarborError) as e:  # the image could not be built / no engine: not scored
                self._ws = Workspace(_NoBackend(), SessionSpec(), [])
                self._ws.infra_error = f"the task's environment could not be made: {str(e)[:500]}"
        return self._ws

    def bind_calls(self, step: PendingStep) -> Sequence[ToolCall]:
        calls = step.turn.action.calls
        if not any(c.name in self._names for c in calls):
            return calls
        ws = self._workspace()
        return [ToolCall(c.name, c.arguments, c.id, context=ws) if c.name in self._names else c for c in calls]

    async def _patch(self) -> tuple[str, str | None, str | None]:
        """The workspace's diff ("" when no session was started), the infra error (the host's failure), and the
        episode's own failure kind (`failure_kind`: its session ran past its wall clock, its patch is too large,
        its processes exhausted the session's limits), if any."""
        ws = self._ws
        if ws is None or not ws.started:
            return "", ws.infra_error if ws is not None else None, None
        if ws.infra_error is not None:
            return "", ws.infra_error, None
        try:
            session = await ws.session()
            return await session.diff(max_bytes=self.limits.max_patch_bytes), None, None
        except SessionInfraError as e:
            ws.mark_infra(e)
            return "", ws.infra_error, None
        except (SessionExpired, SessionLimitExceeded) as e:
            return "", None, failure_kind(e)
        except (SessionClosed, SessionError, ToolError) as e:
            ws.mark_infra(e)  # a session closed under us (not by the policy): no patch to judge
            return "", ws.infra_error, None

    async def _score_end(self, result: StepReturn) -> StepReturn:
        traj = self._traj
        assert traj is not None
        try:
            patch, infra, failure = await runtime.bridge(self._patch())
        finally:
            ws, self._ws = self._ws, None
            if ws is not None:
                await runtime.bridge(ws.aclose())
        if traj.end is EndReason.ANSWER and traj.answer == SUBMIT:
            traj.end = EndReason.SUBMIT
        traj.answer = patch
        if infra is not None:
            traj.score_info = {"infra_failed": 1.0}
        elif failure is not None:
            traj.score_info = {f"failure/{failure}": 1.0}
        obs, reward, terminated, truncated, info = await super()._score_end(result)
        infra_failed = bool(traj.score_info.get("infra_failed"))
        info["infra_failed"] = infra_failed
        if infra_failed:  # the trainer drops it (Trajectory.infra_error), never trains on its 0.0
            traj.infra_error = info["infra_error"] = infra or "the hidden-test session failed on the host"
        return obs, reward, terminated, truncated, info

    def end_episode(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None and ws.started:
            try:
                loop = runtime.get_loop()
                asyncio.run_coroutine_threadsafe(ws.aclose(), loop)  # closing must not block a reset
            except RuntimeError:
                pass


BACKENDS = ("local", "docker", "ray")  # ray: RLF_RAY_ADDRESS, default "auto" (docs/guides/coding-agent-cluster.md)


def swe_limits(limits: SweLimits | dict[str, Any] | None) -> SweLimits:
    """SweLimits from itself, its dict (unknown keys refused naming the close ones) or None."""
    if limits is None or isinstance(limits, SweLimits):
        return limits or SweLimits()
    if not isinstance(limits, dict):
        raise TypeError(f"limits must be SweLimits or a dict, got {type(limits).__name__}")
    known = [f.name for f in dataclasses.fields(SweLimits)]
    for k in limits:
        if k not in known:
            close = difflib.get_close_matches(k, known, n=1)
            raise ValueError(f"unknown SWE limit {k!r}" + (f"; did you mean {close[0]!r}?" if close else "")
                             + f" (limits: {', '.join(known)})")
    return SweLimits(**limits)


def _refuse_unknown_kwargs(kwargs: dict[str, Any]) -> None:
    known = [p for p in inspect.signature(ToolEnv.__init__).parameters if p != "self"]
    known += [p for p in inspect.signature(SweEnv.__init__).parameters if p not in ("self", "kwargs")]
    for k in kwargs:
        if k not in known:
            close = difflib.get_close_matches(k, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"rlf/SWE-v0 got an unknown argument {k!r}{hint} (it takes {', '.join(known)})")


def _str_map(v: Any, name: str) -> dict[str, str] | None:
    if v is None:
        return None
    if not isinstance(v, dict) or not all(isinstance(a, str) and isinstance(b, str) for a, b in v.items()):
        raise ValueError(f"{name} must map strings to strings, got {v!r}")
    return v


def check_host(backend: str | SessionBackend, image: str, limits: SweLimits, tasks: Sequence[SweTask]) -> None:
    """Refuse a misconfigured host before any episode runs (house rule 9): an unknown backend, one that cannot open
    (no root, no engine), an image the backend cannot start (a missing directory or archive, a docker image the
    engine does not hold or without its `docker:` prefix), a task without a repository. Each error says how to fix
    it; what fails later on the host is an infrastructure failure, never a reward of 0."""
    if isinstance(backend, str) and backend not in BACKENDS:
        close = difflib.get_close_matches(backend, BACKENDS, n=1)
        raise ValueError(f"unknown session backend {backend!r}" + (f"; did you mean {close[0]!r}?" if close else "")
                         + f" (backends: {', '.join(BACKENDS)}, or a SessionBackend instance)")
    kind = backend if isinstance(backend, str) else getattr(backend, "name", "")
    b = shared_backend(backend)  # SessionInfraError naming why (the local backend needs root, no docker engine)
    checked: set[str] = set()
    for t in tasks:
        if t.harbor is not None:
            if kind != "docker":
                session_spec(t, image, limits, backend)  # a Dockerfile the local backend cannot replay: now
            continue
        img = t.image if t.image != "host" else image
        if t.repo_dir is None and t.image == "host" and not t.repo:
            raise ValueError(f"task {t.instance_id!r} has no repository: give repo_dir (a directory holding it), "
                             "repo (one of rlf's shipped archives) or an image that holds it at workdir")
        if t.repo_dir is None and t.image == "host":
            from rlf_envs.data.swe import DATA_DIR

            if not (DATA_DIR / "repos" / f"{t.repo}.tar.gz").is_file():
                raise ValueError(f"task {t.instance_id!r}: repo {t.repo!r} is not one of rlf's shipped archives; "
                                 "give repo_dir or an image that holds the repository")
        if img in checked:
            continue
        checked.add(img)
        b.check_image(img)  # ValueError saying how to fix it: a missing root or archive, an image not in the engine


def swe_tasks(split: str = "train") -> list[Task]:
    return shipped_tasks(split)



class SweSession:
    """rlf/SWE-v0's tools and verdict outside an env, for agent code (`rollout.agent`, any OpenAI-SDK loop):

        ws = SweSession(task)                  # a SWE Task (shipped, SWE-bench-style or Harbor)
        tools = ws.openai_tools()              # bash, read_file, write_file, edit, submit as `tools=`
        text = await ws.call("bash", {"command": "ls"})   # errors come back as "Error: ..." text
        verdict = await ws.submit()            # diff -> fresh session -> hidden tests; closes the workspace

    `verdict.value` is the reward; `verdict.infra_failed` marks a host failure (not a reward)."""

    def __init__(self, task: Task, backend: str | SessionBackend = "local", image: str | None = None,
                 limits: SweLimits | None = None, partial_credit: bool = False) -> None:
        self.task = task
        self.limits = limits or SweLimits()
        self.image = image if image is not None else default_image()
        self.backend = backend
        t = SweTask.from_meta(task)
        spec, steps = session_spec(t, self.image, self.limits, backend)
        self.workspace = Workspace(shared_backend(backend), spec, steps)
        self.tools = {tool.name: tool for tool in swe_tools(self.limits)}
        self.verifier = SweVerifier(backend, self.image, self.limits, partial_credit)

    def openai_tools(self) -> list[dict[str, Any]]:
        return [tool.spec.to_openai() for tool in self.tools.values()]

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Run one tool (on rlf's loop, where the process's sessions live, whatever loop the caller runs on)."""
        return await runtime.bridge(self._call(name, arguments))

    async def _call(self, name: str, arguments: dict[str, Any]) -> str:
        tool = self.tools.get(name)
        if tool is None:
            return f"Error: no tool {name!r}; tools: {', '.join(self.tools)}"
        if not isinstance(arguments, dict):
            return "Error: arguments must be a JSON object"
        try:
            return await asyncio.wait_for(invoke(tool, ToolCall(name, arguments, context=self.workspace)),
                                          (tool.timeout_s or 60.0) + 5.0)
        except (ToolError, InvalidArguments) as e:
            return f"Error: {e}"
        except TimeoutError:
            return "Error: the tool call ran past its deadline"

    async def submit(self) -> Verdict:
        """The episode's verdict: the workspace diff on a fresh session, hidden tests; closes the workspace."""
        return await runtime.bridge(self._submit())

    async def _submit(self) -> Verdict:
        try:
            if self.workspace.infra_error is not None:
                return Verdict(infra_failed=True, error=self.workspace.infra_error)
            patch = ""
            if self.workspace.started:
                try:
                    patch = await (await self.workspace.session()).diff(max_bytes=self.limits.max_patch_bytes)
                except (SessionExpired, SessionLimitExceeded) as e:  # the episode's own doing: reward 0
                    return Verdict().fail(failure_kind(e), f"{type(e).__name__}: {str(e)[:300]}")
                except (SessionError, ToolError) as e:
                    return Verdict(infra_failed=True, error=f"{type(e).__name__}: {str(e)[:300]}")
            return await self.verifier.verdict(patch, self.task)
        finally:
            await self.workspace.aclose()

    async def aclose(self) -> None:
        await runtime.bridge(self.workspace.aclose())


__all__ = ["SweEnv", "SweLimits", "SweSession", "SweVerifier", "Workspace", "swe_tasks", "swe_tools"]
