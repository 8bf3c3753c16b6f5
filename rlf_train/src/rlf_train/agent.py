"""Kept for one release: agent code is run by `rlf_train.rollout.agent_runner` (`AgentResult`, `AgentRunner`,
`load_agent`) and trained through `rlf_train.rollout.agent_source` (`AgentSource`, `AgentWorker`); import them from
there."""

from __future__ import annotations

from rlf_train.rollout.agent_runner import (
    BLOCKED_S,
    NO_TOOL_MESSAGE,
    AgentEpisodes,
    AgentFn,
    AgentLoop,
    AgentResult,
    AgentRunner,
    AgentStats,
    load_agent,
)
from rlf_train.rollout.agent_source import AgentFailed, AgentSource, AgentWorker, run_on_rlf_loop

__all__ = ["BLOCKED_S", "NO_TOOL_MESSAGE", "AgentEpisodes", "AgentFailed", "AgentFn", "AgentLoop", "AgentResult",
           "AgentRunner", "AgentSource", "AgentStats", "AgentWorker", "load_agent", "run_on_rlf_loop"]
