"""Search-R1 parquet files (NQ, HotpotQA, ... as produced by Search-R1's `data_process/*.py`) as Tasks.

Schema: `data_source` (str), `prompt` (list of {"role", "content"}), `ability` (str),
`reward_model` ({"style", "ground_truth": {"target": [str]}}), `extra_info` ({"split", "index"});
the original `id` / `question` / `golden_answers` columns are used when present.
Needs pyarrow (`pip install -e './rlf_envs[parquet]'`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlf_envs.extras import require
from rlf_envs.types import Message, Task

REQUIRED_COLUMNS = ("prompt", "reward_model")


def _targets(reward_model: Any, where: str) -> list[str]:
    if not isinstance(reward_model, Mapping):
        raise ValueError(f"{where}: 'reward_model' must be a struct with 'ground_truth', got {reward_model!r}")
    gt = reward_model.get("ground_truth")
    target = gt.get("target") if isinstance(gt, Mapping) else gt
    if target is None:
        raise ValueError(f"{where}: 'reward_model.ground_truth.target' is missing")
    if isinstance(target, str | int | float):
        return [str(target)]
    if isinstance(target, list | tuple):
        return [str(t) for t in target]
    raise ValueError(f"{where}: 'reward_model.ground_truth.target' must be a string or a list, got {target!r}")


def _messages(prompt: Any, where: str) -> tuple[Message, ...]:
    if not isinstance(prompt, list | tuple) or not prompt:
        raise ValueError(f"{where}: 'prompt' must be a non-empty list of chat messages, got {prompt!r}")
    out = []
    for j, m in enumerate(prompt):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: prompt[{j}] must have string 'role' and 'content', got {m!r}")
        out.append(Message(m["role"], m["content"]))
    return tuple(out)


def row_to_task(row: Mapping[str, Any], default_id: str, where: str) -> Task:
    """One Search-R1 row (as a dict) to a Task; errors name the row and the field."""
    messages = _messages(row.get("prompt"), where)
    users = [m.content for m in messages if m.role == "user"]
    if not users:
        raise ValueError(f"{where}: 'prompt' holds no user message")
    extra = row.get("extra_info")
    extra = dict(extra) if isinstance(extra, Mapping) else {}
    meta: dict[str, Any] = {
        "data_source": row.get("data_source"),
        "ability": row.get("ability"),
        "extra_info": extra,
    }
    if isinstance(row.get("question"), str):
        meta["raw_question"] = row["question"]
    if isinstance(row.get("reward_model"), Mapping) and row["reward_model"].get("style") is not None:
        meta["reward_style"] = row["reward_model"]["style"]
    task_id = row.get("id")
    if task_id is None:
        src, split, index = row.get("data_source") or "", extra.get("split"), extra.get("index")
        task_id = f"{src}-{split}-{index}" if index is not None else default_id
    return Task(
        id=str(task_id),
        question=users[-1],
        ground_truth={"target": _targets(row.get("reward_model"), where)},
        messages=messages,
        meta=meta,
    )


def load_search_r1_parquet(path: str | os.PathLike[str], limit: int | None = None) -> list[Task]:
    """All rows (or the first `limit`) of a Search-R1 parquet file as Tasks."""
    pq = require("pyarrow.parquet", "reading parquet")
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"parquet file {p} does not exist")
    try:
        pf = pq.ParquetFile(p)
    except Exception as e:
        raise ValueError(f"{p} is not a readable parquet file: {e}") from e
    names = set(pf.schema_arrow.names)
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise ValueError(
            f"{p} lacks the Search-R1 column(s) {missing}; found {sorted(names)}. Expected data_source, prompt, "
            "ability, reward_model{ground_truth{target}}, extra_info"
        )
    tasks: list[Task] = []
    row_no = 0
    for batch in pf.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            tasks.append(row_to_task(row, default_id=f"{p.stem}-{row_no}", where=f"{p} row {row_no}"))
            row_no += 1
            if limit is not None and row_no >= limit:
                return tasks
    return tasks


__all__ = ["load_search_r1_parquet", "row_to_task"]
