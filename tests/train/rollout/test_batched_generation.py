"""Batched generation: left padding, finished rows dropped from the KV cache mid-batch, length buckets.

Greedy decoding of a batch must give, row for row, what decoding each context alone gives."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from repo_paths import REPO

from rlf_train.config import load_config
from rlf_train.policy.model import build_tiny_model
from rlf_train.policy.tokenizer import load_tokenizer
from rlf_train.rollout.batch import SamplingParams
from rlf_train.rollout.local import StopChecker, generate, generate_batched, length_buckets

ROOT = REPO


class StopAfter(StopChecker):
    """Stops row i after stops[i] tokens. Rows are told apart by their output lists, which the first
    call sees in context order (no row has finished yet)."""

    def __init__(self, tokenizer: Any, stops: Sequence[int]) -> None:
        super().__init__(tokenizer, [], None)
        self.stops = list(stops)
        self.limits: dict[int, int] = {}

    def hit(self, new_token: torch.Tensor, generated: list[list[int]], rows: list[int]) -> torch.Tensor:
        if not self.limits:
            self.limits = {id(g): k for g, k in zip(generated, self.stops, strict=True)}
        out = torch.zeros(len(generated), dtype=torch.bool)
        for b in rows:
            out[b] = len(generated[b]) >= self.limits[id(generated[b])]
        return out


@pytest.fixture(scope="module")
def tiny() -> tuple[torch.nn.Module, Any]:
    cfg = load_config(None, ["model.tiny.hidden_size=32", "model.tiny.intermediate_size=64"])
    tok = load_tokenizer(cfg.model)
    model = build_tiny_model(cfg.model, len(tok), 0, tok.pad_token_id).eval()
    # freshly initialised, the tiny model mostly repeats its last input token; large random weights make
    # every output depend on the whole context (and so on the KV cache of each row)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model, tok


def _contexts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, vocab, (int(3 + (7 * i) % 23),), generator=g).tolist() for i in range(n)]


def _alone(model: torch.nn.Module, tok: Any, contexts: Sequence[Sequence[int]], stops: Sequence[int],
           max_new: int) -> list[list[int]]:
    outs = []
    for c, k in zip(contexts, stops, strict=True):
        checker = StopChecker(tok, [], None)
        outs.append(generate(model, [c], SamplingParams(temperature=0.0, max_new_tokens=min(k, max_new)),
                             checker, 0))
    return [o[0] for o in outs]


def test_greedy_batch_with_rows_finishing_early_equals_each_row_alone(tiny: tuple[torch.nn.Module, Any]) -> None:
    model, tok = tiny
    contexts = _contexts(12, len(tok))
    stops = [1 + (5 * i) % 9 for i in range(12)]  # rows finish after 1..9 tokens: the batch shrinks as they do
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    batch = generate(model, contexts, params, StopAfter(tok, stops), 0)
    assert [len(b) for b in batch] == stops
    assert batch == _alone(model, tok, contexts, stops, 12)


def test_length_buckets_cover_every_row_once_within_limits() -> None:
    lengths = [40, 38, 147, 41, 36, 293, 39, 12, 13, 150] * 7
    buckets = length_buckets(lengths, max_rows=16)
    flat = sorted(i for b in buckets for i in b)
    assert flat == list(range(len(lengths)))
    for b in buckets:
        assert len(b) <= 16
        short = min(lengths[i] for i in b)
        assert max(lengths[i] for i in b) <= 1.5 * short + 16
    assert length_buckets([], 4) == []
    with pytest.raises(ValueError, match="max_rows"):
        length_buckets([1], 0)


def test_generate_batched_keeps_context_order(tiny: tuple[torch.nn.Module, Any]) -> None:
    model, tok = tiny
    contexts = _contexts(10, len(tok))
    contexts[3] = contexts[3] * 8  # one long context goes to its own bucket
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    got = generate_batched(model, contexts, params, StopChecker(tok, [], None), 0, None, batch_size=4)
    assert got == _alone(model, tok, contexts, [4] * len(contexts), 4)


def test_rollout_benchmark_runs_and_reports_both_workloads(tmp_path: Path) -> None:
    """benchmarks/rollout.py end to end on a small budget (a random policy: no checkpoint in tmp_path)."""
    out = tmp_path / "rollout.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "rollout.py"), "--episodes", "32", "--batch", "16",
         "--set", f"logging.run_dir={tmp_path}/run", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res["workloads"]) == {"grpo", "distinct"} and res["checkpoint"] is None
    for w in res["workloads"].values():
        assert w["episodes"] == 32 and w["trajectories_per_s"] > 0
        assert 0.0 <= w["outside_generation_share"] < 1.0 and w["baseline_generate_only_s"] > 0
    assert res["workloads"]["grpo"]["group_size"] == 8 and res["workloads"]["distinct"]["group_size"] == 1
    assert "share of rollout time outside generation" in r.stdout


def test_tokenizer_adapter_batches_a_transformers_tokenizer_exactly(tiny: tuple[torch.nn.Module, Any]) -> None:
    from rlf_envs.env.tokens import TokenizerAdapter

    _model, tok = tiny  # a transformers fast tokenizer
    texts = ["Question: What is the job of Motodram?\n", "<search> Motodram </search>", "", "é ✓ \n\n x"]
    a = TokenizerAdapter(tok)
    assert a.is_hf
    want = [tok.encode(t, add_special_tokens=False) for t in texts]
    assert a.encode_batch(texts) == want and [a.encode(t) for t in texts] == want
