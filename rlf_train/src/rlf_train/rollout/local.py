"""The local engine: the trainer's own sampler. Batched generation with a KV cache for every active episode, stop at
the format's stop strings, step all envs of the batch concurrently (`ToolVectorEnv.astep_active`), repeat until
every episode ends.

Token ids and loss masks come from the env (token mode); nothing is re-tokenised here. Each turn
re-prefills the active contexts (left-padded) and then decodes with the KV cache.

`rollout()` runs the whole loop, generation included, on rlf's event-loop thread (the thread that owns
the tools): an env step is then a plain await, not a hop to another thread and back. Measured on a
2-vCPU VM, each hop cost 2-5 ms of wake-up latency, as much as stepping 64 search envs.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from rlf_envs import runtime
from rlf_envs.env.episodes import GenerateBatchFn, Generation
from rlf_envs.env.vector import ToolVectorEnv
from rlf_envs.types import Trajectory
from rlf_train.rollout.batch import RolloutStats, SamplingParams, drive_episodes
from rlf_train.rollout.sampling import row_seeds, sample


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


def _row_seeds(params: SamplingParams, n: int, gen: torch.Generator | None,
               seeds: Sequence[int | None] | None) -> list[int]:
    """`sampling.row_seeds`; greedy decoding draws nothing from `gen` (0s: unused)."""
    return row_seeds(n, gen, seeds) if params.temperature > 0 else [0] * n


def _sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None,
            with_logprob: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decode step of `generate` for a batch of rows: `sampling.sample` with row seeds from `gen`
    (`sampling.row_seeds`); with `with_logprob`, also the drawn tokens' log-probs under the sampling
    distribution (the behaviour log-probs of asynchronous RL; 0 for greedy)."""
    seeds = torch.tensor(_row_seeds(params, logits.shape[0], gen, None), dtype=torch.long, device=logits.device)
    tok, lp = sample(logits, params.temperature, params.top_p, seeds, 0)
    return tok, (lp if with_logprob else None)


@functools.cache
def cache_kwarg(model_cls: type) -> str:
    """The forward argument that takes the KV cache: `cache` in recent transformers (which deprecates
    `past_key_values`, to be removed in 5.40), `past_key_values` before."""
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def kv_cache(out: Any) -> Any:
    """The KV cache a forward returned, under either name (see `cache_kwarg`)."""
    cache = out.get("cache") if hasattr(out, "get") else None
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    contexts: Sequence[Sequence[int]],
    params: SamplingParams,
    stop: StopChecker,
    pad_id: int,
    gen: torch.Generator | None = None,
    logprobs: list[list[float]] | None = None,
    seeds: Sequence[int] | None = None,
) -> list[list[int]]:
    """Continue every context until a stop token/string, EOS or max_new_tokens. Returns new ids per row;
    `logprobs` (a list of B empty lists), when given, receives each new token's sampling log-prob.

    Tokens are drawn by `rlf_train.rollout.sampling.sample` on the model's device. Row i's draws depend only on its
    seed (`seeds[i]`, else one derived from a base drawn from `gen`, see `sampling.row_seeds`) and its step,
    not on the other rows of the batch."""
    device = next(model.parameters()).device
    B = len(contexts)
    row_seed = torch.tensor(_row_seeds(params, B, gen, seeds), dtype=torch.long, device=device)
    L = max(len(c) for c in contexts)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    for i, c in enumerate(contexts):
        input_ids[i, L - len(c):] = torch.as_tensor(list(c), dtype=torch.long)
        attn[i, L - len(c):] = 1
    input_ids, attn = input_ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
    past = kv_cache(out)
    cache_arg = cache_kwarg(type(model))
    logits = out.logits[:, -1]
    next_pos = pos[:, -1] + 1
    generated: list[list[int]] = [[] for _ in range(B)]
    rows = list(range(B))  # batch position -> context index; finished rows are dropped from the batch
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for step in range(params.max_new_tokens):
        tok, lp = sample(logits, params.temperature, params.top_p, row_seed, step)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        live = (~done).nonzero().flatten().tolist()
        tl = tok.tolist()
        for j in live:
            generated[rows[j]].append(tl[j])
        if logprobs is not None:
            lpl = lp.tolist()
            for j in live:
                logprobs[rows[j]].append(lpl[j])
        done = done | stop.hit(tok, [generated[r] for r in rows], live)
        if step == params.max_new_tokens - 1 or bool(done.all()):
            break
        if int(done.sum()) * 4 >= len(rows) and hasattr(past, "batch_select_indices"):
            # a quarter or more of the batch has finished: keep decoding only the rest (one slow row
            # no longer makes 63 finished ones run to max_new_tokens). Caches without row selection
            # (some custom model classes) keep the finished rows.
            keep = (~done).nonzero().flatten()
            past.batch_select_indices(keep)
            attn, next_pos, tok, done = attn[keep], next_pos[keep], tok[keep], done[keep]
            row_seed = row_seed[keep]
            rows = [rows[k] for k in keep.tolist()]
        attn = torch.cat([attn, torch.ones((len(rows), 1), dtype=attn.dtype, device=device)], dim=1)
        out = model(input_ids=tok.unsqueeze(1), attention_mask=attn, position_ids=next_pos.unsqueeze(1),
                    use_cache=True, **{cache_arg: past})
        past = kv_cache(out)
        logits = out.logits[:, -1]
        next_pos = next_pos + 1
    return generated


def length_buckets(lengths: Sequence[int], max_rows: int, slack: float = 1.5, extra: int = 16) -> list[list[int]]:
    """Indices grouped into generation batches of similar context length (at most `max_rows` each).

    Contexts are left-padded to the longest in a batch, and prefill costs rows x longest: one episode
    with a long observation would make all 64 rows pay for it (measured on the quickstart: a 147-token
    row in a batch of ~40-token rows made that prefill 4x slower). A batch closes when the next length
    exceeds slack x its shortest + extra."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    buckets: list[list[int]] = []
    cur: list[int] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if cur and (len(cur) >= max_rows or lengths[i] > slack * lengths[cur[0]] + extra):
            buckets.append(cur)
            cur = []
        cur.append(i)
    if cur:
        buckets.append(cur)
    return buckets


def generate_batched(
    model: torch.nn.Module,
    contexts: Sequence[Sequence[int]],
    params: SamplingParams,
    stop: StopChecker,
    pad_id: int,
    gen: torch.Generator | None,
    batch_size: int,
    logprobs: list[list[float]] | None = None,
    seeds: Sequence[int] | None = None,
) -> list[list[int]]:
    """`generate` over length buckets of at most `batch_size` rows; results (and `logprobs`, if given) in
    the order of `contexts`. Row i samples with seed `seeds[i]`, else with row i of `sampling.row_seeds`
    (one base drawn from `gen` per call): the tokens do not depend on how the rows are bucketed."""
    out: list[list[int]] = [[] for _ in contexts]
    rs = _row_seeds(params, len(contexts), gen, seeds)
    for bucket in length_buckets([len(c) for c in contexts], batch_size):
        lps: list[list[float]] | None = [[] for _ in bucket] if logprobs is not None else None
        outs = generate(model, [contexts[i] for i in bucket], params, stop, pad_id, None, lps,
                        seeds=[rs[i] for i in bucket])
        for k, (i, o) in enumerate(zip(bucket, outs, strict=True)):
            out[i] = o
            if logprobs is not None and lps is not None:
                logprobs[i] = lps[k]
    return out


def local_generate_batch(model: torch.nn.Module, tokenizer: Any, params: SamplingParams, stop_strings: Sequence[str],
                         *, batch_size: int = 64, gen: torch.Generator | None = None,
                         logprobs: bool = False) -> GenerateBatchFn:
    """The trainer's local sampler as a `GenerateBatchFn` (`rlf_envs.env.episodes`): `generate_batched` over
    the contexts, grouped by their token room; with `logprobs`, each token's sampling log-prob is returned
    (the behaviour log-probs the agent endpoint records). The env-driven rollouts and the agent endpoint both
    generate through it. The function takes optional per-context `seeds` (the endpoint's per-request seeds,
    `rlf_train.rollout.sampling`): a context's tokens then depend on its seed only, not on its batch mates or their
    order; contexts without one get seeds from a base drawn from `gen`."""
    stop = StopChecker(tokenizer, list(stop_strings), tokenizer.eos_token_id)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    async def generate_batch(contexts: list[list[int]], max_tokens: list[int], _stop: list[str],
                             seeds: Sequence[int | None] | None = None) -> list[Generation]:
        out: list[Generation] = [Generation(())] * len(contexts)
        rs = _row_seeds(params, len(contexts), gen, seeds)
        for room in sorted(set(max_tokens)):  # one room (max_new_tokens) unless a budget is near its end
            rows = [k for k, m in enumerate(max_tokens) if m == room]
            p = params if room == params.max_new_tokens else replace(params, max_new_tokens=room)
            lps: list[list[float]] | None = [[] for _ in rows] if logprobs else None
            outs = generate_batched(model, [contexts[k] for k in rows], p, stop, pad_id, None, batch_size, lps,
                                    seeds=[rs[k] for k in rows])
            for j, (k, ids) in enumerate(zip(rows, outs, strict=True)):
                out[k] = Generation(ids, lps[j] if lps is not None else None)
        return out

    return generate_batch


async def run_episodes(
    venv: ToolVectorEnv,
    task_indices: Sequence[int],
    model: torch.nn.Module,
    tokenizer: Any,
    params: SamplingParams,
    *,
    seeds: Sequence[int] | None = None,
    batch_size: int = 64,
    gen: torch.Generator | None = None,
) -> tuple[list[Trajectory], RolloutStats]:
    """One episode on each of the first len(task_indices) envs (env i on task_indices[i]) with the policy:
    `drive_episodes` with `local_generate_batch`.

    Call it on rlf's loop (`rollout()` does); from another loop each env phase hops threads."""
    generate_batch = local_generate_batch(model, tokenizer, params, venv.envs[0].format.stop_strings,
                                          batch_size=batch_size, gen=gen)
    was_training = model.training
    model.eval()
    try:
        episodes, stats = await drive_episodes(venv, task_indices, generate_batch, params, seeds=seeds,
                                               check_turn_length=False)
    finally:
        model.train(was_training)
    return [venv.envs[i].trajectory for i in range(len(episodes))], stats


def rollout(
    venv: ToolVectorEnv,
    task_indices: Sequence[int],
    model: torch.nn.Module,
    tokenizer: Any,
    params: SamplingParams,
    **kwargs: Any,
) -> tuple[list[Trajectory], RolloutStats]:
    """`run_episodes` on rlf's loop thread, waited for here (see the module docstring). The loop is
    busy while the policy generates; the episodes are in lock-step, so nothing of theirs waits."""
    return runtime.run(run_episodes(venv, task_indices, model, tokenizer, params, **kwargs))
