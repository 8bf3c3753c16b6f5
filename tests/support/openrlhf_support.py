"""Shared pieces of the backend-openrlhf tests (tox -e openrlhf): a config for the offline search env, the
tiny policy and its tokenizer, the scripted search policy, and importing OpenRLHF modules that import vLLM.

OpenRLHF's rollout modules import vLLM at module level, and vLLM has no CPU build. `openrlhf_modules()`
registers a minimal `vllm` module (only the names those modules import: `SamplingParams`,
`inputs.TokensPrompt`, `utils.random_uuid`) when vLLM is not installed, then imports OpenRLHF's real
`vllm_engine` (its agent loader) and `samples_generator` (its response -> Experience conversion).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
import uuid
from pathlib import Path
from typing import Any

from rlf_train.config import TrainConfig, config_from_dict
from rlf_train.openrlhf import standin

ROOT = Path(__file__).resolve().parents[2]


def openrlhf_modules() -> tuple[Any, Any]:
    """(openrlhf.trainer.ray.vllm_engine, openrlhf.trainer.ppo_utils.samples_generator)."""
    if "vllm" not in sys.modules and importlib.util.find_spec("vllm") is None:
        vllm = types.ModuleType("vllm")
        vllm.__version__ = "0.29.0"  # type: ignore[attr-defined]
        vllm.SamplingParams = standin.SamplingParams  # type: ignore[attr-defined]
        inputs = types.ModuleType("vllm.inputs")
        inputs.TokensPrompt = dict  # type: ignore[attr-defined]
        utils = types.ModuleType("vllm.utils")
        utils.random_uuid = lambda: uuid.uuid4().hex  # type: ignore[attr-defined]
        vllm.inputs, vllm.utils = inputs, utils  # type: ignore[attr-defined]
        sys.modules.update({"vllm": vllm, "vllm.inputs": inputs, "vllm.utils": utils})
    from openrlhf.trainer.ppo_utils import samples_generator
    from openrlhf.trainer.ray import vllm_engine

    return vllm_engine, samples_generator


def search_config(index_dir: Path, run_dir: Path, **overrides: Any) -> TrainConfig:
    """Search-v0 (shipped invented world, in-process BM25, Search-R1 tags) with the offline tiny policy."""
    data: dict[str, Any] = {
        "name": "orl-test", "backend": "openrlhf",
        "model": {"name_or_path": "tiny"},
        "env": {"id": "rlf/Search-v0", "kwargs": {"format": "search_r1", "index_dir": str(index_dir), "topk": 1}},
        "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2, "max_turns": 3, "max_new_tokens_per_turn": 16,
                    "max_total_tokens": 512, "max_obs_tokens": 64},
        "algorithm": {"steps": 2, "micro_batch_size": 2},
        "eval": {"num_tasks": 4, "greedy": True, "sampled": False, "before_rl": False},
        "logging": {"run_dir": str(run_dir), "tensorboard": False},
        "openrlhf": {"gpus_per_node": 1, "vllm_engines": 1, "packing_samples": False, "attn_implementation": "sdpa"},
    }
    for key, value in overrides.items():
        node = data
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return config_from_dict(data)


def scripted_search_policy(tasks: list[Any]) -> Any:
    """Search the task's entity, then answer with the gold answer (after reading the results)."""
    by_question = {t.question.strip(): t for t in tasks}

    def policy(context: str) -> str:
        task = next((t for q, t in by_question.items() if q in context), None)
        if task is None:
            return "<answer> no idea</answer>"
        if not context.rstrip().endswith("</information>"):  # (the instruction itself names the tags)
            return f"<search> {task.meta.get('entity', task.question)}</search> and then more text"
        return f"<answer> {task.gold_answers[0]}</answer>"

    return policy


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
