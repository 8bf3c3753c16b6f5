"""Rollouts: batched generation with a KV cache for every active episode, stop at the format's stop
strings, step all envs of the batch concurrently, repeat until every episode ends.

Token ids and loss masks come from the env (token mode); nothing is re-tokenised here. Each turn
re-prefills the active contexts (left-padded) and then decodes with the KV cache.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlf_envs import runtime
from rlf_envs.types import Trajectory


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 48


class StopChecker:
    """Per-row stop test. Fast path: every stop string is one token id. Otherwise the decoded tail of
    each row's new tokens is checked for any stop string."""

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str], eos_id: int | None) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.eos_id = eos_id
        ids: set[int] = set()
        self.text_check = False
        for s in self.stop_strings:
            enc = tokenizer.encode(s, add_special_tokens=False)
            if len(enc) == 1:
                ids.add(enc[0])
            else:
                self.text_check = True
        if eos_id is not None:
            ids.add(eos_id)
        self.stop_ids = torch.tensor(sorted(ids), dtype=torch.long)
        self.max_stop_len = max((len(s) for s in self.stop_strings), default=0)

    def hit(self, new_token: torch.Tensor, generated: list[list[int]], rows: list[int]) -> torch.Tensor:
        """new_token [B] (already appended to `generated`), returns bool [B]."""
        hit = torch.isin(new_token, self.stop_ids.to(new_token.device))
        if self.text_check:
            for b in rows:
                if hit[b]:
                    continue
                tail = self.tokenizer.decode(generated[b][-8:], skip_special_tokens=False)
                if any(s in tail for s in self.stop_strings):
                    hit[b] = True
        return hit


def _sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    if params.temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    contexts: Sequence[Sequence[int]],
    params: SamplingParams,
    stop: StopChecker,
    pad_id: int,
    gen: torch.Generator | None = None,
) -> list[list[int]]:
    """Continue every context until a stop token/string, EOS or max_new_tokens. Returns new ids per row."""
    device = next(model.parameters()).device
    B = len(contexts)
    L = max(len(c) for c in contexts)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    for i, c in enumerate(contexts):
        input_ids[i, L - len(c):] = torch.as_tensor(list(c), dtype=torch.long)
        attn[i, L - len(c):] = 1
    input_ids, attn = input_ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
    past = out.past_key_values
    logits = out.logits[:, -1]
    next_pos = pos[:, -1] + 1
    generated: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for step in range(params.max_new_tokens):
        tok = _sample(logits, params, gen)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        live = (~done).nonzero().flatten().tolist()
        tl = tok.tolist()
        for b in live:
            generated[b].append(tl[b])
        done = done | stop.hit(tok, generated, live)
        if step == params.max_new_tokens - 1 or bool(done.all()):
            break
        attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=device)], dim=1)
        out = model(input_ids=tok.unsqueeze(1), attention_mask=attn, position_ids=next_pos.unsqueeze(1),
                    past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[:, -1]
        next_pos = next_pos + 1
    return generated


@dataclass
class RolloutStats:
    gen_seconds: float = 0.0
    env_seconds: float = 0.0
    total_seconds: float = 0.0
    gen_tokens: int = 0
    turns: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def outside_gen_share(self) -> float:
        return 1.0 - self.gen_seconds / self.total_seconds if self.total_seconds > 0 else 0.0


def _as_ids(obs: Any) -> list[int]:
    if isinstance(obs, np.ndarray):
        return obs.astype(np.int64).tolist()
    return [int(x) for x in obs]


async def _gather(coros: Any) -> list[Any]:
    return list(await asyncio.gather(*coros))


async def _step_envs(envs: Sequence[Any], actions: dict[int, list[int]], active: list[int]) -> list[Any]:
    """Step the active envs together on rlf's loop (one thread hop per batch, not per env; GC held)."""
    with runtime.paused_gc():
        return list(await asyncio.gather(*(envs[i].astep(actions[i]) for i in active)))


async def run_episodes(
    envs: Sequence[Any],
    task_indices: Sequence[int],
    model: torch.nn.Module,
    tokenizer: Any,
    params: SamplingParams,
    *,
    seeds: Sequence[int] | None = None,
    batch_size: int = 64,
    gen: torch.Generator | None = None,
) -> tuple[list[Trajectory], RolloutStats]:
    """Run one episode per env (env i on task_indices[i]) with the policy; returns the trajectories."""
    if len(envs) != len(task_indices):
        raise ValueError("one task index per env")
    stats = RolloutStats()
    t0 = time.perf_counter()
    fmt = envs[0].format
    stop = StopChecker(tokenizer, list(fmt.stop_strings), tokenizer.eos_token_id)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    was_training = model.training
    model.eval()
    t = time.perf_counter()
    resets = await runtime.bridge(_gather(
        env.areset(seed=None if seeds is None else int(seeds[i]), options={"task_index": int(ti)})
        for i, (env, ti) in enumerate(zip(envs, task_indices, strict=True))
    ))
    stats.env_seconds += time.perf_counter() - t
    contexts = [_as_ids(obs) for obs, _ in resets]
    active = list(range(len(envs)))
    try:
        while active:
            t = time.perf_counter()
            actions: dict[int, list[int]] = {}
            for s in range(0, len(active), batch_size):
                chunk = active[s:s + batch_size]
                outs = generate(model, [contexts[i] for i in chunk], params, stop, pad_id, gen)
                for i, o in zip(chunk, outs, strict=True):
                    actions[i] = o
                    stats.gen_tokens += len(o)
            stats.gen_seconds += time.perf_counter() - t
            t = time.perf_counter()
            results = await runtime.bridge(_step_envs(envs, actions, active))
            stats.env_seconds += time.perf_counter() - t
            stats.turns += len(active)
            still = []
            for i, (obs, _r, term, trunc, _info) in zip(active, results, strict=True):
                contexts[i].extend(actions[i])
                if not (term or trunc):
                    contexts[i].extend(_as_ids(obs))
                    still.append(i)
            active = still
    finally:
        model.train(was_training)
    stats.total_seconds = time.perf_counter() - t0
    return [env.trajectory for env in envs], stats
