"""Code verifier: run the answer against tests in a sandboxed `python -I` subprocess.

Limits: RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE, no core dumps, optional
RLIMIT_NPROC; a wall-clock deadline after which the whole process group is killed (always, in
`finally`, so forked children die too); a cap on captured output; a fresh temp dir as cwd and HOME;
a minimal environment (no secrets from ours). Results come back on the original stdout fd tagged
with a per-run nonce, so a solution that prints "passed" or exits early does not pass.

This is resource isolation, not a security sandbox: untrusted code still runs as our user. Run
training jobs in a container if the policy might be adversarial.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from rlf_envs.rewards.common import ConfiguredVerifier, LoopSemaphore
from rlf_envs.rewards.config import BuildContext, VerifierConfig, register_verifier
from rlf_envs.types import Score, Task, Trajectory

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

_HARNESS = r'''
import json, os, sys
def _run():
    token = sys.stdin.readline().strip()
    out = os.dup(1)
    with open("payload.json", encoding="utf-8") as f:
        payload = json.load(f)
    os.remove("payload.json")
    sys.path.insert(0, os.getcwd())
    ns = {"__name__": "solution"}
    results = []
    try:
        exec(compile(payload["solution"], "solution.py", "exec"), ns)
        loaded = True
    except BaseException as e:  # noqa
        print(f"solution failed to load: {type(e).__name__}: {e}", file=sys.stderr)
        loaded = False
    for i, test in enumerate(payload["tests"]):
        if not loaded:
            results.append(False)
            continue
        try:
            exec(compile(test, f"test_{i}.py", "exec"), ns)
            results.append(True)
        except BaseException as e:  # noqa
            print(f"test {i} failed: {type(e).__name__}: {e}", file=sys.stderr)
            results.append(False)
    os.write(out, ("\n" + token + " " + json.dumps(results) + "\n").encode())
_run()
'''


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


@dataclass(slots=True)
class RunOutcome:
    """What one sandboxed run produced."""

    results: list[bool] = field(default_factory=list)
    reported: bool = False  # the harness wrote its result line
    timed_out: bool = False
    output_limit: bool = False
    returncode: int | None = None
    stderr_tail: str = ""


def _limits(memory_mb: int, cpu_s: int, file_mb: int, max_processes: int | None) -> Any:
    def apply() -> None:
        import resource

        mem = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb * 1024 * 1024,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        if max_processes is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (max_processes, max_processes))

    return apply


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def _read_capped(stream: asyncio.StreamReader, cap: int, on_overflow: Any) -> bytes:
    buf = bytearray()
    while chunk := await stream.read(65536):
        if len(buf) < cap:
            buf += chunk[: cap - len(buf)]
        else:
            on_overflow()
            break
    return bytes(buf)


async def _exited(proc: asyncio.subprocess.Process) -> int:
    """Wait for the process itself to exit. (`proc.wait()` also waits for its pipes to close, which a
    forked grandchild can hold open indefinitely.)"""
    delay = 0.001
    while proc.returncode is None:
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.02)
    return proc.returncode


async def run_sandboxed(
    solution: str,
    tests: list[str],
    *,
    python: str = sys.executable,
    timeout_s: float = 10.0,
    cpu_s: int = 10,
    memory_mb: int = 512,
    file_mb: int = 16,
    max_output_bytes: int = 65_536,
    max_processes: int | None = None,
) -> RunOutcome:
    """Run `solution` then each test (in the solution's namespace) in a limited subprocess."""
    token = secrets.token_hex(16)
    outcome = RunOutcome()
    with tempfile.TemporaryDirectory(prefix="rlf_code_", ignore_cleanup_errors=True) as tmp:
        with open(os.path.join(tmp, "payload.json"), "w", encoding="utf-8") as f:
            json.dump({"solution": solution, "tests": tests}, f)
        with open(os.path.join(tmp, "harness.py"), "w", encoding="utf-8") as f:
            f.write(_HARNESS)
        with open(os.path.join(tmp, "solution.py"), "w", encoding="utf-8") as f:
            f.write(solution)  # so tests may also `from solution import ...`
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        proc = await asyncio.create_subprocess_exec(
            python, "-I", "harness.py",
            cwd=tmp, env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True,
            preexec_fn=_limits(memory_mb, cpu_s, file_mb, max_processes),
        )
        readers: list[asyncio.Task[bytes]] = []
        out, err = b"", b""
        try:
            def overflow() -> None:
                outcome.output_limit = True
                _kill_group(proc.pid)

            assert proc.stdin and proc.stdout and proc.stderr
            readers = [
                asyncio.ensure_future(_read_capped(proc.stdout, max_output_bytes, overflow)),
                asyncio.ensure_future(_read_capped(proc.stderr, max_output_bytes, overflow)),
            ]
            proc.stdin.write(f"{token}\n".encode())
            try:
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass
            try:
                async with asyncio.timeout(timeout_s):
                    outcome.returncode = await _exited(proc)
            except TimeoutError:
                outcome.timed_out = True
        finally:
            # Kill the whole group: this also ends anything the solution forked, which would otherwise
            # keep our pipes open. Then drain what is left in the pipes (bounded).
            _kill_group(proc.pid)
            try:
                async with asyncio.timeout(2):
                    await _exited(proc)
                    if readers:
                        out, err = await asyncio.gather(*readers)
            except TimeoutError:
                pass
            finally:
                for r in readers:
                    r.cancel()
    outcome.stderr_tail = err[-2000:].decode(errors="replace")
    for line in reversed(out.decode(errors="replace").splitlines()):
        if line.startswith(token + " "):
            try:
                res = json.loads(line[len(token) + 1 :])
            except json.JSONDecodeError:
                break
            if isinstance(res, list) and len(res) == len(tests):
                outcome.results = [bool(r) for r in res]
                outcome.reported = True
            break
    return outcome


@register_verifier
class CodeConfig(VerifierConfig):
    """Run the answer (python; the last ```python block if fenced) against tests: `task.ground_truth`
    (or `task.meta[tests_key]`), a string or list of strings of test code (e.g. asserts). The value is
    the fraction of tests passed (`partial_credit`) or 1/0 for all-or-nothing."""

    type: Literal["code"] = "code"
    tests_key: str | None = None
    partial_credit: bool = True
    timeout_s: float = Field(10.0, gt=0, description="wall-clock deadline for the whole run")
    cpu_s: int = Field(10, ge=1)
    memory_mb: int = Field(512, ge=64, description="RLIMIT_AS; python itself needs ~30 MB")
    file_mb: int = Field(16, ge=1)
    max_output_bytes: int = Field(65_536, ge=1024)
    max_processes: int | None = Field(None, ge=1, description="RLIMIT_NPROC (per user; no effect for root)")
    max_concurrency: int = Field(default_factory=lambda: os.cpu_count() or 2, ge=1)
    python: str = sys.executable

    def build(self, ctx: BuildContext) -> CodeVerifier:
        return CodeVerifier(self)


class CodeVerifier(ConfiguredVerifier[CodeConfig]):
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
            out = await run_sandboxed(
                extract_code(trajectory.answer), tests, python=c.python, timeout_s=c.timeout_s, cpu_s=c.cpu_s,
                memory_mb=c.memory_mb, file_mb=c.file_mb, max_output_bytes=c.max_output_bytes,
                max_processes=c.max_processes,
            )
        passed = sum(out.results)
        value = passed / len(tests) if c.partial_credit else float(out.reported and passed == len(tests))
        extra = {
            "passed": passed,
            "total": len(tests),
            "timeout": float(out.timed_out),
            "output_limit": float(out.output_limit),
            "no_report": float(not out.reported),
        }
        return self.result(value, extra)

