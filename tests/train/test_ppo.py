"""PPO with a critic on the local backend (`algorithm.name: ppo`, `rlf_train.ppo`): GAE over the policy's tokens with
per-turn rewards at turn ends and the observations skipped, checked against hand-computed values; the clipped value
loss; the trainer path with a value head and with a separate critic (the value learns the reward, the run resumes
bit-identically, the bundle's reward -> GAE chain replays); the same YAML mapped to OpenRLHF's flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_envs import spec_cfg

from rlf_envs.types import Action, ActionKind, Task, Trajectory, Turn
from rlf_train.config import ConfigError, load_config
from rlf_train.ppo import gae, token_rewards, value_loss, whiten
from rlf_train.replay import replay_bundle
from rlf_train.trainer import Trainer


def test_gae_skips_observations_by_hand() -> None:
    """Policy tokens at target positions 1, 2 and 4 (position 3 is an observation token): rewards 0.5 at 2 (the first
    turn's end) and 1.0 at 4 (the outcome), values 0.2, 0.4, 0.6, gamma 0.9, lambda 0.8."""
    mask = torch.tensor([[0, 1, 1, 0, 1, 0]], dtype=torch.float32)
    rewards = torch.tensor([[0, 0, 0.5, 0, 1.0, 0]])
    values = torch.tensor([[9.0, 0.2, 0.4, 9.0, 0.6, 9.0]])  # 9.0 off the mask must never be read
    adv, ret = gae(rewards, values, mask, 0.9, 0.8)
    d4 = 1.0 + 0.9 * 0.0 - 0.6  # the last policy token: V after it is 0
    d2 = 0.5 + 0.9 * 0.6 - 0.4  # the next decision is position 4, across the observation
    d1 = 0.0 + 0.9 * 0.4 - 0.2
    a4 = d4
    a2 = d2 + 0.9 * 0.8 * a4
    a1 = d1 + 0.9 * 0.8 * a2
    assert adv[0].tolist() == pytest.approx([0, a1, a2, 0, a4, 0])
    assert ret[0].tolist() == pytest.approx([0, a1 + 0.2, a2 + 0.4, 0, a4 + 0.6, 0])
    # gamma = lambda = 1: the advantage is the reward-to-go minus the value
    adv1, ret1 = gae(rewards, values, mask, 1.0, 1.0)
    assert adv1[0, [1, 2, 4]].tolist() == pytest.approx([1.5 - 0.2, 1.5 - 0.4, 1.0 - 0.6])
    assert ret1[0, [1, 2, 4]].tolist() == pytest.approx([1.5, 1.5, 1.0])


def _traj(mask: list[int], spans: list[tuple[int, int]], turn_rewards: list[float], reward: float) -> Trajectory:
    turns = [Turn(action=Action(ActionKind.TOOL_CALLS, "x"), action_span=s, reward=r)
             for s, r in zip(spans, turn_rewards, strict=True)]
    return Trajectory(task=Task("t", "q"), prompt="p", turns=turns, token_ids=list(range(len(mask))), loss_mask=mask,
                      reward=reward)


def test_token_rewards_sit_at_turn_ends_and_the_outcome_at_the_last_policy_token() -> None:
    # tokens 0-1 prompt, 2-3 turn 1, 4 observation, 5-7 turn 2: targets t predict token t + 1
    tr = _traj([0, 0, 1, 1, 0, 1, 1, 1], [(2, 4), (5, 8)], [0.25, -0.5], 1.0)
    r = token_rewards([tr], 7, per_turn=True)
    assert r[0].tolist() == pytest.approx([0, 0, 0.25, 0, 0, 0, -0.5 + 1.0])
    assert token_rewards([tr], 7, per_turn=False)[0].tolist() == pytest.approx([0, 0, 0, 0, 0, 0, 1.0])


def test_value_loss_clips_the_update_around_the_old_value() -> None:
    mask = torch.ones((1, 2))
    old = torch.tensor([[0.0, 0.0]])
    ret = torch.tensor([[1.0, -1.0]])
    v = torch.tensor([[0.5, 0.5]])  # moved 0.5 from old; clip 0.2 -> clipped values 0.2, 0.2
    got = value_loss(v, old, ret, mask, clip=0.2, agg="token_mean", total_tokens=2.0, total_seqs=1, norm_len=2)
    # per token 0.5 * max((v - R)^2, (v_clip - R)^2): max(0.25, 0.64) and max(2.25, 1.44)
    assert float(got) == pytest.approx(0.5 * (0.64 + 2.25) / 2)
    plain = value_loss(v, old, ret, mask, clip=0.0, agg="token_mean", total_tokens=2.0, total_seqs=1, norm_len=2)
    assert float(plain) == pytest.approx(0.5 * (0.25 + 2.25) / 2)
    w = whiten(torch.tensor([[1.0, 2.0, 3.0, 9.0]]), torch.tensor([[1, 1, 1, 0]]))
    assert w[0, :3].mean() == pytest.approx(0.0, abs=1e-6) and w[0, :3].std() == pytest.approx(1.0)
    assert w[0, 3] == 0


PPO = ["algorithm.name=ppo", "algorithm.kl_coef=0", "optim.lr=1e-2"]


def _rl(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("stage") == "rl"]


@pytest.mark.parametrize("critic", ["value_head", "separate"])
def test_the_critic_learns_the_reward(tmp_path: Path, critic: str) -> None:
    """On Parity (one turn, outcome reward 0/0.5/1) the value starts at 0 and moves toward the mean reward."""
    Trainer(spec_cfg(tmp_path / "run", [*PPO, f"algorithm.critic={critic}", "algorithm.steps=12",
                                        "algorithm.critic_lr=5e-2"])).run()
    rl = _rl(tmp_path / "run")
    assert len(rl) == 12 and all(k in rl[0] for k in ("value_loss", "value_mean", "explained_variance"))
    assert rl[0]["value_mean"] == 0.0  # a zero-initialised head
    late = sum(r["value_mean"] for r in rl[-3:]) / 3
    reward = sum(r["reward_mean"] for r in rl) / len(rl)
    assert abs(late - reward) < abs(0.0 - reward) * 0.6, (late, reward)
    assert rl[-1]["value_loss"] < rl[0]["value_loss"]


def test_a_ppo_run_resumes_bit_identically_and_its_bundle_replays(tmp_path: Path) -> None:
    extra = [*PPO, "algorithm.critic=separate", "logging.replay_every=1"]
    full = tmp_path / "full"
    Trainer(spec_cfg(full, [*extra, "algorithm.steps=3"])).run()
    part = tmp_path / "part"
    Trainer(spec_cfg(part, [*extra, "algorithm.steps=2"])).run()
    Trainer(spec_cfg(part, [*extra, "algorithm.steps=3"]), resume=True).run()
    volatile = {k for k in _rl(full)[0] if k.startswith("time_")}
    assert [{k: v for k, v in r.items() if k not in volatile} for r in _rl(full)] == \
        [{k: v for k, v in r.items() if k not in volatile} for r in _rl(part)]
    wa = load_file(str(full / "checkpoints" / "step_3" / "model.safetensors"))
    wb = load_file(str(part / "checkpoints" / "step_3" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    rep = replay_bundle(full / "replay" / "step_000002")
    assert rep.exact, rep.divergence
    assert [s for s, _ in rep.checked] == ["loss mask", "token rewards", "value targets", "advantages"]


def test_ppo_config_and_its_openrlhf_flags(tmp_path: Path) -> None:
    from rlf_train.openrlhf.flags import RunPaths, openrlhf_flags

    cfg = load_config(None, ["algorithm.name=ppo", "backend=openrlhf", "algorithm.gamma=0.99", "algorithm.lam=0.9",
                             "algorithm.value_clip=0.3", "sft.enabled=false"])
    paths = RunPaths(model="m", agent="a.py", prompts="p.jsonl", eval_prompts=None, checkpoints="c", output="o",
                     tensorboard=None)
    plan = openrlhf_flags(cfg, paths)
    flags = " ".join(plan.flags)
    assert "--algo.advantage.gamma 0.99" in flags and "--algo.advantage.lambd 0.9" in flags
    assert "--critic.value_clip 0.3" in flags and "--critic.model_name_or_path" in flags
    assert any("separate critic" in n for n in plan.notes)
    with pytest.raises(ConfigError, match="ppo with rollout.agent"):
        load_config(None, ["algorithm.name=ppo", "rollout.agent=x.py:f"])
    assert load_config(None, ["algorithm.name=ppo"]).algorithm.critic == "value_head"
