"""Helpers for the foreign-environment tests (`rollout.environment`, tests/adapters*/test_foreign_*.py): a small
trainer config, a trainer whose rows and rewards each update are kept, a scripted policy installed as the engine (so
a test knows what the policy says), and the check that nothing a run started is left running."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
from repo_paths import SUPPORT

P, G = 2, 2


def foreign_cfg(run_dir: Path, spec: str, *extra: str, steps: int = 2, tokenizer: str | None = None) -> Any:
    from rlf_train.config import load_config

    tiny = "{hidden_size: 32, num_layers: 1, num_heads: 4, num_kv_heads: 2, intermediate_size: 64" + (
        f", tokenizer_file: {tokenizer}" if tokenizer else "") + "}"
    return load_config(None, [
        f"rollout.environment={spec}", f"model.tiny={tiny}",
        f"logging.run_dir={run_dir}", "logging.progress=false", "logging.tensorboard=false", "threads=1",
        f"rollout.prompts_per_step={P}", f"rollout.samples_per_prompt={G}", "rollout.max_new_tokens_per_turn=24",
        "rollout.max_total_tokens=768", "rollout.max_turns=3", "sft.enabled=false", f"algorithm.steps={steps}",
        "eval.num_tasks=2", "eval.sampled=false", "logging.trajectories_every=1", "seed=1", *extra,
    ])


@contextmanager
def foreign_process_env() -> Iterator[None]:
    """What a foreign env's own processes need here: this checkout's test envs importable (verifiers starts its tool
    servers as `python -m <module>`) and the venv's `bin` on PATH (uv, for verifiers' chat program)."""
    old = {k: os.environ.get(k) for k in ("PYTHONPATH", "PATH")}
    os.environ["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), *filter(None, [old["PYTHONPATH"]])])
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), old["PATH"] or ""])
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def keep_updates(tr: Any, monkeypatch: Any) -> list[dict[str, Any]]:
    """Every update's rows, task indices and episodes (`Rollouts`), as the learner got them."""
    seen: list[dict[str, Any]] = []
    orig = tr.update

    def update(step: int, trajs: Any, task_indices: Any, *a: Any, **k: Any) -> Any:
        seen.append({"trajs": list(trajs), "tasks": list(task_indices), "episodes": k.get("episodes")})
        return orig(step, trajs, task_indices, *a, **k)

    monkeypatch.setattr(tr, "update", update)
    return seen


def script_policy(tr: Any, monkeypatch: Any, script: Callable[[str], str]) -> Any:
    """The trainer's engines (the sync one, the async worker's) replaced by a scripted one (`script(context text) ->
    reply text`), calls recorded."""
    from agent_support import ScriptedEngine

    engine = ScriptedEngine(tr.tokenizer, script)
    monkeypatch.setattr(tr.source.engine, "generate_batch", lambda *a, **k: engine)
    # rollout.mode: async: the agent worker's engine (its own copy of the policy) too
    monkeypatch.setattr("rlf_train.rollout.agent_source.local_generate_batch", lambda *a, **k: engine)
    return engine


QUESTION = re.compile(r"What is the (\w+) of (\w+)\?")
FACT = re.compile(r"(\w+): (\w+) (\w+)\.")


def search_oracle(right: Callable[[str], bool], fmt: str = "qwen3") -> Callable[[str], str]:
    """A policy for the quickstart's search task: searches the question's entity, then answers with the document's
    value when `right(entity)`, else with a wrong one."""

    def script(ctx: str) -> str:
        q = QUESTION.findall(ctx)
        entity = q[-1][1] if q else "nobody"
        fact = FACT.findall(ctx.split("Doc 1(Title:")[-1]) if "Doc 1(Title:" in ctx else []
        if not fact:
            if fmt == "search_r1":
                return f"<search>{entity}</search>"
            return ('<tool_call>\n' + json.dumps({"name": "search", "arguments": {"query": entity}}) +
                    '\n</tool_call><|im_end|>')
        value = fact[-1][2] if right(entity) else "nothing"
        return f"<answer>{value}</answer>" + ("" if fmt == "search_r1" else "<|im_end|>")

    return script


def leftover_children() -> list[str]:
    """Child processes of this test process that are still alive (the sandbox's warm pools excepted)."""
    from procs_support import sandbox_pool_pids, session_pool_pids

    keep = sandbox_pool_pids() | session_pool_pids()
    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.pid not in keep and c.status() != psutil.STATUS_ZOMBIE:
                out.append(" ".join(c.cmdline())[:200])
        except psutil.NoSuchProcess:
            continue
    return out


def records(run_dir: Path, step: int) -> list[dict[str, Any]]:
    path = run_dir / "trajectories" / f"step_{step}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
