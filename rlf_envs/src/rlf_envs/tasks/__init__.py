"""Task sources: lists of Task/dicts, JSONL files, and Search-R1 parquet files (`rlf_envs.tasks.parquet`).

JSONL lines: {"id": str, "question": str, "answers": [str] | "answer": str | "ground_truth": any,
"messages": [{"role", "content"}]?, "meta": {}?}.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rlf_envs.types import Message, Task

TaskSource = Iterable[Task | Mapping[str, Any]] | str | os.PathLike[str]


def task_from_dict(d: Mapping[str, Any], default_id: str = "") -> Task:
    """A Task from a JSON object; raises ValueError naming what is missing."""
    if not isinstance(d, Mapping):
        raise ValueError(f"a task must be a JSON object, got {type(d).__name__}")
    msgs = d.get("messages") or ()
    messages = tuple(Message(str(m["role"]), str(m["content"])) for m in msgs)
    question = d.get("question")
    if question is None:
        users = [m.content for m in messages if m.role == "user"]
        if not users:
            raise ValueError(f"task {d.get('id', default_id)!r} has neither 'question' nor user 'messages'")
        question = users[-1]
    if "ground_truth" in d:
        gt = d["ground_truth"]
    elif "answers" in d:
        gt = list(d["answers"])
    else:
        gt = d.get("answer")
    meta = dict(d.get("meta") or {})
    return Task(id=str(d.get("id", default_id)), question=str(question), ground_truth=gt, messages=messages, meta=meta)


def load_jsonl(path: str | os.PathLike[str]) -> list[Task]:
    p = Path(path)
    tasks: list[Task] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                tasks.append(task_from_dict(obj, default_id=f"{p.stem}-{lineno}"))
            except (json.JSONDecodeError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{p}:{lineno}: bad task line: {e}") from None
    return tasks


def load_tasks(source: TaskSource) -> list[Task]:
    """Tasks from a list (Task or dict), a `.jsonl` file or a Search-R1 `.parquet` file (which no sandboxed run can
    read from then on: `rlf_envs.sandbox.hide_from_runs`)."""
    if isinstance(source, str | os.PathLike):
        p = Path(source)
        if not p.exists():
            raise FileNotFoundError(f"task file {p} does not exist")
        from rlf_envs.sandbox import hide_from_runs

        hide_from_runs(p)  # answers, hidden tests: never readable from a sandboxed run
        if p.suffix == ".parquet":
            from rlf_envs.tasks.parquet import load_search_r1_parquet

            return load_search_r1_parquet(p)
        if p.suffix in (".jsonl", ".json"):
            return load_jsonl(p)
        raise ValueError(f"unsupported task file {p}: use .jsonl or Search-R1 .parquet")
    out: list[Task] = []
    for i, t in enumerate(source):
        out.append(t if isinstance(t, Task) else task_from_dict(t, default_id=str(i)))
    return out


__all__ = ["TaskSource", "load_jsonl", "load_tasks", "task_from_dict"]
