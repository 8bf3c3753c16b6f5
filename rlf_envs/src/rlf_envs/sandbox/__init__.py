"""Run untrusted Python (policy-written code) without letting it reach the process that scores it.

`run_python(code, stdin, limits, workdir)` runs a script and captures its output (the interpreter tool);
`run_tests(solution, tests, limits)` judges a solution against test code (the code verifier). Each run is a
process tree of its own, forked from a trusted zygote of the warm pool (`SandboxPool`; `pool=False` for a cold
supervisor): namespaces, a per-run uid, a memory cgroup, a tmpfs work dir, seccomp and rlimits, probed at run time
and reported per run (`SandboxResult.guards`). Tests run in the trusted supervisor against proxies of the
solution's names, so the verdict cannot be forged from inside it. The design, each guard, what it does and does
not confine and how it is tested: docs/security-sandbox.md; the threat model: docs/security.md.
"""

from rlf_envs.sandbox.limits import SandboxLimits, SandboxResult
from rlf_envs.sandbox.pool import SandboxPool, default_pool
from rlf_envs.sandbox.runner import SandboxDir, hide_from_runs, run_python, run_tests

__all__ = ["SandboxDir", "SandboxLimits", "SandboxPool", "SandboxResult", "default_pool", "hide_from_runs",
           "run_python", "run_tests"]
