"""End-to-end on the tiny model and a tiny in-memory search env: SFT + GRPO smoke run logs metrics
and changes parameters; --resume reproduces the uninterrupted run's next step; eval CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gymnasium
import pytest
import torch
from safetensors.torch import load_file

from rlf_train.config import TrainConfig, load_config
from rlf_train.trainer import Trainer

COLORS = ["red", "blue", "green", "black", "white", "gold"]
NAMES = ["Arno", "Belk", "Cira", "Dovo", "Emal", "Fesk", "Gorn", "Hald", "Ivra", "Jult", "Kemo", "Lusk"]
FACTS = {n: COLORS[i % len(COLORS)] for i, n in enumerate(NAMES)}


def search(query: str) -> str:
    """Look up an entity by name.

    Args:
        query: the entity name
    """
    q = query.strip()
    if q in FACTS:
        return f"{q} is {FACTS[q]}."
    return "no result"


def tasks(split: str) -> list[dict[str, Any]]:
    names = NAMES[:8] if split == "train" else NAMES[8:]
    return [
        {"id": f"{split}-{i}", "question": f"What color is {n}?", "answers": [FACTS[n]], "meta": {"entity": n}}
        for i, n in enumerate(names)
    ]


def make_tiny_search(split: str = "train", **kwargs: Any) -> Any:
    from rlf_envs.env import ToolEnv

    kwargs.setdefault("format", "search_r1")
    return ToolEnv(tools=[search], tasks=tasks(split), **kwargs)


def register() -> None:
    if "rlf_test/TinySearch-v0" not in gymnasium.registry:
        gymnasium.register("rlf_test/TinySearch-v0", entry_point=make_tiny_search)


TIMING_KEYS = {"time_rollout", "time_generate", "time_env", "time_train", "time_step"}


def _cfg(run_dir: Path, steps: int, extra: list[str] | None = None) -> TrainConfig:
    register()
    return load_config(
        None,
        [
            "env.id=rlf_test/TinySearch-v0",
            "env.imports=[]",
            f"logging.run_dir={run_dir}",
            "logging.progress=false",
            "logging.save_every=1",
            "logging.keep_last=5",
            "threads=1",
            "model.tiny.hidden_size=32",
            "model.tiny.intermediate_size=64",
            "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=4",
            "rollout.max_turns=2",
            "rollout.max_new_tokens_per_turn=6",
            "rollout.max_total_tokens=256",
            "rollout.max_obs_tokens=64",
            "sft.enabled=true",
            "sft.steps=4",
            "sft.batch_size=4",
            "sft.num_demos=16",
            f"algorithm.steps={steps}",
            "algorithm.micro_batch_size=3",
            "algorithm.kl_coef=0.05",
            "optim.lr=1e-2",
            "eval.num_tasks=4",
            "eval.before_rl=true",
            "seed=1",
        ]
        + (extra or []),
    )


def _rl_records(run_dir: Path) -> list[dict]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["stage"] == "rl"]


def test_smoke_run_logs_and_learns_parameters(tmp_path: Path) -> None:
    run = tmp_path / "a"
    tr = Trainer(_cfg(run, 3))
    init = {k: v.clone() for k, v in tr.model.state_dict().items()}
    summary = tr.run()
    recs = _rl_records(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    for key in (
        "reward_mean",
        "reward_std",
        "success_rate",
        "turns_mean",
        "tool_calls_mean",
        "tool_errors_mean",
        "tokens_total_mean",
        "loss",
        "kl",
        "entropy",
        "time_generate",
        "time_env",
        "time_train",
    ):
        assert key in recs[0], key
    assert recs[-1]["kl"] >= 0.0
    changed = [k for k, v in tr.model.state_dict().items() if not torch.equal(v, init[k])]
    assert changed, "no parameter changed"
    for f in ("config.yaml", "eval.json", "reward_curve.png", "summary.json"):
        assert (run / f).is_file(), f
    assert list((run / "tb").iterdir()), "no TensorBoard events"
    ev = json.loads((run / "eval.json").read_text())
    assert [e["step"] for e in ev["evals"]] == [0, 3] and "greedy" in ev["latest"] and "sampled" in ev["latest"]
    assert len(summary["evals"]) == 2
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())
    assert "sft" in ckpts and "step_3" in ckpts
    sd = load_file(str(run / "checkpoints" / "step_3" / "model.safetensors"))
    assert torch.equal(sd["model.embed_tokens.weight"], tr.model.state_dict()["model.embed_tokens.weight"])
    # keep-last-N prunes old step checkpoints
    extra = ["logging.keep_last=1", "sft.enabled=false", "eval.before_rl=false", "algorithm.name=dr_grpo",
             "algorithm.mini_batches=3", "algorithm.ppo_epochs=2", "algorithm.kl_coef=0"]
    tr2 = Trainer(_cfg(tmp_path / "k", 3, extra))
    tr2.run()
    steps = sorted(p.name for p in (tmp_path / "k" / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert steps == ["step_3"]
    # a second run into the same dir is refused (resume instead)
    with pytest.raises(FileExistsError, match="--resume"):
        Trainer(_cfg(run, 3))


def test_resume_reproduces_next_step(tmp_path: Path) -> None:
    full = tmp_path / "full"
    Trainer(_cfg(full, 3)).run()
    part = tmp_path / "part"
    Trainer(_cfg(part, 2)).run()
    resumed = Trainer(_cfg(part, 3), resume=True)
    resumed.run()
    a, b = _rl_records(full), _rl_records(part)
    assert [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b, strict=True):
        assert {k: v for k, v in ra.items() if k not in TIMING_KEYS} == {
            k: v for k, v in rb.items() if k not in TIMING_KEYS
        }
    wa = load_file(str(full / "checkpoints" / "step_3" / "model.safetensors"))
    wb = load_file(str(part / "checkpoints" / "step_3" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no run there"):
        Trainer(_cfg(tmp_path / "none", 1), resume=True)


def test_bad_env_id(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"env\.id 'nope/Nothing-v0'"):
        Trainer(_cfg(tmp_path / "x", 1, ["env.id=nope/Nothing-v0"]))


def test_eval_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rlf_train.eval import main

    run = tmp_path / "e"
    Trainer(_cfg(run, 1, ["eval.before_rl=false"])).run()
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text((run / "config.yaml").read_text())
    register()
    out_json = tmp_path / "eval.json"
    assert (
        main(["--config", str(cfg_path), "--checkpoint", str(run / "checkpoints" / "step_1"), "--json", str(out_json)])
        == 0
    )
    res = json.loads(out_json.read_text())
    assert res["num_tasks"] == 4 and {"greedy", "sampled"} <= set(res)
    assert "em" in res["greedy"] and "tool_calls_mean" in res["greedy"]  # values: test_train_signal's eval CLI test
    assert main(["--config", str(cfg_path), "--checkpoint", str(tmp_path)]) == 2
