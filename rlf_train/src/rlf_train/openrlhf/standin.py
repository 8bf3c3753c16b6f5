"""CPU stand-ins for the rollout side of OpenRLHF's vLLM actor, to run the real agent executor without a GPU
(tests, benchmarks, and checking an env + reward before a GPU run).

They honour the contract of `RolloutRayActor.generate(prompt_token_ids, sampling_params, multi_modal_data)`
as the executor uses it: token ids in; a RequestOutput-shaped object out (`outputs[0].token_ids`, `.text`,
`.finish_reason` "stop" | "length", `.stop_reason`, `.logprobs` as a list of `{token_id: Logprob}` when
`sampling_params.logprobs` is set), with vLLM 0.32's stopping rules (max_tokens, EOS and `stop_token_ids`,
stop strings, `min_tokens`; see `_Engine`). tests/vllm/openrlhf/test_vllm_executor.py runs the same requests through a
real vLLM engine and pins the agreement. Model work runs in a worker thread, never on the caller's event loop.

- `ModelEngine`: samples from a causal LM (e.g. rlf's tiny Qwen3 policy) with temperature / top_p; its
  logprobs are vLLM's `processed_logprobs` (what OpenRLHF asks for);
- `ScriptedEngine`: writes the text a policy function returns for the decoded context, token by token, then
  EOS, with the same stopping rules, and its logprobs under a model when given one.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    logprobs: list[dict[int, Logprob]] | None = None
    index: int = 0
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: EOS, length)


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


@dataclass
class SamplingParams:
    """The fields of vLLM's SamplingParams that OpenRLHF sets and the executor reads or changes, with vLLM
    0.32's defaults."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    min_tokens: int = 0
    skip_special_tokens: bool = True
    logprobs: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False


def _earliest_stop(text: str, new_from: int, stop: Sequence[str]) -> tuple[str, int] | None:
    """(stop string, its start) of the occurrence that ends earliest among those ending after `new_from` (vLLM's
    `check_stop_strings`: ties go to the earlier string in `stop`)."""
    best: tuple[str, int] | None = None
    best_end = math.inf
    for s in stop:
        at = text.find(s, max(0, new_from - len(s) + 1))
        if at >= 0 and at + len(s) < best_end:
            best, best_end = (s, at), at + len(s)
    return best


class _Engine:
    """The stopping and output rules of vLLM 0.32's engine (checked against it in
    tests/vllm/openrlhf/test_vllm_executor.py):

    - EOS and `stop_token_ids` end a generation with the token kept in `token_ids` (`stop_reason` None for EOS,
      the id otherwise); neither can be sampled before `min_tokens` tokens (vLLM masks them);
    - a stop string ends it once more than `min_tokens` tokens exist, when an occurrence ends inside the newest
      token's text; the token is kept whole in `token_ids` while `text` is cut right after the stop string
      (`include_stop_str_in_output`) or before it; `stop_reason` is the string;
    - `text` is the decoded ids (`skip_special_tokens` as requested), without the EOS/stop id that ended the
      generation unless `include_stop_str_in_output`.
    """

    def __init__(self, tokenizer: Any, eos_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self.calls = 0
        self._lock = threading.Lock()  # one model call at a time (the model is not thread-safe)

    def _stop_ids(self, params: Any) -> set[int]:
        ids = set(getattr(params, "stop_token_ids", None) or [])
        if self.eos_token_id is not None:
            ids.add(int(self.eos_token_id))
        return ids

    def _decode(self, ids: Sequence[int], params: Any) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=bool(getattr(params, "skip_special_tokens",
                                                                                          True))))

    def _run(self, prompt: list[int], params: Any,
             step: Callable[[list[int], bool], tuple[int, dict[int, Logprob] | None]]) -> RequestOutput:
        """Generate with `step(ids so far, stop ids masked)` -> (next token, its logprob entries)."""
        stop = [s for s in (getattr(params, "stop", None) or []) if s]
        stop_ids = self._stop_ids(params)
        min_tokens = int(getattr(params, "min_tokens", 0) or 0)
        include = bool(getattr(params, "include_stop_str_in_output", False))
        max_tokens = getattr(params, "max_tokens", None)
        ids: list[int] = []
        lps: list[dict[int, Logprob] | None] = []
        finish, reason, cut = "length", None, None
        by_id = False
        text_len = 0
        while max_tokens is None or len(ids) < max_tokens:
            tok, entry = step(ids, len(ids) < min_tokens)
            ids.append(tok)
            lps.append(entry)
            if tok in stop_ids:
                finish, reason, by_id = "stop", (None if tok == self.eos_token_id else tok), True
            if stop:
                text = self._decode(ids if include or not by_id else ids[:-1], params)
                hit = _earliest_stop(text, text_len, stop) if len(ids) > min_tokens else None
                text_len = len(text)
                if hit is not None:
                    finish, reason = "stop", hit[0]
                    cut = hit[1] + len(hit[0]) if include else hit[1]
                    break
            if by_id:
                break
        text = self._decode(ids[:-1] if by_id and not include else ids, params)
        if cut is not None:
            text = text[:cut]
        want = getattr(params, "logprobs", None) is not None
        logprobs = None
        if want:
            logprobs = [e if e is not None else {t: Logprob(0.0, 1)} for t, e in zip(ids, lps, strict=True)]
        return RequestOutput(list(prompt), [CompletionOutput(ids, text, finish, logprobs, stop_reason=reason)])

    async def generate(self, prompt_token_ids: Sequence[int], sampling_params: Any,
                       multi_modal_data: Any = None) -> RequestOutput:
        if multi_modal_data:
            raise ValueError("text-only stand-in engine")
        self.calls += 1
        return await asyncio.to_thread(self._generate_locked, list(prompt_token_ids), sampling_params)

    def _generate_locked(self, prompt: list[int], params: Any) -> RequestOutput:
        with self._lock:
            return self._generate(prompt, params)

    def _generate(self, prompt: list[int], params: Any) -> RequestOutput:
        raise NotImplementedError

    def _entry(self, lp: torch.Tensor, tok: int, params: Any) -> dict[int, Logprob]:
        """vLLM's logprobs entry: the sampled token and the top `params.logprobs`, with ranks (1 = most likely)
        and decoded text."""
        k = int(getattr(params, "logprobs", 0) or 0)
        ranks = {tok: int((lp > lp[tok]).sum()) + 1}
        if k > 0:
            top = lp.topk(k)
            for r, t in enumerate(top.indices.tolist(), 1):
                ranks.setdefault(int(t), r)
        return {t: Logprob(float(lp[t]), r, self.tokenizer.decode([t])) for t, r in ranks.items()}


def _scaled_logprobs(logits: torch.Tensor, params: Any, masked: Sequence[int] = ()) -> torch.Tensor:
    """Log-probs of the distribution sampled from: `masked` ids (EOS and stop ids before min_tokens) at -inf,
    logits / temperature, then top_p (vLLM's `processed_logprobs`, which OpenRLHF asks for; greedy: no
    temperature)."""
    t = float(getattr(params, "temperature", 1.0) or 0.0)
    logits = logits.float().clone()
    if masked:
        logits[..., list(masked)] = -math.inf
    logits = logits / (t if t > 0 else 1.0)
    lp = torch.log_softmax(logits, dim=-1)
    top_p = float(getattr(params, "top_p", 1.0))
    if t > 0 and top_p < 1.0:
        sorted_lp, idx = lp.sort(descending=True)
        keep = sorted_lp.exp().cumsum(-1) - sorted_lp.exp() < top_p
        masked = torch.full_like(lp, -math.inf).scatter(-1, idx, torch.where(keep, sorted_lp, -math.inf))
        lp = torch.log_softmax(masked, dim=-1)
    return lp


class ModelEngine(_Engine):
    """Samples from `model` (a transformers causal LM) with the request's temperature and top_p."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, seed: int = 0) -> None:
        super().__init__(tokenizer)
        self.model = model.eval()
        self.gen = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def _generate(self, prompt: list[int], params: Any) -> RequestOutput:
        stop_ids = sorted(self._stop_ids(params))
        state: dict[str, Any] = {"past": None, "inp": torch.tensor([prompt])}
        greedy = float(getattr(params, "temperature", 1.0)) <= 0

        def step(ids: list[int], mask_stops: bool) -> tuple[int, dict[int, Logprob] | None]:
            if ids:
                state["inp"] = torch.tensor([[ids[-1]]])
            out = self.model(input_ids=state["inp"], past_key_values=state["past"], use_cache=True)
            state["past"] = out.past_key_values
            lp = _scaled_logprobs(out.logits[0, -1], params, stop_ids if mask_stops else ())
            tok = int(lp.argmax()) if greedy else int(torch.multinomial(lp.exp(), 1, generator=self.gen))
            return tok, self._entry(lp, tok, params)

        return self._run(prompt, params, step)


class ScriptedEngine(_Engine):
    """Writes `policy(decoded_context)` token by token and then EOS (as a model ends its reply), stopping as
    vLLM does. With `model`, the logprobs are the model's for those tokens (teacher-forced); without, 0.0."""

    def __init__(self, policy: Callable[[str], str], tokenizer: Any, model: torch.nn.Module | None = None,
                 delay_s: float = 0.0) -> None:
        super().__init__(tokenizer)
        self.policy = policy
        self.model = model.eval() if model is not None else None
        self.delay_s = delay_s

    async def generate(self, prompt_token_ids: Sequence[int], sampling_params: Any,
                       multi_modal_data: Any = None) -> RequestOutput:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)  # a GPU busy with other requests
        return await super().generate(prompt_token_ids, sampling_params, multi_modal_data)

    @torch.no_grad()
    def _generate(self, prompt: list[int], params: Any) -> RequestOutput:
        text = self.policy(self.tokenizer.decode(prompt, skip_special_tokens=False))
        script = [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]
        if self.eos_token_id is not None:
            script.append(int(self.eos_token_id))

        def step(ids: list[int], mask_stops: bool) -> tuple[int, dict[int, Logprob] | None]:
            return script[min(len(ids), len(script) - 1)], None

        out = self._run(prompt, params, step)
        comp = out.outputs[0]
        if comp.logprobs is not None and self.model is not None and comp.token_ids:
            ids = comp.token_ids
            logits = self.model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
            min_tokens = int(getattr(params, "min_tokens", 0) or 0)
            stop_ids = sorted(self._stop_ids(params))
            comp.logprobs = [self._entry(_scaled_logprobs(logits[k], params, stop_ids if k < min_tokens else ()),
                                         t, params) for k, t in enumerate(ids)]
        return out
