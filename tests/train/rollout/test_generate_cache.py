"""rlf_train.rollout.local.generate's contract with transformers: no autograd graph while sampling, and the KV cache
passed under the name the installed transformers takes (`cache` in recent releases, which deprecate
`past_key_values` for removal in 5.40; `past_key_values` before), with no deprecation warning on the way."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from rlf_train.rollout.batch import SamplingParams
from rlf_train.rollout.local import StopChecker, cache_kwarg, generate
from tests.train.rollout.test_generate_spec import setup as tiny


def test_generate_builds_no_graph_and_passes_the_cache_without_deprecation_warnings() -> None:
    tok, model = tiny()
    grad_modes: list[bool] = []
    caches: list[bool] = []

    def hook(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        grad_modes.append(torch.is_grad_enabled())
        caches.append(kwargs.get(cache_kwarg(type(model))) is not None)

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a FutureWarning / DeprecationWarning from transformers fails here
            out = generate(model, [[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=4, temperature=0.0),
                           StopChecker(tok, (), None), tok.pad_token_id)
    finally:
        handle.remove()
    assert [len(o) for o in out] == [4, 4]
    assert grad_modes and not any(grad_modes)  # sampling never records a graph
    assert caches == [False, True, True, True]  # prefill without a cache, then every step continues it


def test_the_cache_argument_follows_the_forward_signature() -> None:
    class Old(torch.nn.Module):
        def forward(self, input_ids: Any = None, past_key_values: Any = None, use_cache: bool = False) -> Any: ...

    class New(torch.nn.Module):
        def forward(self, input_ids: Any = None, cache: Any = None, use_cache: bool = False) -> Any: ...

    assert cache_kwarg(Old) == "past_key_values"
    assert cache_kwarg(New) == "cache"
