"""The file OpenRLHF loads with `--train.agent_func_path` (by path, in every vLLM rollout actor).

OpenRLHF requires a module-level `AgentExecutor`: a subclass of `openrlhf.utils.agent.AgentExecutorBase`
that it builds with no arguments. rlf's lives in `rlf_train.openrlhf.executor` (rlf-train must be installed
on every Ray node); the run's config comes from the environment the launcher sets for the Ray job.
"""

from rlf_train.openrlhf.executor import RlfAgentExecutor as AgentExecutor

__all__ = ["AgentExecutor"]
