"""Sampling, rollout contexts, eval, SFT loss and resume pinned to their specification.

- sampling (`rollout._sample`, grpo.sampling_logits docstring): greedy at temperature 0; else a draw from
  softmax(logits / T) restricted to the top-p nucleus (the most likely tokens whose preceding cumulative
  probability is below top_p), renormalised. Checked by total variation over many draws of a tiny vocab.
- rollout: the next turn's context is exactly the previous context + every generated token + the
  observation's ids; the trajectory's token ids are the last context + the last action.
- eval: runs on the eval split's tasks (never train tasks), min(eval.num_tasks, split size) of them, and
  success is reward >= SUCCESS_THRESHOLD (= 1 - 1e-6): the threshold itself counts, just below does not.
- SFT: token-mean cross-entropy over the policy tokens (loss mask of the target token).
- resume: optimizer (Adam moments, step) and scheduler (LR) state equal the uninterrupted run's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import rlf_train.rollout.local as rollout_mod
from rlf_envs.records import SUCCESS_THRESHOLD
from rlf_envs.types import Task, Trajectory
from rlf_train.config import TrainConfig, load_config
from rlf_train.policy.checkpoint import read_checkpoint
from rlf_train.rollout.batch import SamplingParams, episode_stats, is_success
from rlf_train.rollout.local import _sample
from rlf_train.sft import sft_loss
from rlf_train.trainer import Trainer
from tests.train.test_grpo_spec import spec_cfg


def exact_dist(logits: np.ndarray, temp: float, top_p: float) -> np.ndarray:
    z = logits / temp
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, dtype=bool)
    keep[order[before < top_p]] = True
    q = np.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize(("temp", "top_p"), [(1.0, 1.0), (0.5, 1.0), (2.0, 1.0), (1.0, 0.7), (0.7, 0.9), (1.5, 0.5)])
def test_sampled_distribution_is_the_tempered_truncated_softmax(temp: float, top_p: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 40_000
    gen = torch.Generator().manual_seed(1234)
    draws, behaviour = _sample(logits.expand(n, -1), SamplingParams(temperature=temp, top_p=top_p), gen,
                               with_logprob=True)
    freq = np.bincount(draws.numpy(), minlength=6) / n
    want = exact_dist(logits.double().numpy(), temp, top_p)
    # the behaviour log-prob recorded with each draw (async RL's correction) is that token's log-prob under the
    # same tempered, truncated distribution
    assert behaviour is not None
    np.testing.assert_allclose(behaviour.double().numpy(), np.log(want[draws.numpy()]), rtol=0, atol=1e-5)
    assert np.all(freq[want == 0] == 0), (freq, want)  # never a token outside the nucleus
    # total variation: the sampling noise of 40k draws is ~0.005; any other temperature/top-p is >= 0.03 away
    assert 0.5 * np.abs(freq - want).sum() < 0.015, (freq, want)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(_sample(logits, SamplingParams(temperature=0.0), None)[0], logits.argmax(-1))


def rollout_cfg(run_dir: Path, extra: list[str] | None = None) -> TrainConfig:
    """test_train_spec_grpo's config with smaller batches and up to three turns."""
    return spec_cfg(run_dir, ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_turns=3",
                              "rollout.max_new_tokens_per_turn=3", "env.kwargs={max_turns: 3}", "eval.sampled=true",
                              *(extra or [])])


def test_every_generated_token_is_in_the_next_turn_context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.train.test_end_to_end import register

    register()
    tr = Trainer(rollout_cfg(tmp_path / "run", ["env.id=rlf_test/TinySearch-v0", "env.imports=[]",
                                                "env.eval_split=test", "env.kwargs={}",
                                                "rollout.max_total_tokens=512"]))
    turns: list[tuple[list[list[int]], list[list[int]]]] = []
    orig = rollout_mod.generate_batched

    call = tr.tokenizer.encode("<search>Arno</search>", add_special_tokens=False)

    def spy(model: Any, contexts: Any, *a: Any, **k: Any) -> list[list[int]]:
        out = orig(model, contexts, *a, **k)
        if not turns:  # the tiny random policy never calls a tool: the first action is a scripted search
            out = [list(call) for _ in out]
        turns.append(([list(c) for c in contexts], [list(o) for o in out]))
        return out

    monkeypatch.setattr(rollout_mod, "generate_batched", spy)
    params = SamplingParams(temperature=1.0, max_new_tokens=3)
    trajs, _ = tr.source.rollouts(tr.train_envs, [0, 0, 1, 1], params, seed_base=0,
                                  gen=torch.Generator().manual_seed(0))
    assert len(turns) >= 2, "the env ended every episode after one turn: no next-turn context to check"
    for k, (contexts, outs) in enumerate(turns):
        active = [i for i, t in enumerate(trajs) if len(t.turns) > k]  # episodes still running at turn k
        assert len(contexts) == len(active)
        for j, i in enumerate(active):
            tids = trajs[i].token_ids
            span = trajs[i].turns[k].action_span
            assert tids is not None and span is not None
            assert contexts[j] == tids[:span[0]] and outs[j] == tids[span[0]:span[1]]  # every generated token
            if k + 1 < len(trajs[i].turns):  # next turn: previous context + generated + observation, exactly
                j2 = [i2 for i2, t in enumerate(trajs) if len(t.turns) > k + 1].index(i)
                nxt = turns[k + 1][0][j2]
                obs = tids[span[1]:trajs[i].turns[k + 1].action_span[0]]  # type: ignore[index]
                assert len(obs) > 0 and nxt == contexts[j] + outs[j] + obs
    for t in trajs:  # the loss mask: exactly the generated tokens are policy tokens
        assert t.loss_mask is not None and len(t.loss_mask) == len(t.token_ids or [])
        pol = [p for s_, e_ in (tu.action_span for tu in t.turns if tu.action_span is not None) for p in range(s_, e_)]
        assert [k for k, v in enumerate(t.loss_mask) if v] == pol


def test_eval_uses_the_eval_split_and_the_threshold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tr = Trainer(rollout_cfg(tmp_path / "run", ["rollout.max_turns=1", "env.kwargs={max_turns: 1}"]))
    seen: list[tuple[Any, list[int], list[Trajectory]]] = []
    orig = tr.source.rollouts

    def spy(venv: Any, idx: Any, params: Any, seed_base: int, gen: Any) -> Any:
        trajs, st = orig(venv, idx, params, seed_base, gen)
        seen.append((params, list(idx), trajs))
        return trajs, st

    monkeypatch.setattr(tr.source, "rollouts", spy)
    res = tr.evaluate(0)
    assert res["num_tasks"] == 3
    assert [p.temperature for p, _, _ in seen] == [0.0, tr.cfg.eval.temperature]
    for _, _, trajs in seen:
        ids = [t.task.id for t in trajs]
        assert ids == ["test-0", "test-1", "test-2"], ids  # the eval split, its first num_tasks, each once
        want = sum(t.reward >= 1.0 - 1e-6 for t in trajs) / len(trajs)
        assert res["success_greedy" if trajs is seen[0][2] else "success_sampled"] == pytest.approx(want)
    # the threshold itself
    assert SUCCESS_THRESHOLD == 1.0 - 1e-6

    def traj(r: float) -> Trajectory:
        return Trajectory(task=Task("t", "q"), prompt="", reward=r)

    assert is_success(traj(SUCCESS_THRESHOLD)) and is_success(traj(1.0))
    assert not is_success(traj(math.nextafter(SUCCESS_THRESHOLD, 0.0)))
    st = episode_stats([traj(SUCCESS_THRESHOLD), traj(math.nextafter(SUCCESS_THRESHOLD, 0.0)), traj(0.0),
                        traj(1.0)])
    assert st["success_rate"] == 0.5
    assert st["reward_std"] == pytest.approx(float(np.std([SUCCESS_THRESHOLD, SUCCESS_THRESHOLD, 0.0, 1.0])), abs=1e-6)


def test_sft_loss_is_token_mean_ce_on_policy_tokens() -> None:
    from rlf_train.policy.model import build_tiny_model
    from rlf_train.policy.tokenizer import load_tokenizer

    cfg = load_config(None, ["model.tiny.hidden_size=16", "model.tiny.intermediate_size=32", "model.tiny.num_layers=1"])
    tok = load_tokenizer(cfg.model)
    model = build_tiny_model(cfg.model, len(tok), 0, tok.pad_token_id)
    a = Trajectory(task=Task("a", "q"), prompt="", token_ids=[5, 6, 7, 8, 9], loss_mask=[0, 0, 1, 1, 0])
    b = Trajectory(task=Task("b", "q"), prompt="", token_ids=[10, 11, 12], loss_mask=[0, 1, 1])
    loss, n = sft_loss(model, [a, b], tok.pad_token_id)
    assert n == 4
    ce = []
    with torch.no_grad():
        for t in (a, b):
            ids = torch.tensor([t.token_ids])
            lp = torch.log_softmax(model(input_ids=ids[:, :-1]).logits[0].double(), -1)
            ce += [-float(lp[p, t.token_ids[p + 1]]) for p in range(len(t.token_ids) - 1)  # type: ignore[index]
                   if t.loss_mask[p + 1]]  # type: ignore[index]
    assert loss.item() == pytest.approx(sum(ce) / 4, rel=1e-5)


def test_resume_restores_optimizer_and_scheduler(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    extra = ["rollout.max_turns=1", "env.kwargs={max_turns: 1}", "logging.save_every=1", "optim.warmup_steps=5",
             "eval.sampled=false", "eval.num_tasks=1", "optim.lr=1e-2"]
    full = tmp_path / "full"
    Trainer(rollout_cfg(full, [*extra, "algorithm.steps=3"])).run()
    part = tmp_path / "part"
    Trainer(rollout_cfg(part, [*extra, "algorithm.steps=2"])).run()
    capsys.readouterr()
    # the resumed run's progress (plain lines when stdout is no terminal) continues at step 2 of 3
    Trainer(rollout_cfg(part, [*extra, "algorithm.steps=3", "logging.progress=true"]), resume=True).run()
    lines = [x.split(" | ")[0].split(" ") for x in capsys.readouterr().out.splitlines() if x.startswith("GRPO ")]
    assert [x[:3] for x in lines] == [["GRPO", "3/3", "(100%)"]], lines
    # the checkpoint saved mid-run (logging.save_every: full's step_2) holds the same state as the one saved at
    # the end of a run (part's step_2, where the resumed run started)
    from tests.train.test_update_spec import assert_same_checkpoint

    assert_same_checkpoint(full / "checkpoints" / "step_2", part / "checkpoints" / "step_2")
    _, sa = read_checkpoint(full / "checkpoints" / "step_3")
    _, sb = read_checkpoint(part / "checkpoints" / "step_3")
    oa, ob = sa["optimizer"], sb["optimizer"]
    assert oa["param_groups"] == ob["param_groups"]  # lr, betas, ... at step 3
    # LambdaLR warmup lr * min(1, (s + 1) / warmup): after 3 steps the LR set for the 4th, 4/5 of lr
    assert oa["param_groups"][0]["lr"] == pytest.approx(1e-2 * 4 / 5)
    assert sa["scheduler"] == sb["scheduler"] and sa["scheduler"]["last_epoch"] == 3
    assert oa["state"].keys() == ob["state"].keys() and oa["state"]
    for k in oa["state"]:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(oa["state"][k][name], ob["state"][k][name]), (k, name)
    assert float(oa["state"][0]["step"]) == 3  # one optimizer step per RL step here
    nonzero = [bool(oa["state"][k]["exp_avg_sq"].abs().sum() > 0) for k in oa["state"]]
    assert any(nonzero)


def test_group_layout_check() -> None:
    from rlf_train.grpo import check_groups

    check_groups(["a", "a", "b", "b"], 2)
    check_groups(["a", "a", "a", "a"], 2)  # the same prompt drawn twice in a row is two valid groups
    with pytest.raises(RuntimeError, match=r"groups \[0, 1\] mix tasks"):
        check_groups(["a", "b", "a", "b"], 2)  # interleaved: samples of one prompt spread over groups
    with pytest.raises(RuntimeError, match="5 rows, group size 2"):
        check_groups(["a", "a", "b", "b", "c"], 2)
