"""A Python interpreter tool: each call runs the policy's code in `rlf_envs.sandbox`.

Files persist between calls of one episode (a fresh work dir per episode, removed when the episode ends
or the tool is closed); processes do not (each call's whole process tree is killed when it returns).
The work dir is per-episode state, so give each env its own instance (see docs/guides/own-tools.md,
"Per-episode state"), or
let the env own it: an env that binds a `SandboxDir` as each call's context (`ToolCall.context`, as rlf/Code-v0 does)
shares one instance across all its copies, and the tool then runs in that dir and keeps none of its own.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from rlf_envs.sandbox import SandboxDir, SandboxLimits, SandboxPool, SandboxResult, run_python
from rlf_envs.sandbox.runner import GRACE_S
from rlf_envs.tools.base import InvalidArguments, Tool, ToolError, ToolSpec


class PythonInterpreter(Tool):
    """`python(code, stdin="")` -> the program's stdout, stderr and exit status, as text for the policy."""

    validates_arguments = True  # checked in `call`
    takes_context = True  # an env may bind the episode's SandboxDir to each call

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        name: str = "python",
        max_code_chars: int = 20_000,
        max_output_chars: int = 4_000,
        python: str | None = None,
        max_concurrency: int | None = None,
        pool: SandboxPool | bool = True,
    ) -> None:
        """`pool`: True (the process's warm pool, `rlf_envs.sandbox.default_pool`; off with
        `RLF_SANDBOX_POOL=0`), a `SandboxPool`, or False (a new supervisor and interpreter per call).
        `max_concurrency`: calls in flight at once (default: twice the CPU count with a pool, else the CPU count)."""
        self.limits = limits or SandboxLimits()
        self.pool = pool
        self.max_code_chars = max_code_chars
        self.max_output_chars = max_output_chars
        self.python = python
        # the sandbox's own deadline fires first; the caller's is the backstop
        self.timeout_s = self.limits.timeout_s + GRACE_S + 5.0
        # pooled runs spend part of their wall time waiting on the kernel (forks, namespaces, exits), so twice
        # the CPU count keeps the CPUs busy (Code-v0 at 16 envs: +31% at 2x, +42% at 4x, interleaved, 2 CPUs)
        self.max_concurrency = max_concurrency or (os.cpu_count() or 2) * (2 if pool is not False else 1)
        self._dir: SandboxDir | None = None
        self.spec = ToolSpec(
            name=name,
            description=(
                "Run a Python 3 program and return its stdout and stderr. print() what you want to see. "
                f"Limits: {self.limits.timeout_s:g} s, {self.limits.memory_mb} MB, no network. "
                "Files you write stay available to later calls in this episode."
            ),
            parameters={
                "type": "object",
                "properties": {
                    "code": {"type": "string", "description": "the complete program to run"},
                    "stdin": {"type": "string", "description": "text given to the program on stdin"},
                },
                "required": ["code"],
                "additionalProperties": False,
            },
        )

    @property
    def workdir(self) -> SandboxDir | None:
        """The current episode's work dir (None before the first call of an episode)."""
        return self._dir

    def new_dir(self) -> SandboxDir:
        """A fresh work dir for an episode, where this tool's pool keeps them (removed with the pool)."""
        parent = (self.pool.base_dir if isinstance(self.pool, SandboxPool)
                  else None if self.pool else tempfile.gettempdir())
        return SandboxDir(self.limits.drop_privileges, parent=parent, disk_mb=self.limits.disk_mb)

    def start_episode(self) -> None:
        """Forget the previous episode's files: the next call starts in a fresh, empty work dir."""
        self.end_episode()

    def end_episode(self) -> None:
        """Remove this episode's work dir."""
        if self._dir is not None:
            self._dir.remove()
            self._dir = None

    async def aclose(self) -> None:
        self.end_episode()

    async def call(self, arguments: dict[str, Any], context: Any = None) -> str:
        code, stdin = arguments.get("code"), arguments.get("stdin", "")
        bound = context if isinstance(context, SandboxDir) else None
        extra = sorted(set(arguments) - {"code", "stdin"})
        if extra:
            raise InvalidArguments(f"{self.name}: unknown argument(s) {', '.join(extra)}; "
                                   "it takes `code` and optionally `stdin`")
        if not isinstance(code, str) or not isinstance(stdin, str):
            raise InvalidArguments(f"{self.name}: `code` (and `stdin` if given) must be strings")
        if len(code) > self.max_code_chars:
            raise InvalidArguments(f"{self.name}: code is {len(code)} characters; the limit is {self.max_code_chars}")
        if isinstance(bound, SandboxDir):
            workdir = bound
        else:
            if self._dir is None:
                self._dir = self.new_dir()
            workdir = self._dir
        result = await run_python(code, stdin, self.limits, workdir, python=self.python,
                                  pool=None if self.pool is True else self.pool)
        if result.error is not None:
            raise ToolError(f"{self.name}: the sandbox failed: {result.error}")
        return self.render(result)

    def render(self, r: SandboxResult) -> str:
        half = self.max_output_chars // 2
        parts = []
        for label, text in (("stdout", r.stdout), ("stderr", r.stderr)):
            if text:
                if len(text) > half:
                    text = text[:half] + f"\n[... {len(text) - half} more characters]"
                parts.append(f"[{label}]\n{text.rstrip()}")
        if r.timed_out:
            parts.append(f"[killed: time limit of {self.limits.timeout_s:g} s]")
        elif r.output_truncated:
            parts.append(f"[killed: output over {self.limits.max_output_bytes} bytes]")
        elif r.exit_code != 0:
            parts.append(f"[exit status {r.exit_code}]")
        return "\n".join(parts) if parts else "[no output]"
