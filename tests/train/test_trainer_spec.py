"""The trainer's bookkeeping pinned to its specification (rlf_train.trainer), each against an independent
reference:

- token_returns: every target position carries the episode return (final reward, plus the turn rewards with
  per-turn rewards on); with per-turn rewards, the targets of turn k's action tokens (target t = token t + 1)
  carry the return-to-go from turn k (final reward + turn rewards k..end); episode returns = the totals.
- episode_stats / is_success: each logged statistic is its plain definition over the episodes (success =
  reward >= SUCCESS_THRESHOLD), zeros for an empty batch.
- the prompt order: epochs over the train tasks, each epoch a fresh seeded permutation; the same seed gives
  the same order; the data state saved in a checkpoint continues the order exactly (resume).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rlf_envs.records import SUCCESS_THRESHOLD
from rlf_envs.types import Action, ActionKind, Task, Trajectory, Turn
from rlf_train.grpo import token_returns
from rlf_train.rollout.batch import episode_stats, is_success
from rlf_train.trainer import Trainer
from tests.train.test_grpo_spec import spec_cfg


def random_traj(rng: random.Random, T: int) -> Trajectory:
    n = rng.randrange(2, T + 4)  # some longer than T: positions past T are cut
    t = Trajectory(task=Task("t", "q"), prompt="", token_ids=[rng.randrange(5, 50) for _ in range(n)],
                   loss_mask=[0] * n, reward=rng.choice([0.0, 1.0, 0.25, -0.5]))
    pos = rng.randrange(0, 2)  # the first action may start at token 0 (no prompt)
    while pos < n:
        if rng.random() < 0.2:
            span = None
        else:
            e = min(n, pos + rng.randrange(1, 4))
            span = (pos, e)
            for p in range(pos, e):
                t.loss_mask[p] = 1  # type: ignore[index]
            pos = e
        t.turns.append(Turn(action=Action(ActionKind.ANSWER, ""), reward=rng.choice([0.0, 0.0, 0.1, -0.3]),
                            action_span=span))
        pos += rng.randrange(1, 3)  # an observation
    return t


def reference_returns(trajs: list[Trajectory], T: int, per_turn: bool) -> tuple[np.ndarray, np.ndarray]:
    ret = np.zeros((len(trajs), T))
    ep = np.zeros(len(trajs))
    for i, tr in enumerate(trajs):
        turn_r = [u.reward for u in tr.turns] if per_turn else [0.0] * len(tr.turns)
        ep[i] = tr.reward + sum(turn_r)
        ret[i, :] = ep[i]
        for k, u in enumerate(tr.turns):
            if u.action_span is None:
                continue
            togo = tr.reward + sum(turn_r[k:])
            for p in range(*u.action_span):  # token p is the target of position p - 1
                if 1 <= p <= T:
                    ret[i, p - 1] = togo
    return ret, ep


@pytest.mark.parametrize("per_turn", [False, True])
def test_token_returns(per_turn: bool) -> None:
    rng = random.Random(4)
    T = 9
    trajs = [random_traj(rng, T) for _ in range(40)]
    assert sum(any(u.reward for u in t.turns) for t in trajs) > 10
    ret, ep = token_returns(trajs, T, per_turn)
    want_ret, want_ep = reference_returns(trajs, T, per_turn)
    assert ret.shape == (40, T) and ep.shape == (40,)
    np.testing.assert_allclose(ep.numpy(), want_ep, rtol=0, atol=1e-6)
    np.testing.assert_allclose(ret.numpy(), want_ret, rtol=0, atol=1e-6)


def test_episode_stats_are_their_definitions() -> None:
    rng = random.Random(1)
    trajs = []
    for k in range(7):
        t = random_traj(rng, 8)
        t.reward = [SUCCESS_THRESHOLD, np.nextafter(SUCCESS_THRESHOLD, 0.0), 1.0, 0.0, 0.5, 2.0, -1.0][k]
        t.turns[0].stats.calls = [0, 2, 1, 0, 3, 0, 1][k]  # tool calls / errors: summed over the turns
        t.turns[-1].stats.calls += [0, 0, 0, 0, 1, 0, 0][k]
        t.turns[0].stats.errors = [0, 1, 0, 0, 2, 0, 0][k]
        t.answer = None if k in (1, 4) else "x"
        trajs.append(t)
    trajs[3].token_ids = None
    trajs[3].loss_mask = None
    assert [is_success(t) for t in trajs] == [True, False, True, False, False, True, False]
    r = np.array([t.reward for t in trajs])
    want = {
        "reward_mean": r.mean(), "reward_std": r.std(), "success_rate": 3 / 7, "turns_mean": np.mean(
            [len(t.turns) for t in trajs]),
        "tool_calls_mean": 8 / 7, "tool_errors_mean": 3 / 7, "search_rate": 4 / 7, "answered_rate": 5 / 7,
        "tokens_total_mean": np.mean([len(t.token_ids or []) for t in trajs]),
        "tokens_policy_mean": np.mean([sum(t.loss_mask or []) for t in trajs]),
        "invalid_turns_mean": np.mean([sum(u.stats.invalid for u in t.turns) for t in trajs]),
        "unknown_tool_calls_mean": np.mean([sum(u.stats.unknown_tools for u in t.turns) for t in trajs]),
        # the reward of the episodes without a tool call (k = 0, 3, 5): reward earned without the tools
        "zero_tool_reward_mean": np.mean([trajs[k].reward for k in (0, 3, 5)]),
    }
    got = episode_stats(trajs)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(float(v), rel=1e-12, abs=1e-12), k
    # no episode: every rate 0, and no reward-without-tools mean (there is no such episode)
    assert episode_stats([]) == dict.fromkeys([k for k in want if k != "zero_tool_reward_mean"], 0.0)
    one = episode_stats(trajs[:1])  # rates over one episode
    assert one["success_rate"] == 1.0 and one["answered_rate"] == 1.0 and one["reward_mean"] == SUCCESS_THRESHOLD


def test_update_refuses_trajectories_out_of_prompt_order(tmp_path: Path) -> None:
    tr = Trainer(spec_cfg(tmp_path / "run"))
    tasks = tr.train_tasks
    got, want = [0, 1] * 5, [0] * 5 + [1] * 5  # 10 rows: the message shows the first 8 of each
    trajs = [Trajectory(task=tasks[i], prompt="", token_ids=[1, 2], loss_mask=[0, 1]) for i in got]
    with pytest.raises(RuntimeError) as e:
        tr.update(1, trajs, want, None, None, behaviour=False)  # type: ignore[arg-type]
    ids = [t.id for t in tasks]
    assert str(e.value) == (f"rollout returned trajectories out of prompt order (tasks {[ids[i] for i in got[:8]]}"
                            f"..., expected {[ids[i] for i in want[:8]]}...): GRPO groups would mix prompts")


def test_group_check_names_the_mixed_groups() -> None:
    from rlf_train.grpo import check_groups

    ids = ["a", "b", "c", "c", "d", "e", "f", "g", "h", "i", "j", "k"]  # groups 0, 2, 3, 4, 5 mix tasks
    msg = ("GRPO group layout broken: 12 rows, group size 2, groups [0, 2, 3, 4] mix tasks ([['a', 'b'], "
           "['d', 'e']]): advantages would compare samples of different prompts")
    with pytest.raises(RuntimeError) as e:
        check_groups(ids, 2)
    assert str(e.value) == msg


def test_prompt_order_is_seeded_epochs_and_resumes(tmp_path: Path) -> None:
    tr = Trainer(spec_cfg(tmp_path / "a"))
    n = len(tr.train_tasks)
    assert n >= 3
    first = tr._next_tasks(n + 1) + tr._next_tasks(2 * n - 1)  # draws that straddle epoch boundaries
    for e in range(3):
        assert sorted(first[e * n:(e + 1) * n]) == list(range(n)), "each epoch visits every task once"
    assert len({tuple(first[e * n:(e + 1) * n]) for e in range(3)}) == 3, "each epoch reshuffles"
    saved = tr._data_state()
    py, torch_rng, gen = random.getstate(), torch.get_rng_state(), tr.gen.get_state()
    cont = tr._next_tasks(2 * n + 1)
    draws = (random.random(), float(torch.rand(1)), float(torch.rand(1, generator=tr.gen)))
    tr2 = Trainer(spec_cfg(tmp_path / "b"))
    assert tr2._next_tasks(3 * n) == first  # the same seed: the same order
    tr2._restore_rng({**saved, "python_rng": py, "torch_rng": torch_rng, "gen": gen})
    assert tr2._next_tasks(2 * n + 1) == cont  # resumed: continues where the saved state was
    assert (random.random(), float(torch.rand(1)), float(torch.rand(1, generator=tr2.gen))) == draws
    other = Trainer(spec_cfg(tmp_path / "c", ["seed=6"]))
    assert other._next_tasks(3 * n) != first


@pytest.mark.parametrize("warm", [0, 2])
def test_rl_stage_optimizer_scheduler_and_reference(tmp_path: Path, warm: int) -> None:
    """AdamW with the configured betas / weight decay / LR, the LR after step k = lr * min(1, (k + 1) / warmup)
    (lr without warmup), a frozen reference exactly when kl_coef > 0, the env hook called with the train envs."""
    import json

    from tests.train.test_rollout_spec import rollout_cfg

    kl = 0.5 if warm else 0.0
    cfg = rollout_cfg(tmp_path / "run", ["rollout.max_turns=1", "env.kwargs={max_turns: 1}", "algorithm.steps=3",
                                         f"optim.warmup_steps={warm}", "optim.lr=1e-2", "optim.betas=[0.8, 0.95]",
                                         "optim.weight_decay=0.3", f"algorithm.kl_coef={kl}", "eval.num_tasks=1",
                                         "eval.sampled=false", "logging.trajectories_every=2",
                                         f"algorithm.mini_batches={2 if warm else 1}", "algorithm.ppo_epochs=2"])
    tr = Trainer(cfg)
    hooked: list[object] = []
    tr.train_env_hook = hooked.append
    tr.run()
    assert hooked == [tr.train_envs]
    stored = {}  # the viewer's episodes: the train batch every `logging.trajectories_every` steps, and the evals
    for p in sorted((tmp_path / "run" / "trajectories").glob("step_*.jsonl")):
        recs = [json.loads(x) for x in p.read_text().splitlines()]
        stored[p.name] = sorted({(r["source"], r["step"]) for r in recs})
    assert stored == {"step_2.jsonl": [("train", 2)], "step_3.jsonl": [("eval_greedy", 3)]}
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("stage") == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3]
    want = [1e-2 * (min(1.0, (k + 1) / warm) if warm else 1.0) for k in (1, 2, 3)]
    assert [r["lr"] for r in rl] == pytest.approx(want, rel=1e-9)
    from rlf_train.policy.checkpoint import read_checkpoint

    _, state = read_checkpoint(tmp_path / "run" / "checkpoints" / "step_3")
    g = state["optimizer"]["param_groups"][0]
    assert tuple(g["betas"]) == (0.8, 0.95) and g["weight_decay"] == 0.3
    # one optimizer step per mini-batch per epoch per RL step
    assert float(state["optimizer"]["state"][0]["step"]) == 3 * 2 * (2 if warm else 1)
    assert (tr.ref_model is not None) is (kl > 0)
    if kl:
        assert rl[-1]["kl"] > 0.0  # the policy moved away from the frozen reference (0 at step 0: test_train_spec_grpo)
