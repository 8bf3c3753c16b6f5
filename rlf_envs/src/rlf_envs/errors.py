"""The root of rlf's errors (in the spirit of Gymnasium's `gymnasium.error`).

Every error that rlf_envs or rlf_train raises on purpose derives from `RlfError`, so a caller can tell rlf's
own refusals from a bug (`except RlfError`). Each named error is defined beside the code that raises it and
keeps its standard base too (a bad config is still a `ValueError`, a missing extra still an `ImportError`), so
code that caught those keeps working. The families, by where they live:

- config and input: `rlf_train.config.ConfigError`, `rlf_envs.rewards.config.VerifierConfigError`,
  `rlf_envs.records.RecordError`, `rlf_envs.tasks.harbor.HarborError`, `rlf_envs.view.ViewError`,
  `rlf_envs.extras.MissingDependency`, `rlf_train.openrlhf.parser.OpenRLHFFlagError`;
- tools and verifiers: `rlf_envs.tools.base.ToolError` (and `InvalidArguments`), `ToolCrashed`,
  `rlf_envs.tools.schema.Unsupported`, `rlf_envs.rewards.judge.JudgeFailure`,
  `rlf_envs.rewards.group_judge.ContractViolation`, `rlf_envs.rewards.sql.SqlQueryError`;
- retrieval: `rlf_envs.retrieval.types.RetrievalError`, `rlf_envs.retrieval.batcher.BatcherClosed`;
- sandbox sessions: `rlf_envs.sandbox.sessions.types.SessionError` and its subclasses;
- training: `rlf_envs.eval.PolicyError`, `rlf_train.rollout.agent_source.AgentFailed`,
  `rlf_train.rollout.vllm.VllmTimeoutError`, `rlf_train.rollout.endpoint.sessions.EndpointError`.
"""

from __future__ import annotations

__all__ = ["RlfError"]


class RlfError(Exception):
    """An error rlf raises on purpose: the message says what went wrong and how to fix it."""
