"""`rollout.agent` in the trainer: the agent's sessions become GRPO rows (one per segment, only generated
tokens trained, behaviour log-probs recorded), every row of an episode gets the episode's group advantage,
and the reward rules (a str answer scored by the env's verifier, a number, AgentResult, None, a crash, a
timeout) hold, each counted in the run's metrics."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from agent_support import ScriptedEngine
from agent_train_envs import AGENT_QA_ID
from repo_paths import REPO, SUPPORT

import rlf_train.trainer as trainer_mod
from rlf_envs.formats import Qwen3Format
from rlf_envs.formats.chat import ChatCodec
from rlf_envs.rewards.rules import ExactMatch
from rlf_envs.types import Task
from rlf_train.config import ConfigError, load_config
from rlf_train.policy.tokenizer import build_tiny_tokenizer
from rlf_train.rollout.agent_runner import AgentResult, AgentRunner, load_agent
from rlf_train.rollout.endpoint.engine import EngineFront
from rlf_train.rollout.endpoint.sessions import EndpointLimits
from rlf_train.trainer import Trainer

HERE = SUPPORT
P, G = 2, 4


def agent_cfg(run_dir: Path, extra: list[str] | None = None) -> Any:
    return load_config(None, [
        f"env.id={AGENT_QA_ID}", "env.imports=[agent_train_envs]", "env.eval_split=test",
        f"rollout.agent={HERE / 'agent_train_envs.py'}:two_calls",
        f"logging.run_dir={run_dir}", "logging.progress=false", "logging.tensorboard=false", "threads=1",
        "model.tiny.hidden_size=16", "model.tiny.intermediate_size=32", "model.tiny.num_layers=1",
        f"rollout.prompts_per_step={P}", f"rollout.samples_per_prompt={G}", "rollout.max_new_tokens_per_turn=6",
        "rollout.max_total_tokens=256", "sft.enabled=false", "algorithm.steps=2", "algorithm.kl_coef=0",
        "eval.num_tasks=2", "eval.sampled=false", "seed=3", *(extra or []),
    ])


def test_agent_sessions_train_as_rows_with_their_episode_advantage(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    tr = Trainer(agent_cfg(tmp_path / "run"))
    seen: list[dict[str, Any]] = []
    orig_update, orig_loss = tr.update, trainer_mod.policy_loss

    def update(step: int, trajs: Any, task_indices: Any, *a: Any, **k: Any) -> Any:
        seen.append({"trajs": list(trajs), "tasks": list(task_indices), "episodes": k.get("episodes"), "adv": []})
        return orig_update(step, trajs, task_indices, *a, **k)

    def loss(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, **k: Any) -> Any:
        seen[-1]["adv"].append((adv.detach().clone(), mask.detach().clone()))
        return orig_loss(lp, old, adv, mask, **k)

    monkeypatch.setattr(tr, "update", update)
    monkeypatch.setattr(trainer_mod, "policy_loss", loss)
    summary = tr.run()
    assert len(seen) == 2 and summary["evals"]
    for s in seen:
        eps = s["episodes"]
        trajs = s["trajs"]
        assert eps is not None and len(eps.rewards) == P * G
        # odd tasks broke their history: two rows; even tasks one
        per_episode = [eps.episode_of_row.count(e) for e in range(P * G)]
        tasks = [s["tasks"][e] for e in range(P * G)]
        assert per_episode == [2 if tr.train_tasks[t].id.endswith(("1", "3", "5")) else 1 for t in tasks]
        assert eps.episode_of_row == sorted(eps.episode_of_row)
        for row, e in zip(trajs, eps.episode_of_row, strict=True):
            assert row.task.id == tr.train_tasks[s["tasks"][e]].id and row.reward == eps.rewards[e]
            assert len(row.token_ids) == len(row.loss_mask)
            generated = sum(len(t.behaviour_logprobs) for t in row.turns)
            assert sum(row.loss_mask) == generated > 0  # only generated tokens are trained
            for t in row.turns:
                a, b = t.action_span
                assert row.loss_mask[a:b] == [1] * (b - a) and t.policy_version == tr.policy_version - len(seen) + \
                    seen.index(s)
        # the advantage each row trains with: its episode's group-normalised reward
        r = torch.tensor(eps.rewards).view(P, G)
        want = ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-6)).flatten()
        adv = torch.cat([a for a, _ in s["adv"]])
        masks = torch.cat([m for _, m in s["adv"]])
        for i, e in enumerate(eps.episode_of_row):
            got = adv[i][masks[i] > 0]
            assert torch.allclose(got, torch.full_like(got, float(want[e])), atol=1e-5)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [x for x in rows if x["stage"] == "rl"]
    assert len(rl) == 2 and all(x["agent_break_history_trimmed"] > 0 and x["agent_calls_mean"] == 2.0 for x in rl)
    assert all(x["agent_errors"] == 0 and x["agent_no_reward"] == 0 for x in rl)


def test_agent_spec_errors_are_config_errors(tmp_path: Path) -> None:
    for spec, msg in [("nocolon", "package.module:function"), ("no_such_mod_xyz:f", "no module named"),
                      (f"{HERE / 'agent_train_envs.py'}:missing", "has no 'missing'"),
                      (f"{HERE / 'agent_train_envs.py'}:make_agent_qa", "async def"),
                      (f"{tmp_path / 'nope.py'}:f", "no file")]:
        with pytest.raises(ConfigError, match=msg):
            load_agent(spec)
    # --dry-run checks the agent as the run does
    from rlf_train.cli import main

    assert main(["--config", str(REPO / "configs" / "quickstart.yaml"), "--dry-run", "--set",
                 f"rollout.agent={HERE / 'agent_train_envs.py'}:missing", "--set",
                 f"logging.run_dir={tmp_path / 'dry'}"]) != 0
    assert not (tmp_path / "dry").exists()
    for bad in (["rollout.mode=async"], ["rollout.mode=async", "rollout.async_worker=thread",
                                        "rollout.async_schedule=fixed"]):
        with pytest.raises(ValueError, match="rollout.async_worker: thread"):
            load_config(None, ["rollout.agent=x:y", *bad])


def run_agent(agent: Any, timeout_s: float = 30.0) -> Any:
    tok = build_tiny_tokenizer(3072)
    codec = ChatCodec(Qwen3Format())
    engine = ScriptedEngine(tok, lambda ctx: "<answer>Vell</answer><|im_end|>")

    async def main() -> Any:
        runner = AgentRunner(agent, codec, tok, EndpointLimits(512, 16, timeout_s), 4,
                             EngineFront(engine, codec.stop_strings, window_s=0.001))
        await runner.start()
        try:
            return await runner.run([Task("t", "Capital of Zorbania?", ground_truth="Vell")], ExactMatch())
        finally:
            await runner.close()

    return asyncio.run(main())


async def ask(client: Any) -> Any:
    return await client.chat.completions.create(model=client.model, messages=[{"role": "user", "content": "q"}])


@pytest.mark.parametrize("returns, reward", [
    (lambda r: "Vell", 1.0), (lambda r: "Paris", 0.0), (lambda r: 0.25, 0.25), (lambda r: AgentResult(reward=0.5), 0.5),
    (lambda r: AgentResult(answer="Vell"), 1.0), (lambda r: None, 1.0),  # None: the last reply's <answer>
])
def test_agent_return_values_become_rewards(returns: Any, reward: float) -> None:
    async def agent(task: Task, client: Any) -> Any:
        return returns(await ask(client))

    eps = run_agent(agent)
    assert eps.rewards == [reward] and len(eps.trajectories) == 1
    assert eps.stats.no_reward == eps.stats.errors == eps.stats.timeouts == 0


def test_no_reward_crash_and_timeout_are_counted(caplog: pytest.LogCaptureFixture) -> None:
    async def silent(task: Task, client: Any) -> None:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}],
                                             max_tokens=2)  # cut before any <answer>
        return None

    eps = run_agent(silent)
    assert eps.rewards == [0.0] and eps.stats.no_reward == 1 and "without a reward" in caplog.text

    async def crash(task: Task, client: Any) -> None:
        await ask(client)
        raise KeyError("the agent's own bug")

    eps = run_agent(crash)
    assert eps.rewards == [0.0] and eps.stats.errors == 1 and len(eps.trajectories) == 1  # its tokens still train
    assert "the agent's own bug" in caplog.text

    seen: list[Any] = []

    async def slow(task: Task, client: Any) -> None:
        await ask(client)
        seen.append(client)
        await asyncio.sleep(30)

    eps = run_agent(slow, timeout_s=1.0)
    assert eps.rewards == [0.0] and eps.stats.timeouts == 1

    async def wrong_type(task: Task, client: Any) -> Any:
        await ask(client)
        return {"reward": 1}

    eps = run_agent(wrong_type)
    assert eps.rewards == [0.0] and eps.stats.errors == 1


def test_async_agent_rollouts_label_versions_and_keep_the_bound(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    tr = Trainer(agent_cfg(tmp_path / "run", ["rollout.mode=async", "rollout.async_worker=thread",
                                              "rollout.max_staleness=1", "algorithm.steps=3"]))
    seen: list[tuple[int, Any, bool, Any]] = []
    orig = tr.update

    def update(step: int, trajs: Any, task_indices: Any, *a: Any, **k: Any) -> Any:
        seen.append((step, list(trajs), k.get("behaviour", a[-1] if a else None), k.get("episodes")))
        return orig(step, trajs, task_indices, *a, **k)

    monkeypatch.setattr(tr, "update", update)
    tr.run()
    assert [s for s, *_ in seen] == [1, 2, 3]
    for step, trajs, behaviour, eps in seen:
        assert behaviour is True and eps is not None and len(eps.rewards) == P * G
        for row in trajs:
            for t in row.turns:  # the version that sampled each turn, within the staleness bound
                assert t.policy_version is not None and step - 1 - 1 <= t.policy_version <= step - 1
                assert len(t.behaviour_logprobs) == t.action_span[1] - t.action_span[0]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [x for x in rows if x["stage"] == "rl"]
    assert len(rl) == 3 and all(x["staleness_max"] <= 1 and "agent_calls_mean" in x for x in rl)
    events = tr.admission.events
    assert [e.group for e in events] == list(range(3 * P))
    assert all(e.version >= e.update - 1 - 1 for e in events)


def test_an_agent_run_resumes_from_its_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoint/resume as for env-driven runs (not bit-identical: which requests share an engine batch depends
    on timing, so the sampler's draws do too)."""
    cfg = agent_cfg(tmp_path / "run", ["logging.save_every=1", "algorithm.steps=3"])
    tr = Trainer(cfg)
    orig = tr.update

    def crash_at_3(step: int, *a: Any, **k: Any) -> Any:
        if step == 3:
            raise KeyboardInterrupt("killed")
        return orig(step, *a, **k)

    monkeypatch.setattr(tr, "update", crash_at_3)
    with pytest.raises(KeyboardInterrupt):
        tr.run()
    resumed = Trainer(cfg, run_dir=tmp_path / "run", resume=True)
    assert resumed.meta is not None and resumed.meta.step == 2
    resumed.run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows if x["stage"] == "rl"] == [1, 2, 3]
    assert (tmp_path / "run" / "checkpoints" / "step_3").is_dir()
