"""Replay bundles (`logging.replay_every`, `python -m rlf_train.replay`): a bundle a run recorded replays exactly on
CPU with no env and no engine (loss mask, rewards, returns, advantages, behaviour and learner log-probs, every
micro-batch's loss terms, gradient norms, the updated weights); a run whose advantage or mask was broken is
reported at its first divergence, as is a bundle edited after the fact; `--train-from` trains on recorded rollouts
and ends on the weights the run ended on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from train_envs import spec_cfg

import rlf_train.trainer as trainer_mod
from rlf_train.bundle import BundleError, list_bundles, read_bundle, state_hash
from rlf_train.policy.checkpoint import load_weights
from rlf_train.policy.load import load_policy
from rlf_train.policy.tokenizer import load_tokenizer
from rlf_train.replay import main, replay_bundle, train_from
from rlf_train.trainer import Trainer

RECORD = ["algorithm.steps=2", "logging.replay_every=1", "logging.replay_weights=true", "algorithm.mini_batches=2",
          "algorithm.micro_batch_size=4"]


def record(run: Path, extra: list[str] | None = None) -> list[Path]:
    Trainer(spec_cfg(run, [*RECORD, *(extra or [])])).run()
    return list_bundles(run)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("replay") / "run"
    assert [p.name for p in record(run)] == ["step_000001", "step_000002"]
    return run


def test_a_recorded_step_replays_exactly(recorded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for path in list_bundles(recorded):
        rep = replay_bundle(path)
        assert rep.exact, rep.divergence
        stages = [s for s, _ in rep.checked]
        assert stages == ["loss mask", "rewards", "returns", "advantages", "weights before the update",
                          "learner log-probs", "micro-batch loss", "micro-batch pg_loss", "micro-batch kl",
                          "gradient norm", "weights after the update"]
        assert rep.skipped == []
    b = read_bundle(list_bundles(recorded)[0])
    assert len(b.micro) == 4 and len(b.grad_norms) == 2  # 12 rows: 2 mini-batches of 6, micro-batches of 4 and 2
    assert b.manifest.hashes["weights_before"] != b.manifest.hashes["weights_after"]
    assert b.manifest.hashes["code_rlf_train"] and b.manifest.hashes["tokenizer"]
    assert main([str(recorded)]) == 0
    assert capsys.readouterr().out.count("replayed exactly") == 2


def test_consecutive_bundles_chain(recorded: Path) -> None:
    """The weights step 2 started from are the weights step 1 ended with."""
    one, two = (read_bundle(p) for p in list_bundles(recorded))
    assert one.manifest.hashes["weights_after"] == two.manifest.hashes["weights_before"]
    assert two.manifest.policy_version == one.manifest.policy_version + 1


def test_a_broken_advantage_is_reported_at_its_first_divergence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    real = trainer_mod.token_advantages

    def flipped(*args: Any, **kw: Any) -> torch.Tensor:
        adv = real(*args, **kw)
        adv[3] = -adv[3]  # one row's advantage has the wrong sign
        return adv

    monkeypatch.setattr(trainer_mod, "token_advantages", flipped)
    paths = record(tmp_path / "run", ["algorithm.steps=1"])
    monkeypatch.undo()
    rep = replay_bundle(paths[0])
    assert rep.divergence is not None and rep.divergence.stage == "advantages", rep.divergence
    assert rep.divergence.where.startswith("row 3 ")
    assert rep.divergence.recorded == -rep.divergence.recomputed != 0
    assert [s for s, _ in rep.checked] == ["loss mask", "rewards", "returns"]  # it stops at the first
    assert main([str(paths[0])]) == 1
    assert "first divergence: advantages at row 3" in capsys.readouterr().out


def test_a_broken_mask_is_reported_at_its_first_divergence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = trainer_mod.pad_batch

    def shifted(*args: Any, **kw: Any) -> Any:  # the loss also trains on the token before each action
        ids, attn, tgt, mask = real(*args, **kw)
        return ids, attn, tgt, torch.maximum(mask, torch.roll(mask, -1, dims=1))

    monkeypatch.setattr(trainer_mod, "pad_batch", shifted)
    paths = record(tmp_path / "run", ["algorithm.steps=1"])
    monkeypatch.undo()
    rep = replay_bundle(paths[0])
    assert rep.divergence is not None and rep.divergence.stage == "loss mask", rep.divergence
    assert rep.divergence.recorded == 1.0 and rep.divergence.recomputed == 0.0
    assert rep.checked == []


def test_an_edited_bundle_is_reported_where_it_was_edited(recorded: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "step"
    shutil.copytree(list_bundles(recorded)[0], copy)
    rows = (copy / "rows.jsonl").read_text().splitlines()
    row = json.loads(rows[5])
    row["reward"] = row["reward"] + 0.25
    rows[5] = json.dumps(row)
    (copy / "rows.jsonl").write_text("\n".join(rows) + "\n")
    rep = replay_bundle(copy)
    assert rep.divergence is not None and rep.divergence.stage == "rewards" and rep.divergence.where.startswith("row 5")
    assert rep.divergence.recomputed == pytest.approx(rep.divergence.recorded + 0.25)


def test_without_weights_the_reward_chain_still_replays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = record(tmp_path / "run", ["algorithm.steps=1", "logging.replay_weights=false"])
    assert not (paths[0] / "state.pt").exists()
    rep = replay_bundle(paths[0])
    assert rep.exact and [s for s, _ in rep.checked] == ["loss mask", "rewards", "returns", "advantages"]
    assert "replay_weights" in rep.skipped[0]
    assert main([str(paths[0])]) == 0
    assert "not replayed: log-probs and loss terms" in capsys.readouterr().out


def test_train_from_recorded_rollouts_ends_on_the_runs_weights(recorded: Path, tmp_path: Path) -> None:
    metrics = train_from([recorded], tmp_path / "out", say=lambda s: None)
    assert [m["step"] for m in metrics] == [1, 2]
    last = read_bundle(list_bundles(recorded)[-1])
    cfg = spec_cfg(tmp_path / "x")
    model = load_policy(cfg.model, load_tokenizer(cfg.model), cfg.seed)
    load_weights(model, tmp_path / "out" / "checkpoints" / "step_2")
    assert state_hash(model.state_dict()) == last.manifest.hashes["weights_after"]
    recorded_metrics = [json.loads(line) for line in (recorded / "metrics.jsonl").read_text().splitlines()]
    rl = [m for m in recorded_metrics if m.get("stage") == "rl"]
    assert [m["loss"] for m in metrics] == [m["loss"] for m in rl]


def test_bad_bundles_say_what_is_wrong(tmp_path: Path, recorded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(BundleError, match="no manifest.json"):
        read_bundle(tmp_path)
    import shutil

    copy = tmp_path / "b"
    shutil.copytree(list_bundles(recorded)[0], copy)
    (copy / "tensors.pt").unlink()
    with pytest.raises(BundleError, match="tensors.pt is missing"):
        read_bundle(copy)
    assert main([str(copy)]) == 2
    assert "tensors.pt is missing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nothing-here")])
