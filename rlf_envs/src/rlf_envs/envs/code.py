"""`rlf/Code-v0`: answer math and data questions by running Python in a sandbox.

Tool: `python(code, stdin="")` (`rlf_envs.tools.interpreter.PythonInterpreter`), one instance shared by every
env of the process with the same limits. Each call runs in `rlf_envs.sandbox` (its own process tree, killed
when the call returns; CPU-time, memory, process-count, file-size, output and wall-clock limits; a minimal
environment with none of ours; no network where the OS allows a network namespace). Files persist between
the calls of one episode: the env owns a fresh work dir per episode (created at the first call, with the
task's data files in it), binds it to each call where no JSON argument can forge it, and removes it when the
episode is scored, at the next reset (finished or not) and on close (`ToolEnv.end_episode`).

Reward (`CodeTaskVerifier`), by each task's `meta["check"]`: "numeric" (the answer's number equals the gold
one: `rewards.rules.NumericMatch`), "exact" (`rewards.rules.ExactMatch`) or "tests" (the answer's code passes
the hidden tests in `ground_truth`: `rewards.code.CodeVerifier`, in the same sandbox).

Data: the shipped generated tasks (`rlf_envs.data.code`), or your own (`tasks=`: Tasks/dicts/JSONL with
`meta.check` and optionally `meta.files`, `{name: text}` put in the work dir).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import replace
from pathlib import PurePosixPath
from typing import Any

from rlf_envs.env.tool_env import PendingStep, ToolEnv
from rlf_envs.rewards.base import Verifier
from rlf_envs.rewards.code import CodeConfig, CodeVerifier
from rlf_envs.rewards.rules import ExactMatch, NumericMatch
from rlf_envs.sandbox import SandboxDir, SandboxLimits, SandboxPool
from rlf_envs.tasks import load_tasks
from rlf_envs.tools.interpreter import PythonInterpreter
from rlf_envs.types import Score, Task, ToolCall, Trajectory

SYSTEM_PROMPT = (
    "You solve problems by running Python with the python tool: print() what you need to see. Then give the "
    "final answer inside <answer></answer> (a number or a name; for a function, its code)."
)
CHECKS = ("numeric", "exact", "tests")
#: limits for the policy's code: small, since a policy runs many calls at once
DEFAULT_LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=5, memory_mb=256, file_mb=4, max_output_bytes=16_384,
                               max_processes=16)

_TOOLS: dict[tuple[SandboxLimits, int, SandboxPool | bool], PythonInterpreter] = {}
_LOCK = threading.Lock()


def python_tool(limits: SandboxLimits = DEFAULT_LIMITS, max_output_chars: int = 2_000,
                pool: SandboxPool | bool = True) -> PythonInterpreter:
    """The process-wide interpreter tool for these limits (envs share it, and so one Toolbox)."""
    key = (limits, max_output_chars, pool)
    with _LOCK:
        if key not in _TOOLS:
            _TOOLS[key] = PythonInterpreter(limits, max_output_chars=max_output_chars, pool=pool)
        return _TOOLS[key]


class CodeTaskVerifier(Verifier):
    """Scores each task by its `meta["check"]`: numeric / exact answer match, or hidden tests."""

    name = "code_task"

    def __init__(self, limits: SandboxLimits = DEFAULT_LIMITS, abs_tol: float = 1e-6, rel_tol: float = 1e-6,
                 pool: bool = True) -> None:
        self.by_check: dict[str, Verifier] = {
            "numeric": NumericMatch(abs_tol=abs_tol, rel_tol=rel_tol),
            "exact": ExactMatch(),
            "tests": CodeVerifier(CodeConfig(**limits.model_dump(), partial_credit=False, pool=pool)),
        }

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        check = task.meta.get("check", "numeric")
        verifier = self.by_check.get(str(check))
        if verifier is None:
            raise ValueError(f"task {task.id!r}: meta['check'] must be one of {CHECKS}, got {check!r}")
        score = await verifier.score(trajectory, task)
        return replace(score, info={**score.info, f"check/{check}": 1.0})


def _check_task(t: Task) -> None:
    check = t.meta.get("check", "numeric")
    if check not in CHECKS:
        raise ValueError(f"task {t.id!r}: meta['check'] must be one of {CHECKS}, got {check!r}")
    files = t.meta.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise ValueError(f"task {t.id!r}: meta['files'] must map file names to text")
    for name in files:
        p = PurePosixPath(name)
        if len(p.parts) != 1 or name in (".", "..") or name.startswith(".rlf"):
            raise ValueError(f"task {t.id!r}: meta['files'] name {name!r} must be a plain file name")


_SHIPPED: dict[str, tuple[Task, ...]] = {}


def code_tasks(split: str = "train") -> list[Task]:
    """The shipped tasks of `split` ("train" or "test")."""
    from rlf_envs.data.code import split_path

    with _LOCK:
        if split not in _SHIPPED:
            _SHIPPED[split] = tuple(load_tasks(split_path(split)))
        return list(_SHIPPED[split])


class CodeEnv(ToolEnv):
    """Math and data questions with a sandboxed Python tool.

    Args:
        split: "train" or "test" of the shipped tasks (ignored when `tasks` is given).
        limits: the sandbox limits of each tool call (a SandboxLimits or its dict); also used by the hidden
            tests of "tests" tasks.
        max_output_chars: stdout+stderr shown to the policy per call (the rest is cut with a marker).
        pool: True (default): calls and hidden tests run in the process's warm sandbox pool (a fork per call,
            `rlf_envs.sandbox.pool`; `RLF_SANDBOX_POOL=0` turns it off); False: a new supervisor and
            interpreter per call (the cold path, slower, same guards).
        format: "qwen3" / "hermes" (JSON tool calls) or a Format instance.
        **kwargs: ToolEnv's (tasks, verifier, max_turns, tokenizer, system_prompt, extra tools...).
    """

    def __init__(
        self,
        split: str = "train",
        limits: SandboxLimits | dict[str, Any] | None = None,
        max_output_chars: int = 2_000,
        format: Any = "qwen3",
        pool: bool = True,
        **kwargs: Any,
    ) -> None:
        lim = SandboxLimits.model_validate(limits) if isinstance(limits, dict) else (limits or DEFAULT_LIMITS)
        if max_output_chars < 100:
            raise ValueError("max_output_chars must be >= 100")
        if kwargs.get("tasks") is None:
            kwargs["tasks"] = code_tasks(split)
        self._python = python_tool(lim, max_output_chars, bool(pool))
        kwargs.setdefault("verifier", CodeTaskVerifier(lim, pool=bool(pool)))
        kwargs.setdefault("system_prompt", SYSTEM_PROMPT)
        self._workdir: SandboxDir | None = None
        self._remove_workdir: weakref.finalize | None = None  # type: ignore[type-arg]
        super().__init__(tools=[self._python, *kwargs.pop("tools", ())], format=format, **kwargs)
        for t in self.tasks:
            _check_task(t)

    @property
    def workdir(self) -> SandboxDir | None:
        """This episode's work dir (None before its first python call and after the episode)."""
        return self._workdir

    def _episode_dir(self) -> SandboxDir:
        if self._workdir is None:
            d = self._python.new_dir()
            # removed at episode end; the finalizer also covers an env dropped without close()
            self._remove_workdir = weakref.finalize(self, d.remove)
            self._workdir = d
            files = self.trajectory.task.meta.get("files") or {}
            assert isinstance(files, dict)
            for name, text in files.items():
                d.write(name, str(text))
        return self._workdir

    def bind_calls(self, step: PendingStep) -> Sequence[ToolCall]:
        """The policy's calls, python bound to this episode's work dir (whatever arguments it sent)."""
        calls = step.turn.action.calls
        if not any(c.name == self._python.name for c in calls):
            return calls
        d = self._episode_dir()
        return [replace(c, context=d) if c.name == self._python.name else c for c in calls]

    def end_episode(self) -> None:
        if self._remove_workdir is not None:
            self._remove_workdir()  # runs d.remove() once
        self._workdir = self._remove_workdir = None
