"""Code verifier: judge the answer's code against tests in the sandbox (`rlf_envs.sandbox.run_tests`).

The solution runs in an isolated, resource-limited worker process; the tests run in a separate trusted
supervisor process that calls the solution's functions with plain data and decides each verdict itself,
so nothing inside the solution can read the expected values or forge a pass, and nothing it does reaches
the scoring process. See `rlf_envs/sandbox/__init__.py` for the design and docs/security.md (threat model) for
what is and is not confined.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Literal

from pydantic import Field

from rlf_envs.rewards.common import ConfiguredVerifier, LoopSemaphore
from rlf_envs.rewards.config import BuildContext, VerifierConfig, register_verifier
from rlf_envs.sandbox import SandboxLimits, run_tests
from rlf_envs.types import Score, Task, Trajectory

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
#: guards reported per score as `code/guard/<name>` (1 = in force)
_REPORTED_GUARDS = ("uid", "pid_ns", "net_ns", "nproc", "private_tmp", "minimal_root", "no_keyrings", "user_ns",
                    "fresh_worker", "socket_families", "no_new_namespaces", "memory_cgroup", "disk_quota")


def extract_code(answer: str) -> str:
    """The code in an answer: the last fenced python block if any, else the whole answer."""
    blocks = _FENCE.findall(answer)
    return blocks[-1] if blocks else answer


def _tests_of(value: Any, task_id: str) -> list[str]:
    if isinstance(value, dict) and "tests" in value:
        value = value["tests"]
    if isinstance(value, str) and value.strip():
        return [value]
    if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        return list(value)
    raise ValueError(f"task {task_id!r}: tests must be a non-empty string or list of strings, got {value!r:.200}")


@register_verifier
class CodeConfig(VerifierConfig, SandboxLimits):
    """Run the answer (python; the last ```python block if fenced) against tests: `task.ground_truth`
    (or `task.meta[tests_key]`), a string or list of strings of test code (e.g. asserts) that may use the
    solution's names directly or `from solution import ...`. The value is the fraction of tests passed
    (`partial_credit`) or 1/0 for all-or-nothing. The sandbox fields (`timeout_s`, `cpu_s`, `memory_mb`,
    `file_mb`, `max_output_bytes`, `max_processes`, `namespaces`, `network`, ...) are `SandboxLimits`'."""

    type: Literal["code"] = "code"
    tests_key: str | None = None
    partial_credit: bool = True
    max_concurrency: int = Field(default_factory=lambda: os.cpu_count() or 2, ge=1)
    python: str = Field(sys.executable, description="interpreter for the solution (must be readable by the "
                        "sandbox uid when running as root without namespaces)")
    pool: bool = Field(True, description="run in the process's warm sandbox pool (a fork per run; "
                       "RLF_SANDBOX_POOL=0 turns it off); false: a new supervisor and interpreter per run")

    @property
    def limits(self) -> SandboxLimits:
        return SandboxLimits(**{k: getattr(self, k) for k in SandboxLimits.model_fields})

    def build(self, ctx: BuildContext) -> CodeVerifier:
        return CodeVerifier(self)


class CodeVerifier(ConfiguredVerifier[CodeConfig]):
    """Code judged by tests it cannot touch: the solution runs in the sandbox, the tests in a trusted supervisor
    that decides each verdict (see the module docstring); the score is the fraction of tests passed."""

    config_cls = CodeConfig

    def __init__(self, config: CodeConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._gate = LoopSemaphore(self.cfg.max_concurrency)

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        c = self.cfg
        tests = _tests_of(task.meta.get(c.tests_key) if c.tests_key else task.ground_truth, task.id)
        if trajectory.answer is None or not extract_code(trajectory.answer).strip():
            return self.result(0.0, {"no_answer": 1.0})
        async with self._gate.get():
            out = await run_tests(extract_code(trajectory.answer), tests, c.limits, python=c.python,
                                  pool=None if c.pool else False)
        passed = sum(out.test_results)
        reported = out.error is None and not out.timed_out
        value = passed / len(tests) if c.partial_credit else float(reported and passed == len(tests))
        extra = {
            "passed": passed,
            "total": len(tests),
            "timeout": float(out.timed_out),
            "output_limit": float(out.output_truncated),
            "no_report": float(not reported),
            **{f"guard/{g}": float(g in out.guards) for g in _REPORTED_GUARDS},
        }
        if out.error is not None:
            raise RuntimeError(f"code verifier: {out.error}")
        return self.result(value, extra)
