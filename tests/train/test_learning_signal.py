"""The training loop with real signal: on `rlf_test/Parity-v0` (tests/support/train_envs.py) every GRPO group has
mixed rewards, so these tests see non-zero advantages and gradients. Each one fails for a classic RL
trainer bug: an update that moves away from rewarded actions, advantages grouped differently from the
rollout, ratios computed under another distribution than the one sampled (temperature / top-p), a KL
reference that is the policy, eval on the wrong split or a subset, success counted below the threshold."""

from __future__ import annotations

import copy
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from train_envs import PARITY_ID, parity_reward

import rlf_train.trainer as trainer_mod
from rlf_envs.types import Task, Trajectory
from rlf_train.config import TrainConfig, load_config
from rlf_train.grpo import masked_logprobs
from rlf_train.rollout.batch import episode_stats, is_success
from rlf_train.sft import pad_batch
from rlf_train.trainer import Trainer


def parity_cfg(run_dir: Path, steps: int, extra: list[str] | None = None) -> TrainConfig:
    return load_config(None, [
        f"env.id={PARITY_ID}", "env.imports=[train_envs]", "env.eval_split=test",
        f"logging.run_dir={run_dir}", "logging.progress=false", "logging.tensorboard=false", "threads=1",
        "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=6", "rollout.max_turns=1",
        "rollout.max_new_tokens_per_turn=1", "rollout.max_total_tokens=128", "rollout.max_obs_tokens=32",
        "sft.enabled=false", f"algorithm.steps={steps}", "algorithm.micro_batch_size=5", "algorithm.kl_coef=0",
        "optim.lr=1e-2", "eval.num_tasks=100", "eval.before_rl=false", "eval.sampled=false", "seed=3",
        *(extra or []),
    ])


class Spy:
    """Records what the trainer does, in place: the trajectories of each rollout (with the policy's
    weights at that moment) and every call of `policy_loss` (advantages, old log-probs, mask)."""

    def __init__(self, tr: Trainer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tr = tr
        self.train: list[tuple[list[Trajectory], dict[str, torch.Tensor]]] = []
        self.eval: list[tuple[list[int], list[Trajectory]]] = []
        self.losses: list[dict[str, torch.Tensor]] = []
        orig_rollouts, orig_loss = tr.source.rollouts, trainer_mod.policy_loss

        def rollouts(venv: Any, task_indices: Any, params: Any, seed_base: int, gen: Any) -> Any:
            weights = copy.deepcopy(tr.model.state_dict())
            trajs, stats = orig_rollouts(venv, task_indices, params, seed_base, gen)
            if venv is tr.train_envs:
                self.train.append((trajs, weights))
            else:
                self.eval.append((list(task_indices), trajs))
            return trajs, stats

        def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                        **kw: Any) -> Any:
            self.losses.append({"adv": advantages.detach().clone(), "old": old_logp.detach().clone(),
                                "mask": mask.detach().clone()})
            return orig_loss(logp, old_logp, advantages, mask, **kw)

        monkeypatch.setattr(tr.source, "rollouts", rollouts)
        monkeypatch.setattr(trainer_mod, "policy_loss", policy_loss)

    def rows(self, key: str) -> list[torch.Tensor]:
        """Per trajectory (in trainer order), `key` at its policy tokens, from the first epoch's calls."""
        out: list[torch.Tensor] = []
        for call in self.losses:
            for row, m in zip(call[key], call["mask"], strict=True):
                out.append(row[m.bool()])
        return out


def action_logprob(model: torch.nn.Module, trajs: list[Trajectory], temperature: float) -> torch.Tensor:
    ids, attn, tgt, mask = pad_batch(trajs, 0, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = masked_logprobs(model, ids, attn, tgt, mask, temperature=temperature)
    return (lp * mask).sum(dim=1)


def test_update_moves_the_policy_toward_rewarded_actions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tr = Trainer(parity_cfg(tmp_path / "r", 1))
    spy = Spy(tr, monkeypatch)
    tr.run()
    (trajs, weights), = spy.train
    rewards = torch.tensor([t.reward for t in trajs])
    groups = rewards.view(2, 6)
    assert torch.all(groups.std(dim=1) > 0), f"the test needs mixed rewards in every group: {groups}"
    before_model = copy.deepcopy(tr.model)
    before_model.load_state_dict(weights)
    before = action_logprob(before_model, trajs, 1.0)
    after = action_logprob(tr.model, trajs, 1.0)
    delta = after - before
    good, bad = delta[rewards == 1.0], delta[rewards == 0.0]
    assert len(good) and len(bad)
    assert good.mean() > 0.05, f"log-prob of rewarded actions did not rise: {good}"
    assert bad.mean() < -0.05, f"log-prob of unrewarded actions did not fall: {bad}"
    assert good.min() > bad.max()
    rec = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["groups_with_signal"] == 1.0 and rec["grad_norm"] > 0


def test_advantages_use_the_rollout_groups_std_normalised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each trajectory's advantage (as passed to the loss) is its reward minus the mean over the samples of
    the same prompt, over their std: groups found from the trajectories' own tasks, not from positions."""
    tr = Trainer(parity_cfg(tmp_path / "g", 1))
    spy = Spy(tr, monkeypatch)
    tr.run()
    (trajs, _), = spy.train
    by_task: dict[str, list[float]] = defaultdict(list)
    for t in trajs:
        by_task[t.task.id] += [t.reward]
    assert len(by_task) == 2 and all(len(v) == 6 for v in by_task.values())
    advs = spy.rows("adv")
    assert len(advs) == len(trajs)
    for t, a in zip(trajs, advs, strict=True):
        g = torch.tensor(by_task[t.task.id], dtype=torch.float64)
        want = (t.reward - g.mean()) / (g.std(unbiased=False) + tr.cfg.algorithm.eps)
        assert len(a) > 0 and torch.allclose(a.double(), torch.full_like(a.double(), float(want)), atol=1e-5), \
            (t.task.id, t.reward, a, want)
    assert any(abs(float(a[0])) > 0.5 for a in advs)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.7, 1.0), (0.6, 0.5)])
def test_update_logprobs_are_those_of_the_sampling_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  temperature: float, top_p: float) -> None:
    """The old log-probs of the update (and so its ratios) are log-probs under the distribution the rollout
    sampled from: softmax(logits / T), restricted to the top-p nucleus and renormalised. Checked from the
    definition on the pre-update weights; each sampled token lies inside its nucleus."""
    tr = Trainer(parity_cfg(tmp_path / "t", 1, [f"rollout.temperature={temperature}", f"rollout.top_p={top_p}"]))
    spy = Spy(tr, monkeypatch)
    tr.run()
    (trajs, weights), = spy.train
    model = copy.deepcopy(tr.model)
    model.load_state_dict(weights)
    olds = spy.rows("old")
    for t, old in zip(trajs, olds, strict=True):
        ids = torch.tensor([t.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].double() / temperature
        probs = torch.softmax(logits, dim=-1)
        pos = torch.tensor(t.loss_mask[1:]).bool()
        want = []
        for p, target in zip(probs[pos], ids[0, 1:][pos], strict=True):
            sp, idx = p.sort(descending=True)
            nucleus = idx[(sp.cumsum(0) - sp) < top_p]
            assert target in nucleus, "the rollout sampled a token outside the top-p nucleus"
            want.append(torch.log(p[target] / p[nucleus].sum()))
        assert torch.allclose(old.double(), torch.stack(want), atol=1e-4), (old, want)


def test_kl_reference_is_a_frozen_copy(tmp_path: Path) -> None:
    tr = Trainer(parity_cfg(tmp_path / "k", 3, ["algorithm.kl_coef=0.5"]))
    init = copy.deepcopy(tr.model.state_dict())
    tr.run()
    ref = tr.ref_model
    assert ref is not None and ref is not tr.model
    policy_ptrs = {p.data_ptr() for p in tr.model.parameters()}
    assert all(p.data_ptr() not in policy_ptrs and not p.requires_grad for p in ref.parameters())
    assert all(torch.equal(v, init[k]) for k, v in ref.state_dict().items()), "the reference moved"
    assert any(not torch.equal(v, init[k]) for k, v in tr.model.state_dict().items())
    recs = [json.loads(x) for x in (tmp_path / "k" / "metrics.jsonl").read_text().splitlines()]
    kls = [r["kl"] for r in recs if r["stage"] == "rl"]
    assert kls[0] == pytest.approx(0.0, abs=1e-7) and all(k > 1e-5 for k in kls[1:]), kls


def test_eval_covers_every_task_of_the_eval_split_and_success_means_the_threshold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 5 eval tasks through 2 eval envs: three chunks; greedy and sampled
    tr = Trainer(parity_cfg(tmp_path / "e", 1, ["rollout.batch_size=2", "eval.sampled=true", "eval.temperature=1.0"]))
    spy = Spy(tr, monkeypatch)
    tr.run()
    assert len(spy.eval) == 6
    for mode_calls in (spy.eval[:3], spy.eval[3:]):
        ids = sorted(t.task.id for _, trajs in mode_calls for t in trajs)
        assert ids == [f"test-{i}" for i in range(5)]
    latest = json.loads((tmp_path / "e" / "eval.json").read_text())["latest"]
    for mode, calls in (("greedy", spy.eval[:3]), ("sampled", spy.eval[3:])):
        trajs = [t for _, ts in calls for t in ts]
        rewards = [t.reward for t in trajs]
        assert latest[mode]["reward_mean"] == pytest.approx(sum(rewards) / 5)
        assert latest[f"success_{mode}"] == pytest.approx(sum(r == 1.0 for r in rewards) / 5)
    all_rewards = [t.reward for _, ts in spy.eval for t in ts]
    assert 0.5 in all_rewards and 1.0 in all_rewards, all_rewards  # partial credit is there, and is no success


def test_success_threshold() -> None:
    def traj(r: float) -> Trajectory:
        return Trajectory(task=Task("t", "q"), prompt="", reward=r)

    assert [is_success(traj(r)) for r in (1.0, 1.5, 0.999, 0.5, 0.0, -1.0)] == [True, True, False, False, False, False]
    assert episode_stats([traj(r) for r in (1.0, 0.5, 0.999, 0.0)])["success_rate"] == 0.25


def test_parity_reward_levels() -> None:
    assert [parity_reward(i) for i in range(5)] == [1.0, 0.5, 1.0, 0.0, 1.0]


def test_eval_cli_em_is_the_greedy_success_on_the_eval_split(tmp_path: Path) -> None:
    """`python -m rlf_train.eval` on a checkpoint: greedy EM equals the share of eval prompts whose argmax
    first token the verifier pays in full, computed here from the model directly."""
    from rlf_train.eval import main
    from rlf_train.policy.load import load_policy
    from rlf_train.policy.tokenizer import load_tokenizer
    from rlf_train.rollout.env_factory import make_envs

    run = tmp_path / "c"
    cfg = parity_cfg(run, 2, ["optim.lr=0.1"])  # a large step: the greedy first tokens differ across prompts
    Trainer(cfg).run()
    ckpt = run / "checkpoints" / "step_2"
    out = tmp_path / "eval.json"
    assert main(["--config", str(run / "config.yaml"), "--checkpoint", str(ckpt), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    tok = load_tokenizer(cfg.model)
    model = load_policy(cfg.model, tok, cfg.seed, weights_dir=ckpt).eval()
    env = make_envs(cfg, tok, "test", 1).envs[0]
    paid = []
    for i in range(len(env.tasks)):
        obs, _ = env.reset(options={"task_index": i})
        with torch.no_grad():
            first = int(model(input_ids=torch.as_tensor(obs, dtype=torch.long)[None]).logits[0, -1].argmax())
        paid.append(parity_reward(first) == 1.0)
    assert res["split"] == "test" and res["num_tasks"] == 5
    assert res["greedy"]["em"] == pytest.approx(sum(paid) / 5) == res["greedy"]["success_rate"]
