"""`Trainer.update` / `run_rl` / `evaluate` pinned to their specification where the other spec tests leave gaps,
each against an independent reference (numpy, or a plain full-batch torch forward of a copy of the policy):

- per-turn rewards on the trainer path: with an env that pays every turn, the advantage the update trains each
  policy token with is (return-to-go of its turn - group mean of the episode returns) / (group std + eps),
  return-to-go = final reward + the turn rewards from that turn on; with `per_turn_rewards: false` the turn
  rewards are ignored (every token: the final reward's group advantage).
- mini-batches (`algorithm.mini_batches` > 1): the rows are split, in rollout order, into contiguous blocks of
  ceil(N / mini_batches); each optimizer step's gradient is the gradient of its block's loss computed in one
  piece, with the block's denominators (its policy tokens, its sequences), for every aggregation mode and
  micro-batch size, on rows of different lengths.
- the logged record of one update: `loss` = mean over optimizer steps of the step's whole loss, `entropy` =
  mean over the micro-batch forwards of their token-mean entropy, `grad_norm` = mean pre-clip gradient norm,
  `clip_frac` / `kl` = means over the micro-batches, `groups_with_signal` = share of groups whose episode
  returns are not all equal, `time_train` within the step's time; `policy_version` + 1 per update.
- resume from the final SFT checkpoint: RL starts with a fresh optimizer and scheduler (the SFT stage's are
  not carried over), and the resumed run ends bit-identical to the uninterrupted one (weights, Adam state, LR).
- eval: the eval split's first min(eval.num_tasks, split size) tasks, each once, in order, in batches of the
  eval envs; greedy (temperature 0) and sampled (eval.temperature), top-p 1, the rollout's token budget;
  success = reward >= SUCCESS_THRESHOLD exactly (the verifier pays the threshold and the float just below it).
"""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from train_envs import FirstTokenParity

from rlf_envs.env import ToolEnv
from rlf_envs.records import SUCCESS_THRESHOLD
from rlf_envs.rewards.base import Verifier
from rlf_envs.types import Score, Task, Trajectory, Turn
from rlf_train.policy.checkpoint import WEIGHTS, read_checkpoint
from rlf_train.rollout.batch import SamplingParams
from rlf_train.trainer import Trainer
from tests.train.test_grpo_spec import G, N, Step, _close, spec_cfg

PER_TURN_ID = "rlf_test/PerTurnParity-v0"
EVAL_ID = "rlf_test/EvalThreshold-v0"
TURN_REWARDS = (0.0, 0.3, -0.2)
MAX_TOTAL = 256


class TurnTextReward:
    """A per-turn (process) reward: TURN_REWARDS[len(action text) % 3]."""

    def turn_reward(self, turn: Turn) -> float:
        return TURN_REWARDS[len(turn.action.text) % 3]


class ConstantOnSomeTasks(Verifier):
    """Parity of the first token, except tasks whose index is divisible by 3: always 0.5 (groups with no signal)."""

    name = "parity_or_const"

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        if int(task.id.split("-")[1]) % 3 == 0:
            return Score(0.5)
        return await FirstTokenParity().score(trajectory, task)


def make_per_turn(split: str = "train", max_turns: int = 3, max_total_tokens: int = MAX_TOTAL,
                  max_obs_tokens: int = 32, tokenizer: Any = None) -> ToolEnv:
    """Up to `max_turns` turns (the random policy's text is an invalid action: a correction, then the next turn),
    a turn reward every turn, prompts of different lengths (rows of different lengths in a batch)."""
    tasks = [{"id": f"{split}-{i}", "question": "Say something" + " more" * (3 * i) + ".", "answers": ["x"]}
             for i in range(6)]
    return ToolEnv(tasks=tasks, verifier=ConstantOnSomeTasks(), turn_rewarder=TurnTextReward(), format="search_r1",
                   max_turns=max_turns, max_total_tokens=max_total_tokens, max_obs_tokens=max_obs_tokens,
                   tokenizer=tokenizer)


EVAL_REWARDS = (1.0, SUCCESS_THRESHOLD, math.nextafter(SUCCESS_THRESHOLD, 0.0), 0.5, 1.0, 1.0)


class RewardByTask(Verifier):
    """Eval split: EVAL_REWARDS[task index] whatever the policy says; train split: 1.0."""

    name = "by_task"

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        split, i = task.id.split("-")
        return Score(EVAL_REWARDS[int(i)] if split == "test" else 1.0)


def make_eval_env(split: str = "train", max_turns: int = 1, max_total_tokens: int = MAX_TOTAL,
                  max_obs_tokens: int = 32, tokenizer: Any = None) -> ToolEnv:
    tasks = [{"id": f"{split}-{i}", "question": f"Item {i}.", "answers": ["x"]} for i in range(6)]
    return ToolEnv(tasks=tasks, verifier=RewardByTask(), format="search_r1", max_turns=max_turns,
                   max_total_tokens=max_total_tokens, max_obs_tokens=max_obs_tokens, tokenizer=tokenizer)


for _id, _entry in ((PER_TURN_ID, make_per_turn), (EVAL_ID, make_eval_env)):
    if _id not in gymnasium.registry:
        gymnasium.register(_id, entry_point=_entry)

BASE = [f"env.id={PER_TURN_ID}", "env.imports=[]", "rollout.max_turns=3", f"rollout.max_total_tokens={MAX_TOTAL}",
        "rollout.max_new_tokens_per_turn=4"]


@pytest.fixture(scope="module")
def per_turn(tmp_path_factory: pytest.TempPathFactory) -> Any:
    run = tmp_path_factory.mktemp("spec_update") / "run"
    tr = Trainer(spec_cfg(run, BASE))
    return tr, copy.deepcopy(tr.model.state_dict()), run


def returns_to_go(t: Trajectory, per_turn: bool) -> tuple[dict[int, float], float]:
    """{target position: return-to-go of the turn whose action token it predicts}, episode return."""
    turn_r = [u.reward for u in t.turns] if per_turn else [0.0] * len(t.turns)
    out = {}
    for k, u in enumerate(t.turns):
        if u.action_span is not None:
            for p in range(*u.action_span):
                out[p - 1] = t.reward + sum(turn_r[k:])
    return out, t.reward + sum(turn_r)


def trained_advantages(s: Step) -> list[np.ndarray]:
    """The advantage rows the update passed to the loss, in row order (one epoch, one mini-batch)."""
    rows = []
    for c in s.calls:
        rows += [(a.numpy(), m.numpy()) for a, m in zip(c["adv"], c["mask"], strict=True)]
    return rows


@pytest.mark.parametrize("per_turn_on", [True, False])
def test_per_turn_rewards_are_returns_to_go_on_the_trainer_path(per_turn: Any, monkeypatch: pytest.MonkeyPatch,
                                                                per_turn_on: bool) -> None:
    eps = 0.1
    s = Step(per_turn, monkeypatch, [f"algorithm.per_turn_rewards={str(per_turn_on).lower()}",
                                     "algorithm.micro_batch_size=5", f"algorithm.eps={eps}"], ragged=False, base=BASE)
    trajs = s.trajs[0]
    # the env really pays per turn, over several turns, and not the same every turn
    assert max(len(t.turns) for t in trajs) >= 2
    assert any(len({u.reward for u in t.turns}) > 1 for t in trajs)
    for t in trajs:
        assert [u.reward for u in t.turns] == [TURN_REWARDS[len(u.action.text) % 3] for u in t.turns]
    ref = [returns_to_go(t, per_turn_on) for t in trajs]
    ep = np.array([e for _, e in ref]).reshape(-1, G)
    mean, std = ep.mean(axis=1), ep.std(axis=1, ddof=0)
    rows = trained_advantages(s)
    assert len(rows) == N
    checked = 0
    for i, ((rtg, _), (adv, mask)) in enumerate(zip(ref, rows, strict=True)):
        pos = sorted(p for p in rtg if 0 <= p < len(mask))
        assert [p for p in range(len(mask)) if mask[p]] == pos  # the loss mask: exactly the action tokens
        want = np.array([(rtg[p] - mean[i // G]) / (std[i // G] + eps) for p in pos])
        np.testing.assert_allclose(adv[pos], want, rtol=1e-5, atol=1e-6)
        checked += len(pos)
    assert checked > N
    if per_turn_on:  # some episode's tokens carry different returns-to-go: the test sees the per-turn path
        assert any(len({round(v, 9) for v in rtg.values()}) > 1 for rtg, _ in ref)


def one_piece_grad(model: torch.nn.Module, trajs: list[Trajectory], adv: list[dict[int, float]], agg: str
                   ) -> list[torch.Tensor]:
    """The specified loss of `trajs` (one mini-batch) in one piece at ratio 1 (weights = the sampling weights):
    pg = -A_t * exp(lp - sg(lp)) over the policy tokens, aggregated with this mini-batch's denominators."""
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    sums, counts = [], []
    for t, a in zip(trajs, adv, strict=True):
        ids = torch.tensor([t.token_ids], dtype=torch.long)
        logits = m(input_ids=ids[:, :-1]).logits.float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[0, :, 0]
        mask = torch.tensor(t.loss_mask[1:], dtype=torch.float32)  # type: ignore[index]
        a_t = torch.tensor([a.get(p, 0.0) for p in range(len(mask))], dtype=torch.float32)
        pg = -a_t * torch.exp(lp - lp.detach()) * mask
        sums.append(pg.sum())
        counts.append(mask.sum())
    if agg == "token_mean":
        total = sum(sums) / sum(counts)
    elif agg == "seq_mean_token_mean":
        total = sum(x / c for x, c in zip(sums, counts, strict=True)) / len(trajs)
    else:
        total = sum(sums) / (len(trajs) * MAX_TOTAL)
    total.backward()  # type: ignore[union-attr]
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in m.parameters()]


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_each_mini_batch_step_is_its_one_piece_gradient(per_turn: Any, monkeypatch: pytest.MonkeyPatch,
                                                        agg: str) -> None:
    """lr 0: the weights stay the sampling weights, so every optimizer step's gradient is at ratio 1 and can be
    compared with its block's one-piece gradient; rows of different lengths (micro-batches narrower than the
    batch); 3 blocks of 4 rows, micro-batches of 1 and 3 (crossing no block boundary: blocks are split alone)."""
    eps = 0.1
    for mb in (1, 3):
        s = Step(per_turn, monkeypatch, [f"algorithm.loss_agg={agg}", f"algorithm.micro_batch_size={mb}",
                                         "algorithm.mini_batches=3", f"algorithm.eps={eps}"], base=BASE, lr=0.0)
        trajs = s.trajs[0]
        assert len({len(t.token_ids or []) for t in trajs}) > 2  # ragged lengths: micro-batch widths differ
        ref = [returns_to_go(t, True) for t in trajs]
        ep = np.array([e for _, e in ref]).reshape(-1, G)
        mean, std = ep.mean(axis=1), ep.std(axis=1, ddof=0)
        adv = [{p: (v - mean[i // G]) / (std[i // G] + eps) for p, v in rtg.items()} for i, (rtg, _) in enumerate(ref)]
        model0 = copy.deepcopy(s.tr.model)
        model0.load_state_dict(s.weights[0])
        assert len(s.grads) == 3
        for k in range(3):
            assert all(torch.equal(v, s.weights[0][n]) for n, v in s.stepped[k].items())  # lr 0: weights unchanged
            rows = slice(4 * k, 4 * k + 4)
            _close(s.grads[k], one_piece_grad(model0, trajs[rows], adv[rows], agg))
        # the block's denominators, as passed to the loss (calls per block: ceil(4 / mb))
        per_block = -(-4 // mb)
        assert len(s.calls) == 3 * per_block
        for j, c in enumerate(s.calls):
            k = j // per_block
            assert c["kw"]["total_seqs"] == 4
            assert c["kw"]["total_tokens"] == sum(sum(t.loss_mask[1:]) for t in trajs[4 * k:4 * k + 4])  # type: ignore[index]


def entropy_ref(model: torch.nn.Module, t: Trajectory, temp: float) -> list[float]:
    """numpy: entropy of softmax(logits / temp) at each policy target position of `t` (top-p 1)."""
    with torch.no_grad():
        ids = torch.tensor([t.token_ids], dtype=torch.long)
        logits = model(input_ids=ids[:, :-1]).logits[0].double().numpy()
    out = []
    for pos, on in enumerate((t.loss_mask or [])[1:]):
        if on:
            z = logits[pos] / temp
            p = np.exp(z - z.max())
            p /= p.sum()
            out.append(float(-(p * np.log(p)).sum()))
    return out


def test_logged_record_of_an_update(per_turn: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 epochs x 2 mini-batches of 6 rows, micro-batches of 5 (blocks split 5 + 1), temperature 0.7, the
    single-row micro-batches with one policy token, per-turn rewards off, KL to a reference."""
    tr = per_turn[0]
    tr.policy_version = version = 5
    orig = tr.source.rollouts

    def one_token_rows(*a: Any, **k: Any) -> Any:
        trajs, st = orig(*a, **k)
        for t in (trajs[5], trajs[11]):
            first = t.loss_mask.index(1)  # type: ignore[union-attr]
            t.loss_mask = [int(p == first) for p in range(len(t.loss_mask))]  # type: ignore[arg-type]
        return trajs, st

    monkeypatch.setattr(tr.source, "rollouts", one_token_rows)
    t0 = time.perf_counter()
    s = Step(per_turn, monkeypatch, ["algorithm.micro_batch_size=5", "algorithm.mini_batches=2",
                                     "algorithm.ppo_epochs=2", "rollout.temperature=0.7", "optim.lr=5e-2",
                                     "algorithm.per_turn_rewards=false", "algorithm.kl_coef=0.05"],
             base=BASE, ref=True)
    wall = time.perf_counter() - t0
    assert tr.policy_version == version + 1
    rec, trajs = s.recs[0], s.trajs[0]
    assert len(s.stepped) == 4 and len(s.calls) == 8
    # loss: each optimizer step's loss is the sum of its micro-batches' shares; the record is the mean over steps
    step_losses = [float(s.calls[2 * k]["out"].loss.detach()) + float(s.calls[2 * k + 1]["out"].loss.detach())
                   for k in range(4)]
    # ... and each step's loss is its block's PPO-clip + KL loss recomputed in one piece (numpy, token mean)
    for k in range(4):
        cs = s.calls[2 * k:2 * k + 2]
        lp = np.concatenate([c["logp"][c["mask"].bool()].double().numpy() for c in cs])
        old = np.concatenate([c["old"][c["mask"].bool()].double().numpy() for c in cs])
        a = np.concatenate([c["adv"][c["mask"].bool()].double().numpy() for c in cs])
        rf = np.concatenate([c["ref"][c["mask"].bool()].double().numpy() for c in cs])
        ratio = np.exp(lp - old)
        pg = -np.minimum(ratio * a, np.clip(ratio, 0.8, 1.2) * a)
        d = rf - lp
        want = (pg.sum() + 0.05 * (np.exp(d) - d - 1).sum()) / len(lp)
        assert step_losses[k] == pytest.approx(want, rel=1e-4, abs=1e-7)
    assert rec["loss"] == pytest.approx(float(np.mean(step_losses)), rel=1e-6, abs=1e-9)
    assert rec["kl"] == pytest.approx(float(np.mean([c["out"].kl for c in s.calls])), rel=1e-9, abs=1e-12)
    assert rec["kl"] > 0
    assert rec["clip_frac"] == pytest.approx(float(np.mean([c["out"].clip_frac for c in s.calls])), rel=1e-9)
    assert rec["clip_frac"] > 0  # the second epoch moves ratios out of the trust region
    # entropy: each micro-batch's token mean of the entropy of the tempered distribution, at the weights of its step
    ents = []
    for k in range(4):
        model = copy.deepcopy(tr.model)
        model.load_state_dict(s.stepped[k])
        block = trajs[6 * (k % 2):6 * (k % 2) + 6]
        for chunk in (block[:5], block[5:]):
            vals = [x for t in chunk for x in entropy_ref(model, t, 0.7)]
            ents.append(float(np.mean(vals)))
    assert sum(trajs[5].loss_mask) == sum(trajs[11].loss_mask) == 1  # type: ignore[arg-type]
    assert rec["entropy"] == pytest.approx(float(np.mean(ents)), rel=1e-4)
    # grad norm: mean of the pre-clip norms (grad_clip 1e6: the optimizer steps with them unchanged)
    norms = [float(torch.cat([g.flatten() for g in gs]).norm()) for gs in s.grads]
    assert rec["grad_norm"] == pytest.approx(float(np.mean(norms)), rel=1e-5)
    # groups with signal: share of groups whose episode returns (final rewards here) are not all equal
    r = np.array([t.reward for t in trajs]).reshape(-1, G)
    share = float((r.std(axis=1) > 0).mean())
    assert 0 < share < 1  # a group with signal and one without (the constant task)
    assert rec["groups_with_signal"] == pytest.approx(share, rel=1e-6)
    # the step's rollout: tokens generated (every action token), its times within the step's, the step's within
    # the wall time around it
    assert rec["gen_tokens"] == sum(e - b for t in trajs for u in t.turns if u.action_span for b, e in [u.action_span])
    assert 0 < rec["time_train"] <= rec["time_step"] <= wall
    assert 0 < rec["time_generate"] <= rec["time_rollout"] and 0 < rec["time_env"] <= rec["time_rollout"]
    assert rec["time_rollout"] + rec["time_train"] <= rec["time_step"]
    assert rec["stage"] == "rl" and rec["step"] == 1


class Killed(Exception):
    """Stands for the process dying at a chosen point (in-process, so that mutation testing sees it)."""


RESUME = ["sft.enabled=true", "sft.steps=4", "sft.batch_size=2", "sft.num_demos=4", "algorithm.steps=2",
          "algorithm.kl_coef=0.05",
          "optim.warmup_steps=3", "optim.lr=1e-2", "eval.num_tasks=1", "eval.sampled=false",
          "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2"]


def assert_same_checkpoint(a: Path, b: Path) -> dict[str, Any]:
    """Meta, weights, Adam state and param groups (LR), scheduler state and the data order of two checkpoints are
    the same, bit for bit."""
    ma, sa = read_checkpoint(a)
    mb, sb = read_checkpoint(b)
    assert ma == mb
    assert (sa["order"], sa["order_pos"], sa["data_rng"]) == (sb["order"], sb["order_pos"], sb["data_rng"])
    oa, ob = sa["optimizer"], sb["optimizer"]
    assert oa["param_groups"] == ob["param_groups"]
    assert sa["scheduler"] == sb["scheduler"]
    assert oa["state"].keys() == ob["state"].keys() and oa["state"]
    for k in oa["state"]:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(oa["state"][k][name], ob["state"][k][name]), (k, name)
    wa, wb = load_file(str(a / WEIGHTS)), load_file(str(b / WEIGHTS))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    return sa


@pytest.mark.parametrize("killed_at", ["after_sft", "mid_sft"])
def test_resume_from_an_sft_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, killed_at: str) -> None:
    """A run killed after its SFT stage (latest checkpoint: the final `sft`) resumes RL with a fresh optimizer and
    scheduler; one killed mid-SFT (latest: `sft_2`) continues SFT with its optimizer and batch order. Either ends
    bit-identical to the uninterrupted run."""
    extra = [*RESUME, "logging.save_every=0" if killed_at == "after_sft" else "logging.save_every=2"]
    full, part = tmp_path / "full", tmp_path / "part"
    uninterrupted = Trainer(spec_cfg(full, extra))
    uninterrupted.run()
    orig_save = Trainer._save

    def save_then_die(self: Trainer, name: str, *a: Any, **k: Any) -> Path:
        out = orig_save(self, name, *a, **k)
        if name == "sft_2":
            raise Killed
        return out

    def killed(*_: Any) -> None:
        raise Killed

    with monkeypatch.context() as m:
        if killed_at == "after_sft":
            m.setattr(Trainer, "run_rl", killed)
        else:
            m.setattr(Trainer, "_save", save_then_die)
        with pytest.raises(Killed):
            Trainer(spec_cfg(part, extra)).run()
    ckpts = sorted(p.name for p in (part / "checkpoints").iterdir() if p.is_dir())
    meta, state = read_checkpoint(part / "checkpoints" / ckpts[-1])
    if killed_at == "after_sft":
        assert ckpts == ["sft"], ckpts
        assert (meta.stage, meta.sft_done, state["optimizer"], state["scheduler"]) == ("sft", True, None, None)
    else:
        assert ckpts == ["sft_2"], ckpts
        assert (meta.stage, meta.step, meta.sft_done, state["scheduler"]) == ("sft", 2, False, None)
        assert state["optimizer"]["state"] and state["sft_rng"] is not None
    resumed = Trainer(spec_cfg(part, extra), resume=True)
    resumed.run()
    wa, wb = (load_file(str(d / "checkpoints" / "sft" / WEIGHTS)) for d in (full, part))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # mid-SFT: SFT went on from step 2 as if never stopped
    # the KL reference is the policy RL started from, the SFT weights, in the resumed run too (not a fresh init)
    for tr in (uninterrupted, resumed):
        assert tr.ref_model is not None
        ref = tr.ref_model.state_dict()
        assert all(torch.equal(ref[k], v) for k, v in wa.items() if k in ref) and wa.keys() & ref.keys()
    sa = assert_same_checkpoint(full / "checkpoints" / "step_2", part / "checkpoints" / "step_2")
    assert sa["optimizer"]["param_groups"][0]["lr"] == pytest.approx(1e-2)  # the LR set for step 3: warmup done
    assert sa["scheduler"]["last_epoch"] == 2
    assert float(sa["optimizer"]["state"][0]["step"]) == 2  # RL's own optimizer: 2 steps, not SFT's 4 on top
    # the checkpoint is a self-contained model dir: the run's tokenizer is saved with it
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(part / "checkpoints" / "step_2"))
    text = "Say something about train item 3."
    assert tok(text)["input_ids"] == resumed.tokenizer(text)["input_ids"] and len(tok) == len(resumed.tokenizer)


def test_resume_after_the_last_step_only_adds_a_missing_final_eval(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed between the final checkpoint and the final eval: the resumed run trains no more and records the final
    eval once; resuming the finished run again changes nothing."""
    extra = ["algorithm.steps=2", "eval.before_rl=false", "eval.num_tasks=1", "eval.sampled=false",
             "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2"]
    run = tmp_path / "run"
    orig_eval = Trainer.evaluate

    def die_at_final_eval(self: Trainer, step: int) -> dict[str, Any]:
        if step == 2:
            raise Killed
        return orig_eval(self, step)

    with monkeypatch.context() as m:
        m.setattr(Trainer, "evaluate", die_at_final_eval)
        with pytest.raises(Killed):
            Trainer(spec_cfg(run, extra)).run()
    assert not (run / "eval.json").exists()
    rl_rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["stage"] == "rl"]
    assert [r["step"] for r in rl_rows] == [1, 2]
    for _ in range(2):
        Trainer(spec_cfg(run, extra), resume=True).run()
        evals = json.loads((run / "eval.json").read_text())["evals"]
        assert [e["step"] for e in evals] == [2]
        rows = list(map(json.loads, (run / "metrics.jsonl").read_text().splitlines()))
        assert [r["step"] for r in rows if r["stage"] == "rl"] == [1, 2]
        assert [r["step"] for r in rows if r["stage"] == "eval"] == [2]


def test_eval_split_order_batches_and_threshold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eval envs batch 2 tasks; 4 of the split's 6 tasks; the verifier pays 1, the threshold, the float below it,
    0.5: success 2/4 exactly (train tasks would all pay 1)."""
    cfg = spec_cfg(tmp_path / "run", [f"env.id={EVAL_ID}", "env.imports=[]", "eval.num_tasks=4",
                                      "rollout.batch_size=2", "eval.sampled=true", "eval.temperature=0.7",
                                      "rollout.max_new_tokens_per_turn=3", "rollout.temperature=1.3",
                                      "rollout.top_p=0.8", "logging.trajectories=-1"])
    tr = Trainer(cfg)
    assert tr.eval_envs().num_envs == 2
    seen: list[tuple[Any, list[int], int, list[Trajectory]]] = []
    orig = tr.source.rollouts

    def spy(venv: Any, idx: Any, params: Any, seed_base: int, gen: Any) -> Any:
        assert venv is tr.eval_envs()
        trajs, st = orig(venv, idx, params, seed_base, gen)
        seen.append((params, list(idx), seed_base, trajs))
        return trajs, st

    monkeypatch.setattr(tr.source, "rollouts", spy)
    res = tr.evaluate(7)
    assert [(i, sb) for _, i, sb, _ in seen] == [([0, 1], 0), ([2, 3], 2)] * 2
    assert [p for p, _, _, _ in seen] == [SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=3)] * 2 + [
        SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=3)] * 2
    for k in range(0, 4, 2):
        ids = [t.task.id for t in seen[k][3] + seen[k + 1][3]]
        assert ids == ["test-0", "test-1", "test-2", "test-3"]
        assert [t.reward for t in seen[k][3] + seen[k + 1][3]] == list(EVAL_REWARDS[:4])
    assert set(res) == {"step", "num_tasks", "greedy", "success_greedy", "sampled", "success_sampled"}
    assert (res["step"], res["num_tasks"]) == (7, 4)
    for mode in ("greedy", "sampled"):
        assert res[f"success_{mode}"] == 0.5 and res[mode]["success_rate"] == 0.5
        assert res[mode]["reward_mean"] == pytest.approx(float(np.mean(EVAL_REWARDS[:4])), rel=1e-12)
        stored = [json.loads(x) for x in (tmp_path / "run" / "trajectories" / "step_7.jsonl").read_text().splitlines()
                  if json.loads(x)["source"] == f"eval_{mode}"]
        assert len(stored) == 4 and {r["step"] for r in stored} == {7}
    # more tasks asked than the split has: the whole split, once
    tr.cfg = spec_cfg(tmp_path / "run", [f"env.id={EVAL_ID}", "env.imports=[]", "eval.num_tasks=50",
                                         "eval.sampled=false", "rollout.batch_size=2"])
    seen.clear()
    res = tr.evaluate(8)
    assert res["num_tasks"] == 6 and [i for _, i, _, _ in seen] == [[0, 1], [2, 3], [4, 5]]
    assert res["success_greedy"] == pytest.approx(4 / 6) and "sampled" not in res
    # the same eval samples at every eval (a fixed generator), and greedy turned off
    tr.cfg = spec_cfg(tmp_path / "run", [f"env.id={EVAL_ID}", "env.imports=[]", "eval.num_tasks=2",
                                         "eval.greedy=false", "eval.sampled=true", "rollout.batch_size=2"])
    seen.clear()
    a = tr.evaluate(9)
    b = tr.evaluate(10)
    assert set(a) == {"step", "num_tasks", "sampled", "success_sampled"}
    assert [t.token_ids for t in seen[0][3]] == [t.token_ids for t in seen[1][3]]
    assert a["sampled"] == b["sampled"]


def test_token_mean_denominator_counts_every_policy_target(per_turn: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows whose action starts right after a one-token prompt (target 0 is a policy token): the token-mean
    denominator is every policy target of the mini-batch, that first one included."""
    import rlf_train.trainer as trainer_mod
    from rlf_envs.types import Action, ActionKind

    tr, init, run = per_turn
    tr.cfg = spec_cfg(run, [*BASE, "algorithm.micro_batch_size=4", "algorithm.loss_agg=token_mean"])
    tr.model.load_state_dict(init)
    trajs, idx = [], []
    for i in range(N):
        n = 4 + i % 3
        mask = [0] + [1] * (n - 2) + [0] if i % 2 else [0, 0] + [1] * (n - 2)
        first = mask.index(1)
        trajs.append(Trajectory(task=tr.train_tasks[i // G], prompt="", token_ids=[5 + (7 * i + 3 * k) % 40 for k in
                                                                                 range(n)],
                                loss_mask=mask, reward=float(i % 3) / 2,
                                turns=[Turn(action=Action(ActionKind.ANSWER, ""), action_span=(first, first + n - 2))]))
        idx.append(i // G)
    seen: list[float] = []
    orig = trainer_mod.policy_loss

    def spy(*a: Any, **k: Any) -> Any:
        seen.append(k["total_tokens"])
        return orig(*a, **k)

    monkeypatch.setattr(trainer_mod, "policy_loss", spy)
    opt = torch.optim.AdamW(tr.model.parameters(), lr=1e-3)
    tr.update(1, trajs, idx, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), behaviour=False)
    want = float(sum(sum(t.loss_mask[1:]) for t in trajs))  # type: ignore[index]
    assert want > sum(sum(t.loss_mask[2:]) for t in trajs)  # type: ignore[index]
    assert seen == [want] * 3


def test_behaviour_logprobs_layout_and_errors(per_turn: Any) -> None:
    """`Trainer.behaviour_logprobs` (the async loss's mu): each turn's recorded log-probs at the targets of its
    action tokens (target t = token t + 1), 0 elsewhere, past a turn without tokens too; fewer recorded log-probs
    than action tokens, or a policy token outside every action span, is a RuntimeError naming the episode."""
    from rlf_envs.types import Action, ActionKind

    tr = per_turn[0]
    act = Action(ActionKind.ANSWER, "")

    def traj(mask: list[int], *turns: tuple[tuple[int, int] | None, list[float] | None]) -> Trajectory:
        return Trajectory(task=Task("t", "q"), prompt="", token_ids=list(range(5, 5 + len(mask))), loss_mask=mask,
                          turns=[Turn(action=act, action_span=sp, behaviour_logprobs=lp) for sp, lp in turns])

    # tokens 0-1 prompt | 2-4 action | a turn without tokens | 5-6 observation | 7-8 action (one log-prob extra)
    a = traj([0, 0, 1, 1, 1, 0, 0, 1, 1], ((2, 5), [-0.1, -0.2, -0.3]), (None, None), ((7, 9), [-0.4, -0.5, -9.0]))
    b = traj([0, 1, 1, 0], ((1, 3), [-0.6, -0.7]))  # a one-token prompt: target 0 is a policy token
    out = tr.behaviour_logprobs([a, b], 8)
    want = np.zeros((2, 8))
    want[0, 1:4], want[0, 6:8], want[1, 0:2] = [-0.1, -0.2, -0.3], [-0.4, -0.5], [-0.6, -0.7]
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=1e-7)
    assert out.shape == (2, 8) and out.dtype == torch.float32
    short = traj([0, 0, 1, 1, 1], ((2, 5), [-0.1]))
    none = traj([0, 0, 1, 1, 0, 1], ((2, 4), [-0.1, -0.2]), ((5, 6), None))
    msg = "behaviour log-probs recorded for {} action tokens (the async rollout records one per sampled token)"
    with pytest.raises(RuntimeError) as e:
        tr.behaviour_logprobs([a, short], 8)
    assert str(e.value) == "episode 1 turn 0: 1 " + msg.format(3)
    with pytest.raises(RuntimeError) as e:
        tr.behaviour_logprobs([none, a], 8)
    assert str(e.value) == "episode 0 turn 1: 0 " + msg.format(1)
    # a policy token in no span: the last token, the one right after an action, token 1 (after a one-token prompt)
    for k, stray in enumerate([traj([0, 0, 1, 1, 1, 0, 0, 0, 1], ((2, 5), [-0.1, -0.2, -0.3])),
                               traj([0, 0, 1, 1, 1, 1, 0], ((2, 5), [-0.1, -0.2, -0.3])),
                               traj([0, 1, 0, 1, 1], ((3, 5), [-0.1, -0.2]))]):
        with pytest.raises(RuntimeError) as e:
            tr.behaviour_logprobs([b, stray], 8)
        assert str(e.value) == "episode 1: a policy token lies outside every turn's action span", k


def test_kl_reference_without_an_sft_checkpoint(tmp_path: Path) -> None:
    """SFT on but 0 steps (no `sft` checkpoint is written): the reference is the initial policy, also in the run
    resumed from its RL checkpoint (not the resumed weights)."""
    extra = ["sft.enabled=true", "sft.steps=0", "algorithm.kl_coef=0.1", "eval.num_tasks=1", "eval.before_rl=false"]
    tr = Trainer(spec_cfg(tmp_path / "run", [*extra, "algorithm.steps=1"]))
    init = copy.deepcopy(tr.model.state_dict())
    tr.run()
    assert not (tmp_path / "run" / "checkpoints" / "sft").exists()
    resumed = Trainer(spec_cfg(tmp_path / "run", [*extra, "algorithm.steps=2"]), resume=True)
    assert not all(torch.equal(v, init[k]) for k, v in resumed.model.state_dict().items())  # it did train
    resumed.run()
    for t in (tr, resumed):
        assert t.ref_model is not None
        assert all(torch.equal(v, init[k]) for k, v in t.ref_model.state_dict().items())


def test_periodic_eval_its_record_and_the_progress_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """eval.every 2 over 3 steps: evals at step 2 and at the end (3), each once; eval.json's `latest` is the last;
    the metrics row of an eval holds its success rates, mean rewards and search rates; the console line names the
    success rates; each RL step's progress line shows its reward, success and search rates."""
    run = tmp_path / "run"
    Trainer(spec_cfg(run, ["algorithm.steps=3", "eval.every=2", "eval.before_rl=false", "eval.sampled=true",
                           "eval.num_tasks=2", "logging.progress=true", "rollout.prompts_per_step=2",
                           "rollout.samples_per_prompt=2", "logging.save_every=0"])).run()
    out = capsys.readouterr().out.splitlines()
    ev = json.loads((run / "eval.json").read_text())
    assert [e["step"] for e in ev["evals"]] == [2, 3] and ev["latest"] == ev["evals"][-1]
    rows = list(map(json.loads, (run / "metrics.jsonl").read_text().splitlines()))
    erows = [r for r in rows if r["stage"] == "eval"]
    assert [r["step"] for r in erows] == [2, 3]
    for r, e in zip(erows, ev["evals"], strict=True):
        assert r == {"stage": "eval", "step": e["step"], **{f"{k}_{m}": (e[f"success_{m}"] if k == "success" else
                                                                          e[m][{"reward": "reward_mean",
                                                                                "search_rate": "search_rate"}[k]])
                                                            for m in ("greedy", "sampled")
                                                            for k in ("success", "reward", "search_rate")}}
        line = f"[eval step {e['step']}] success_greedy={e['success_greedy']:.3f} success_sampled=" \
               f"{e['success_sampled']:.3f}"
        assert line in out
    rl = [r for r in rows if r["stage"] == "rl"]
    grpo = [x for x in out if x.startswith("GRPO ")]
    assert len(grpo) == 3
    for r, x in zip(rl, grpo, strict=True):
        assert x.startswith(f"GRPO {r['step']}/3 ")
        uses = "search" if "Search" in PER_TURN_ID else "tool use"  # the column names what the share counts
        assert x.endswith(f" | reward {r['reward_mean']:.3f} success {r['success_rate']:.2f} "
                          f"{uses} {r['search_rate']:.2f}")
