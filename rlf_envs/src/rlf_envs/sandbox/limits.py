"""The sandbox's typed boundary: `SandboxLimits` in, `SandboxResult` out."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field


class SandboxLimits(BaseModel):
    """Limits and isolation switches for one sandboxed run. Every guard is applied only where the OS allows
    it; `SandboxResult.guards` / `.missing_guards` say which were in force and why the others were not."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout_s: float = Field(10.0, gt=0, description="wall-clock deadline for the whole run")
    cpu_s: int = Field(10, ge=1, description="RLIMIT_CPU of the untrusted process")
    memory_mb: int = Field(512, ge=64, description="RLIMIT_AS (address space); python itself needs ~30 MB")
    file_mb: int = Field(16, ge=1, description="RLIMIT_FSIZE: the largest file the code may write")
    max_output_bytes: int = Field(65_536, ge=1024, description="cap on captured stdout and on stderr; the "
                                  "run is killed when exceeded")
    disk_mb: int = Field(64, ge=1, description="size of the work dir (its own tmpfs, as root, where the pool's base "
                         "dir holds it: a run that writes more gets ENOSPC; 1024 inodes per MB); see docs/security.md")
    max_processes: int = Field(64, ge=1, description="RLIMIT_NPROC, enforced through a uid of the run's own "
                               "(as root) or a user namespace; see docs/security.md, 'Threat model: running "
                               "untrusted code'")
    max_open_files: int = Field(64, ge=16, description="RLIMIT_NOFILE")
    namespaces: bool = Field(True, description="use pid/mount/net/ipc/uts namespaces (user namespace when not "
                             "root) where the OS allows")
    network: bool = Field(False, description="allow network access (default: a network namespace with no "
                          "interfaces, where namespaces are available)")
    drop_privileges: bool = Field(True, description="as root, run the code as an unprivileged uid unique to "
                                  "the run")


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """What one sandboxed run produced. `guards` maps each guard in force to how; `missing_guards` maps each
    guard that was not to why (so a run on a laptop without root says what it lacked)."""

    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None  # None: killed at the deadline or for output, or never started
    timed_out: bool = False
    output_truncated: bool = False
    wall_s: float = 0.0
    guards: dict[str, str] = field(default_factory=dict)
    missing_guards: dict[str, str] = field(default_factory=dict)
    error: str | None = None  # the sandbox itself failed (not the code): how to fix it
    test_results: tuple[bool, ...] = ()  # run_tests only: one verdict per test, decided by the supervisor
    test_errors: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """The code ran to completion and exited 0."""
        return self.error is None and self.exit_code == 0
