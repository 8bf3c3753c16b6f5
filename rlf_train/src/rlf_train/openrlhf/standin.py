"""CPU stand-ins for the rollout side of OpenRLHF's vLLM actor, to run the real agent executor without a GPU
(tests, benchmarks, and checking an env + reward before a GPU run).

They honour the contract of `RolloutRayActor.generate(prompt_token_ids, sampling_params, multi_modal_data)`
as the executor uses it: token ids in; a RequestOutput-shaped object out (`outputs[0].token_ids`, `.text`,
`.finish_reason` "stop" | "length", `.logprobs` as a list of `{token_id: Logprob}` when
`sampling_params.logprobs` is set); generation stops at `max_tokens`, at EOS or `stop_token_ids`, or at the
first of `sampling_params.stop` (kept in the output with `include_stop_str_in_output`, as vLLM keeps the
token that completes it). Model work runs in a worker thread, never on the caller's event loop.

- `ModelEngine`: samples from a causal LM (e.g. rlf's tiny Qwen3 policy) with temperature / top_p;
- `ScriptedEngine`: writes the text a policy function returns for the decoded context, token by token,
  with the same stopping rules, and its logprobs under a model when given one.
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


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


@dataclass
class SamplingParams:
    """The fields of vLLM's SamplingParams that OpenRLHF sets and the executor reads or changes."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    min_tokens: int = 0
    skip_special_tokens: bool = False
    logprobs: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False


class _Engine:
    def __init__(self, tokenizer: Any, eos_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self.calls = 0
        self._lock = threading.Lock()  # one model call at a time (the model is not thread-safe)

    def _stops(self, params: Any) -> tuple[list[str], set[int]]:
        stop = [s for s in (getattr(params, "stop", None) or []) if s]
        ids = set(getattr(params, "stop_token_ids", None) or [])
        if self.eos_token_id is not None:
            ids.add(int(self.eos_token_id))
        return stop, ids

    def _finish(self, ids: list[int], new: int, stop: list[str], stop_ids: set[int], params: Any) -> str | None:
        """'stop' when the token just added ends the generation, 'length' at max_tokens, else None."""
        if new in stop_ids:
            return "stop"
        if stop:
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            if any(s in text for s in stop):
                return "stop"
        if params.max_tokens is not None and len(ids) >= params.max_tokens:
            return "length"
        return None

    def _output(self, prompt: list[int], ids: list[int], finish: str, lps: list[float] | None) -> RequestOutput:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        logprobs = None if lps is None else [{t: Logprob(lp, 1)} for t, lp in zip(ids, lps, strict=True)]
        return RequestOutput(list(prompt), [CompletionOutput(ids, text, finish, logprobs)])

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


def _scaled_logprobs(logits: torch.Tensor, params: Any) -> torch.Tensor:
    """Log-probs of the distribution sampled from: logits / temperature, then top_p (as vLLM's processed
    logprobs, which OpenRLHF asks for)."""
    t = float(getattr(params, "temperature", 1.0) or 0.0)
    logits = logits.float() / (t if t > 0 else 1.0)
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
        stop, stop_ids = self._stops(params)
        ids: list[int] = []
        lps: list[float] = []
        past = None
        inp = torch.tensor([prompt])
        finish = "length"
        while params.max_tokens is None or len(ids) < params.max_tokens:
            out = self.model(input_ids=inp, past_key_values=past, use_cache=True)
            past = out.past_key_values
            lp = _scaled_logprobs(out.logits[0, -1], params)
            if float(getattr(params, "temperature", 1.0)) > 0:
                tok = int(torch.multinomial(lp.exp(), 1, generator=self.gen))
            else:
                tok = int(lp.argmax())
            ids.append(tok)
            lps.append(float(lp[tok]))
            done = self._finish(ids, tok, stop, stop_ids, params)
            if done is not None:
                finish = done
                break
            inp = torch.tensor([[tok]])
        return self._output(prompt, ids, finish, lps if getattr(params, "logprobs", None) is not None else None)


class ScriptedEngine(_Engine):
    """Writes `policy(decoded_context)` token by token, stopping as vLLM would. With `model`, the logprobs
    are the model's for those tokens (teacher-forced); without, 0.0."""

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
        stop, stop_ids = self._stops(params)
        text = self.policy(self.tokenizer.decode(prompt, skip_special_tokens=False))
        script = list(self.tokenizer.encode(text, add_special_tokens=False))
        ids: list[int] = []
        finish = "length"
        for tok in script:
            ids.append(tok)
            done = self._finish(ids, tok, stop, stop_ids, params)
            if done is not None:
                finish = done
                break
        else:
            if params.max_tokens is None or len(ids) < params.max_tokens:
                finish = "stop"  # the script ended: as if the policy emitted EOS (not added)
        lps = None
        if getattr(params, "logprobs", None) is not None:
            lps = [0.0] * len(ids)
            if self.model is not None and ids:
                logits = self.model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
                lp = _scaled_logprobs(logits, params)
                lps = [float(lp[k, t]) for k, t in enumerate(ids)]
        return self._output(prompt, ids, finish, lps)
