"""Run untrusted Python (policy-written code) without letting it reach the process that scores it.

Used by the code verifier (`rlf_envs.rewards.code`) and by any interpreter tool. Two entry points:
`run_python(code, stdin, limits, workdir)` runs a script and captures its output; `run_tests(solution,
tests, limits)` judges a solution against test code.

Process tree and why
--------------------
::

    scoring process (trainer) ──stdin: job JSON──▶ supervisor (trusted, stdlib only) ──▶ worker (untrusted)
                              ◀─stdout: 1 result line─┘   new session                  new session, limits

* The **supervisor** (`_supervisor.py`) is a separate interpreter, so nothing the worker does happens in
  the trainer's address space. It makes itself non-dumpable (same-uid processes cannot open its
  `/proc/<pid>/fd`, `mem` or `environ`, nor ptrace it) and a child subreaper (descendants that escape into
  new sessions are re-parented to it, so it can find and kill them). It enters the strongest isolation
  the OS allows, probed at run time, and reports each guard it applied or could not apply:

  - namespaces (as root directly, otherwise inside a new user namespace): the worker is pid 1 of a new pid
    namespace (it sees and can signal no outside process; when it dies the kernel kills everything it
    started), a network namespace with no interface up (no network), a private mount namespace in which the
    worker's root is a minimal one (a read-only tmpfs with read-only binds of /usr, /bin, /lib*, the interpreter's
    directories, a copy of a few /etc files, the usual device nodes; fresh bounded tmpfs /tmp, /var/tmp and
    /dev/shm; the work dir, the only writable host directory): no other host file, directory or Unix socket is
    reachable, and task data registered with `hide_from_runs` is covered even inside what is bound;
    ipc/uts namespaces;
  - as root: the worker runs as an unprivileged uid unique to the run (so it cannot signal, trace or read
    the environment of our processes or write our files, and `RLIMIT_NPROC` bounds its process count,
    which root ignores); `PR_SET_NO_NEW_PRIVS` stops setuid binaries from regaining root;
  - as root: every process of the run in one memory cgroup limited to `memory_mb` in all (`memory_cgroup`; `_cgroup`
    is the one cgroup helper, sessions' too), and
    the work dir a tmpfs of `disk_mb` of its own (`disk_quota`, `quota.py`);
  - always: a seccomp filter -- no kernel keyrings (add_key/request_key/keyctl fail: keys outlive processes and
    are readable across uids), sockets of AF_UNIX/AF_INET/AF_INET6 only (AF_VSOCK is not isolated by the network
    namespace), no io_uring, no new namespaces, bpf, perf_event_open or userfaultfd, no foreign ABI (`_seccomp`: the
    one filter of the sandbox, every session exec gets it too) --, no capabilities (a worker forked in a user
    namespace drops them), a minimal explicit environment, the work dir as cwd/HOME/TMPDIR, rlimits on address space,
    CPU time, file size, open files and core dumps, capped stdout/stderr, a wall-clock deadline, and a
    whole-tree kill at the end (pid namespace, or the subreaper walk plus every process of the run's uid).

* **The verdict cannot be forged from inside the solution.** The tests run in the supervisor, not in the
  solution's interpreter: each top-level name of the solution becomes a proxy, calls send plain data to
  the worker over a pipe and plain data (JSON with type tags, decoded strictly and bounded) comes back.
  Names of builtins and stdlib modules in the tests stay the real ones whatever the solution defines (`abs`,
  `sorted`, `math`: `_harness._test_namespace`).
  So the solution cannot walk frames or `gc` to find expected values (they live in another process),
  cannot rig `builtins`, `sys.exit` or `os._exit` of the harness (exiting only fails the remaining tests),
  and cannot fake a result line: the verdict goes to the trainer on the supervisor's stdout, a pipe the
  worker never inherits (close_fds), cannot reopen (the supervisor is non-dumpable, of another uid or
  outside its pid namespace) and that carries a per-run nonce the worker never sees. An object returned
  with a rigged `__eq__` stays in the worker: comparing it with a plain value is never equal. What the
  solution *can* still decide is the answer to operations on its own objects (e.g. `Stack() == Stack()`).
  A replaced worker stub gains nothing: the most it can do is return a value, which is what a solution does.
  For `run_python`, output is only ever data for the policy, never parsed as a verdict.

The trainer's own side holds a deadline (run deadline + a grace for start-up) and kills the supervisor's
session in `finally`; the worker has `PR_SET_PDEATHSIG`, so it dies with the supervisor.

Warm pool (the default; `pool=False` or `RLF_SANDBOX_POOL=0` for the cold path above): the supervisor is not
a new interpreter but a fork of a trusted zygote that never runs code (`rlf_envs.sandbox.pool`), and the
worker is a fork of the supervisor made before it reads the run's private part (nonce, tests); same guards.
As root, a default `run_python` job (namespaces on, network off) has no supervisor at all: the zygote forks a
**direct worker** as pid 1 of a new pid namespace, which enters its other namespaces while idle, sets itself up
from the job (the same mounts, uid, rlimits) and runs the code; the trainer holds its output pipes (capped),
its deadline and a pidfd (SIGKILL kills the whole namespace), and the zygote reports its wait status. A run
without a private part needs no trusted process between it and the trainer: its guards are reported before
the code runs and its exit status comes from the zygote's `waitpid`. One process per run instead of two.
Whatever a run leaves in its work dir is removed by `cleanup.py` (iterative, by descriptors, fixing modes, bounded,
never raising), off the step path: the dir is renamed away at once and a background reaper deletes it.
What this does and does not confine, and how it is tested: docs/security-sandbox.md; the
whole threat model: docs/security.md ("Threat model: running untrusted code").
"""

from rlf_envs.sandbox.limits import SandboxLimits, SandboxResult
from rlf_envs.sandbox.pool import SandboxPool, default_pool
from rlf_envs.sandbox.runner import SandboxDir, hide_from_runs, run_python, run_tests

__all__ = ["SandboxDir", "SandboxLimits", "SandboxPool", "SandboxResult", "default_pool", "hide_from_runs",
           "run_python", "run_tests"]
