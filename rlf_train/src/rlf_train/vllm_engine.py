"""Kept for one release: vLLM as the rollout engine lives in `rlf_train.rollout.vllm`; import it from there."""

from __future__ import annotations

from rlf_train.rollout.vllm import (
    CPU_HEAD_SIZES,
    WORKER_EXTENSION,
    VllmRollout,
    VllmTimeoutError,
    VllmWorkerExtension,
    check_policy_shape,
    engine_client,
    engine_core_processes,
    kill_engine,
    retie_lm_head,
)

__all__ = ["CPU_HEAD_SIZES", "WORKER_EXTENSION", "VllmRollout", "VllmTimeoutError", "VllmWorkerExtension",
           "check_policy_shape", "engine_client", "engine_core_processes", "kill_engine", "retie_lm_head"]
