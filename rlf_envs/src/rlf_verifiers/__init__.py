"""`vf-eval rlf_verifiers ...`: the verifiers taskset id of rlf envs (see rlf_envs.adapters.verifiers).

verifiers imports a taskset by a dot-free module name and takes the Taskset and Harness it exports in
`__all__`; this module only re-exports them.
"""

from rlf_envs.adapters.verifiers import RlfHarness, RlfHarnessConfig, RlfTask, RlfTaskset, RlfTasksetConfig

__all__ = ["RlfHarness", "RlfHarnessConfig", "RlfTask", "RlfTaskset", "RlfTasksetConfig"]
