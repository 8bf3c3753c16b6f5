"""Generation pinned to its specification (rlf_train.rollout.local: generate, generate_batched, StopChecker,
length_buckets), against a plain reference: one row at a time, the whole sequence re-run through the model at
every token (no padding, no KV cache, no batch).

- greedy: every row's new tokens equal the reference's, with rows of different lengths left-padded in one
  batch, rows finishing at different steps (finished rows leave the batch) and over length buckets;
- a row ends right after its first stop token, EOS or stop string (text over several tokens), else after
  exactly max_new_tokens; the stop token is part of the output;
- sampled (temperature, top-p): each recorded log-prob is the reference's log-softmax of the tempered,
  nucleus-truncated logits at that prefix; a fixed generator gives the same samples; greedy records 0;
- generate_batched returns rows (and log-probs) in the order of the contexts;
- length_buckets partitions the indices into buckets of at most max_rows rows of similar length.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from rlf_train.config import load_config
from rlf_train.policy.tokenizer import load_tokenizer
from rlf_train.rollout.batch import SamplingParams
from rlf_train.rollout.local import StopChecker, _sample, generate, generate_batched, length_buckets
from rlf_train.rollout.sampling import sampling_logits

_CACHE: dict[str, Any] = {}


def setup() -> tuple[Any, torch.nn.Module]:
    if not _CACHE:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        tok = load_tokenizer(load_config(None, []).model)
        # an untied head: the tied tiny policy at init repeats its last token, which would hide position bugs
        qc = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                         tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.pad_token_id,
                         bos_token_id=None)
        torch.manual_seed(7)
        _CACHE.update(tok=tok, model=Qwen3ForCausalLM(qc).eval())
    return _CACHE["tok"], _CACHE["model"]


def contexts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 11, 6, 17, 4, 9, 25, 5][:n]
    return [[rng.randrange(1, 2600) for _ in range(k)] for k in lengths]


@torch.no_grad()
def reference(model: torch.nn.Module, tok: Any, ctx: list[int], pick: Any, max_new: int, stop_ids: set[int],
              stop_strings: list[str]) -> tuple[list[int], list[torch.Tensor]]:
    gen: list[int] = []
    logits_seen = []
    for _ in range(max_new):
        logits = model(input_ids=torch.tensor([ctx + gen])).logits[0, -1].float()
        logits_seen.append(logits)
        t = pick(logits, len(gen))
        gen.append(t)
        if t in stop_ids or any(s in tok.decode(gen, skip_special_tokens=False) for s in stop_strings):
            break
    return gen, logits_seen


def greedy(logits: torch.Tensor, _k: int) -> int:
    return int(logits.argmax())


def single_token_strings(tok: Any, outs: list[list[int]]) -> dict[int, tuple[int, str]]:
    """{row: (position, text)}: in row r, a generated token near position 1 + 2r whose text encodes back to
    that one token and which the row has not generated before."""
    found = {}
    for r, o in enumerate(outs):
        for k in sorted(range(1, len(o)), key=lambda k, r=r: abs(k - 1 - 2 * r)):
            s = tok.decode([o[k]])
            if s.strip() and tok.encode(s, add_special_tokens=False) == [o[k]] and o[k] not in o[:k]:
                found[r] = (k, s)
                break
    return found


def test_greedy_equals_the_reference_with_stops_and_rows_leaving() -> None:
    tok, model = setup()
    ctxs = contexts(8, 1)
    max_new = 10
    free = [reference(model, tok, c, greedy, max_new, set(), [])[0] for c in ctxs]
    assert len({tuple(o) for o in free}) > 4, "the tiny model's greedy continuations should differ between contexts"
    no_stop = StopChecker(tok, [], None)
    assert generate(model, ctxs, SamplingParams(0.0, 1.0, max_new), no_stop, tok.pad_token_id) == free
    # stops at different steps in different rows: a token id (single-token stop string), EOS, and a stop string
    # spanning two tokens (checked on the decoded text)
    singles = single_token_strings(tok, free)
    assert len(singles) >= 3, singles
    rows = sorted(singles, key=lambda r: singles[r][0])
    stop_strings = [singles[rows[0]][1], singles[rows[-1]][1]]
    eos = free[rows[1]][singles[rows[1]][0]]
    two = rows[2] if len(rows) > 3 else None
    if two is not None:
        k = singles[two][0]
        stop_strings.append(tok.decode(free[two][k - 1:k + 1]))
    stop = StopChecker(tok, [*stop_strings, ""], eos)
    assert stop.text_check is (two is not None and len(tok.encode(stop_strings[-1], add_special_tokens=False)) > 1)
    ids = {free[rows[0]][singles[rows[0]][0]], free[rows[-1]][singles[rows[-1]][0]], eos}
    assert set(stop.stop_ids.tolist()) >= ids
    want = [reference(model, tok, c, greedy, max_new, ids, stop_strings)[0] for c in ctxs]
    assert sum(len(w) < max_new for w in want) >= 3  # rows end early, at different steps
    assert len({len(w) for w in want}) >= 3
    lps: list[list[float]] = [[] for _ in ctxs]
    assert generate(model, ctxs, SamplingParams(0.0, 1.0, max_new), stop, tok.pad_token_id, None, lps) == want
    assert [len(x) for x in lps] == [len(w) for w in want] and all(v == 0.0 for x in lps for v in x)
    for bs in (1, 3):
        assert generate_batched(model, ctxs, SamplingParams(0.0, 1.0, max_new), stop, tok.pad_token_id, None,
                                bs) == want


@pytest.mark.parametrize("batch_size", [8, 3])
def test_sampled_logprobs_are_the_tempered_nucleus_logprobs(batch_size: int) -> None:
    tok, model = setup()
    ctxs = contexts(8, 2)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5)
    stop = StopChecker(tok, ["</answer>"], None)
    lps: list[list[float]] = [[] for _ in ctxs]
    outs = generate_batched(model, ctxs, params, stop, tok.pad_token_id, torch.Generator().manual_seed(3),
                            batch_size, lps)
    again = generate_batched(model, ctxs, params, stop, tok.pad_token_id, torch.Generator().manual_seed(3),
                             batch_size)
    assert outs == again  # a fixed generator: the same samples
    assert len({tuple(o) for o in outs}) == len(outs)
    stop_id = tok.encode("</answer>", add_special_tokens=False)[0]
    for c, o, lp in zip(ctxs, outs, lps, strict=True):
        ref, logits = reference(model, tok, c, lambda _lg, k, o=o: o[k], params.max_new_tokens, {stop_id}, [])
        assert ref == o  # it ends where the specification says (stop token or max_new_tokens)
        assert len(lp) == len(o)
        for k, t in enumerate(o):
            want = torch.log_softmax(sampling_logits(logits[k][None], params.temperature, params.top_p), -1)[0, t]
            assert torch.isfinite(want), "a sampled token must lie inside the nucleus"
            assert lp[k] == pytest.approx(float(want), abs=2e-4), (k, t)


def test_sample_returns_logprobs_only_when_asked() -> None:
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    for params in (SamplingParams(0.0), SamplingParams(0.8, 0.9)):
        tok, lp = _sample(logits, params, torch.Generator().manual_seed(1))
        assert lp is None and tok.shape == (3,)
        tok2, lp2 = _sample(logits, params, torch.Generator().manual_seed(1), with_logprob=True)
        assert torch.equal(tok, tok2) and lp2 is not None and lp2.shape == (3,)


def test_stop_checker() -> None:
    tok, _ = setup()
    assert SamplingParams() == SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=48)
    a, s = tok.encode("</answer>", add_special_tokens=False), tok.encode("</search>", add_special_tokens=False)
    st = StopChecker(tok, ["</answer>", "", "</search>"], 5)
    assert st.stop_strings == ["</answer>", "</search>"] and not st.text_check
    assert sorted(st.stop_ids.tolist()) == sorted({a[0], s[0], 5})
    assert st.hit(torch.tensor([a[0], 7, 5, s[0]]), [[a[0]], [7], [5], [s[0]]], [0, 1, 2, 3]).tolist() == \
        [True, False, True, True]
    assert StopChecker(tok, [], None).stop_ids.tolist() == []
    multi = "the end"
    both = StopChecker(tok, ["</answer>", multi], None)
    e = tok.encode(multi, add_special_tokens=False)
    # row 0 stops on the id, row 1 on the text: every row asked about is checked
    assert both.hit(torch.tensor([a[0], e[-1]]), [[a[0]], [4, *e]], [0, 1]).tolist() == [True, True]
    ids = tok.encode(multi, add_special_tokens=False)
    assert len(ids) > 1
    st = StopChecker(tok, [multi], None)
    assert st.text_check and st.stop_ids.tolist() == []
    gen = [[9, *ids], [9, *ids], ids[:1]]
    # the text check: row 0 ends with the string; row 1 also, but is not among the rows asked about
    assert st.hit(torch.tensor([ids[-1], ids[-1], ids[0]]), gen, [0, 2]).tolist() == [True, False, False]


def test_length_buckets() -> None:
    assert length_buckets([10, 40, 11, 12, 100, 13, 30], max_rows=3) == [[0, 2, 3], [5, 6], [1], [4]]
    assert length_buckets([5, 5, 5], max_rows=1) == [[0], [1], [2]]
    assert length_buckets([], max_rows=4) == []
    assert length_buckets([10, 26, 27], max_rows=8, slack=1.0, extra=16) == [[0, 1], [2]]  # 26 <= 10 + 16 < 27
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randrange(1, 300) for _ in range(rng.randrange(1, 40))]
        m = rng.randrange(1, 9)
        b = length_buckets(lengths, m)
        assert sorted(i for x in b for i in x) == list(range(len(lengths)))
        for k, x in enumerate(b):
            ls = [lengths[i] for i in x]
            assert len(x) <= m and ls == sorted(ls) and ls[-1] <= 1.5 * ls[0] + 16
            if k + 1 < len(b):  # a bucket closes only when full or when the next length is too far
                nxt = lengths[b[k + 1][0]]
                assert nxt >= ls[-1] and (len(x) == m or nxt > 1.5 * ls[0] + 16)
    with pytest.raises(ValueError, match="max_rows must be >= 1, got 0"):
        length_buckets([1, 2], 0)
