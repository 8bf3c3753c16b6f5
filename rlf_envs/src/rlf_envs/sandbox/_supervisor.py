"""The sandbox supervisor: a trusted, stdlib-only process between the scoring process and untrusted code.

Started by `rlf_envs.sandbox.runner` as `python -I _supervisor.py` in a new session, with a JSON job on
stdin. It applies every containment guard the OS allows, starts the untrusted worker, and writes ONE
result line (prefixed with the job's nonce) to its stdout, which the worker never holds. See the
package docstring (`rlf_envs/sandbox/__init__.py`) for the design and why the verdict cannot be forged.

Do not import the rlf_envs package here: this file runs with a bare interpreter (`python -I -S`: no site-packages
even), and the pool's zygote is a template every run is forked from, which must hold nothing but the stdlib and
this package's stdlib-only modules. Run as a script (or imported as the top-level module `_supervisor`), it makes
`rlf_envs` and `rlf_envs.sandbox` importable as bare namespaces (their `__init__` never runs) so that its siblings
load by their package names. The code is split by concern:

* `_base`: the Linux ABI (libc, namespaces, mounts, prctl), wire constants, `Guards`, the harness's exceptions;
* `_mounts`: namespaces and the run's filesystem (its own root, scratch tmpfs, work dir, hidden data);
* `_seccomp`: the run's seccomp filter and dropped capabilities; `_cgroup`: the run's memory cgroup;
* `_workerproc`: the untrusted worker's set-up, start, in-process run, output capture and whole-tree kill;
* `_harness`: the trusted test harness (`run_tests`); `_run`: one supervised run (`main`);
* `_zygote`: the pool's zygote, its idle supervisors and direct workers.
"""

from __future__ import annotations

import os
import sys
import types

if not __package__:  # a script of a bare interpreter (or the top-level module `_supervisor`): see the docstring
    _here = os.path.dirname(os.path.abspath(__file__))
    for _name, _path in (("rlf_envs", os.path.dirname(_here)), ("rlf_envs.sandbox", _here)):
        if _name not in sys.modules:
            _module = types.ModuleType(_name)
            _module.__path__ = [_path]
            sys.modules[_name] = _module

from rlf_envs.sandbox._base import (
    CONFINED,
    DIRECT,
    DIRECT_READY,
    DIRECT_UNCONFINED,
    PLAIN,
    Guards,
    SolutionError,
)
from rlf_envs.sandbox._cgroup import _probe_cgroup_parent
from rlf_envs.sandbox._harness import SolutionRaised, _test_namespace
from rlf_envs.sandbox._run import main, read_frame
from rlf_envs.sandbox._workerproc import _processes_of_uid, _worker_preexec
from rlf_envs.sandbox._zygote import _direct_child, zygote

__all__ = ["CONFINED", "DIRECT", "DIRECT_READY", "DIRECT_UNCONFINED", "PLAIN", "Guards", "SolutionError",
           "SolutionRaised", "_direct_child", "_probe_cgroup_parent", "_processes_of_uid", "_test_namespace",
           "_worker_preexec", "main", "read_frame", "zygote"]

if __name__ == "__main__":
    if sys.argv[1:2] == ["--zygote"]:
        zygote(int(sys.argv[2]), sys.argv[3], [m for m in sys.argv[4].split(",") if m])
    else:
        main()
