"""Supervised warm start: scripted (deliberately imperfect) demonstrations run through the real env in
token mode, then cross-entropy on the policy tokens (loss_mask = 1) only.

The scripted demonstrator for search-style envs: with probability `p_no_search` it answers at once
with a guess (another task's answer, of the same `meta.relation` when tasks name one); with
`p_wrong_query` it searches for another task's subject and answers what that search would support;
otherwise it searches for the task's subject and answers correctly. Imitation alone therefore plateaus
well below what always searching reaches; GRPO has to discover that searching (with the right query)
is what earns reward.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlf_envs.types import Task, Trajectory
from rlf_train.config import ConfigError


@dataclass(frozen=True)
class Demo:
    """One warm-start demonstration: a train task and the policy turns to replay on it."""

    task_index: int
    actions: tuple[str, ...]  # policy turns as text, in order
    kind: str = "scripted"


def task_subject(task: Task) -> str:
    """What to search for: the task's subject entity when the task names one, else its question."""
    for key in ("entity", "subject", "query"):
        v = task.meta.get(key) if task.meta else None
        if isinstance(v, str) and v.strip():
            return v.strip()
    return task.question.strip()


def _tag(fmt_name: str, kind: str, text: str) -> str:
    if fmt_name == "qwen3":
        if kind == "search":
            return '<tool_call>{"name": "search", "arguments": {"query": ' + json.dumps(text) + "}}</tool_call>"
        return f"<answer> {text}</answer>"
    return f"<{kind}> {text}</{kind}>"


def check_scripted_demos(env: Any, env_id: str) -> None:
    """The scripted demos (no `sft.demos_path`) search then answer: they fit an env whose policy has a `search` tool
    and tasks with gold answers (rlf/Search-v0 and its kind), or an env without tools (answers only). In an env with
    other tools (rlf/SWE-v0, SQL, Code...) they would replay the search world's turns through the env's real tools:
    refused, saying what to do."""
    toolbox = getattr(env, "toolbox", None)
    names = {s.name for s in getattr(toolbox, "specs", ())} if toolbox is not None else set()
    if names and "search" not in names:
        raise ConfigError(f"sft.enabled: {env_id} has no `search` tool, and the scripted demos (used when "
                          "sft.demos_path is not set) search then answer; give sft.demos_path (a JSONL of "
                          '{"task_index": i, "actions": [turn, ...]} per line, the turns to replay on train task i; '
                          "rlf/SWE-v0: `python -m rlf_envs.envs.swe.baseline --split train --write-demos FILE`) "
                          "or set sft.enabled: false")


def scripted_demos(tasks: Sequence[Task], n: int, fmt_name: str, p_no_search: float, p_wrong_query: float,
                   seed: int) -> list[Demo]:
    """`n` demonstrations on tasks drawn uniformly (seeded)."""
    if len(tasks) < 2:
        raise ValueError("scripted demos need at least 2 tasks (guesses use other tasks' answers)")
    rng = random.Random(seed)
    # multi-hop tasks need a bridge entity the script does not know: demonstrate on single-hop ones
    pool = [k for k, t in enumerate(tasks) if int((t.meta or {}).get("hops", 1)) <= 1] or list(range(len(tasks)))
    demos = []
    for _ in range(n):
        i = pool[rng.randrange(len(pool))]
        task = tasks[i]
        gold = task.gold_answers[0] if task.gold_answers else ""
        j = rng.randrange(len(tasks) - 1)
        j = j + 1 if j >= i else j
        rel = (task.meta or {}).get("relation")
        if rel is not None:  # a plausible guess: another answer to the same relation, when tasks name one
            for _ in range(20):  # (if 20 draws miss, the last draw is kept: still a guess)
                if (tasks[j].meta or {}).get("relation") == rel and j != i:
                    break
                j = rng.randrange(len(tasks))
        other = tasks[j]
        other_gold = other.gold_answers[0] if other.gold_answers else ""
        u = rng.random()
        if u < p_no_search:
            acts = (_tag(fmt_name, "answer", other_gold),)
            kind = "no_search"
        elif u < p_no_search + p_wrong_query:
            acts = (_tag(fmt_name, "search", task_subject(other)), _tag(fmt_name, "answer", other_gold))
            kind = "wrong_query"
        else:
            acts = (_tag(fmt_name, "search", task_subject(task)), _tag(fmt_name, "answer", gold))
            kind = "correct"
        demos.append(Demo(i, acts, kind))
    return demos


def load_demos(path: str | Path) -> list[Demo]:
    """JSONL: one {"task_index": int, "actions": [str, ...]} per line. Problems are ConfigErrors naming
    sft.demos_path."""
    from rlf_train.config import ConfigError

    fix = "point sft.demos_path to a JSONL of {task_index, actions}, or remove it to use scripted demos"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"sft.demos_path: no such file: {path}; {fix}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"sft.demos_path: cannot read {path} ({e}); {fix}") from None
    demos = []
    for ln, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            acts = rec["actions"]
            if not isinstance(acts, list) or not all(isinstance(a, str) for a in acts):
                raise TypeError("actions must be a list of strings")
            demos.append(Demo(int(rec["task_index"]), tuple(acts), "file"))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"sft.demos_path {path}:{ln}: a demo needs task_index (int) and actions (list of "
                              f"str): {type(e).__name__}: {e}") from None
    if not demos:
        raise ConfigError(f"sft.demos_path {path}: no demonstrations in the file; {fix}")
    return demos


async def demo_trajectories(env: Any, demos: Sequence[Demo], tokenizer: Any) -> list[Trajectory]:
    """Replay each demo's text turns through the env (token mode): exact ids + loss mask from the env."""
    out = []
    for d in demos:
        await env.areset(seed=0, options={"task_index": d.task_index})
        for a in d.actions:
            ids = tokenizer.encode(a, add_special_tokens=False)
            _obs, _r, term, trunc, _info = await env.astep(ids)
            if term or trunc:
                break
        out.append(env.trajectory)
    return out


def pad_batch(trajs: Sequence[Trajectory], pad_id: int, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, targets, target_mask) for next-token training.
    target_mask[t] = loss_mask of token t+1: only policy tokens are trained on."""
    seqs = [t.token_ids for t in trajs]
    masks = [t.loss_mask for t in trajs]
    if any(s is None for s in seqs) or any(m is None for m in masks):
        raise ValueError("trajectories lack token_ids/loss_mask: run the env in token mode (pass a tokenizer)")
    for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):  # cheap, and a wrong mask trains silently
        if len(s) != len(m):  # type: ignore[arg-type]
            raise ValueError(f"trajectory {i}: {len(s)} token ids but {len(m)} loss-mask entries; the env must "  # type: ignore[arg-type]
                             "give one mask entry per token (1 = policy token)")
        if bad := sorted(set(m) - {0, 1}):  # type: ignore[arg-type]
            raise ValueError(f"trajectory {i}: loss mask values must be 0 or 1, got {bad}")
    T = max(len(s) for s in seqs)  # type: ignore[arg-type]
    B = len(seqs)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    lm = torch.zeros((B, T), dtype=torch.float32)
    for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        ids[i, :len(s)] = torch.as_tensor(s)  # type: ignore[arg-type]
        attn[i, :len(s)] = 1  # type: ignore[arg-type]
        lm[i, :len(m)] = torch.as_tensor(m, dtype=torch.float32)  # type: ignore[arg-type]
    return ids[:, :-1].to(device), attn[:, :-1].to(device), ids[:, 1:].to(device), lm[:, 1:].to(device)


def sft_loss(model: torch.nn.Module, trajs: Sequence[Trajectory], pad_id: int) -> tuple[torch.Tensor, float]:
    """Token-mean cross-entropy on policy tokens; returns (loss, policy token count)."""
    device = next(model.parameters()).device
    ids, attn, tgt, mask = pad_batch(trajs, pad_id, device)
    from rlf_train.grpo import masked_logprobs

    lp, _ = masked_logprobs(model, ids, attn, tgt, mask)
    n = mask.sum()
    return -(lp * mask).sum() / n.clamp(min=1.0), float(n)
