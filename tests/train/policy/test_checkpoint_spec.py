"""Checkpoints pinned to their specification (rlf_train.policy.checkpoint).

- weights: every tensor of the model comes back bit-identical into a differently initialised model; tied
  embeddings are stored once and are tied again after loading; an untied head is stored and restored;
  a checkpoint of another architecture is refused, naming the missing / unexpected keys.
- a checkpoint dir holds the weights, the trainer state, the model config, the tokenizer (when given) and
  the meta, and `latest` names it; writing the same name again replaces it, no temp dir is left behind.
- pruning keeps the newest `keep_last` of each series (step_N, sft_N) by number, not by name; other
  entries are never touched; `remove_checkpoints` removes one series only.
- `latest_checkpoint` is None unless `latest` names a dir with a meta file; `prepare_run_dir` turns an
  unwritable run dir into a ConfigError naming logging.run_dir.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from rlf_train.config import ConfigError
from rlf_train.policy.checkpoint import (
    META,
    STATE,
    WEIGHTS,
    CheckpointMeta,
    latest_checkpoint,
    load_weights,
    prepare_run_dir,
    read_checkpoint,
    remove_checkpoints,
    save_checkpoint,
    save_weights,
)


def tiny(seed: int, tied: bool = True, layers: int = 1) -> Qwen3ForCausalLM:
    qc = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                     tie_word_embeddings=tied, pad_token_id=0, eos_token_id=0, bos_token_id=None)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(qc)


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("tied", [True, False])
def test_weights_round_trip(tmp_path: Path, tied: bool) -> None:
    from safetensors.torch import load_file

    src, dst = tiny(1, tied), tiny(2, tied)
    assert not torch.equal(src.model.embed_tokens.weight, dst.model.embed_tokens.weight)
    d = tmp_path / "ck"
    d.mkdir()
    save_weights(src, d / WEIGHTS)
    stored = load_file(str(d / WEIGHTS))
    # tied: the head is the embedding, stored once; untied: both stored
    assert ("lm_head.weight" in stored) is (not tied)
    assert set(stored) | ({"lm_head.weight"} if tied else set()) == set(src.state_dict())
    load_weights(dst, d)
    assert_same_weights(src, dst)
    assert (dst.lm_head.weight is dst.model.embed_tokens.weight) is tied
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(src(input_ids=ids).logits, dst(input_ids=ids).logits)


class Shared(torch.nn.Module):
    """A shared weight in the middle of the state dict (not only a tied head at its end)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 3)
        self.b = torch.nn.Linear(3, 3)
        self.b.weight = self.a.weight
        self.c = torch.nn.Linear(3, 2)


def test_shared_tensors_are_stored_once_and_nothing_else_is_dropped(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    m = Shared()
    save_weights(m, tmp_path / WEIGHTS)
    stored = load_file(str(tmp_path / WEIGHTS))
    assert sorted(stored) == ["a.bias", "a.weight", "b.bias", "c.bias", "c.weight"]
    for k, v in stored.items():
        assert torch.equal(v, m.state_dict()[k]), k


class NoTieConfig(torch.nn.Module):
    """A model whose config does not say whether it ties its embeddings: its head is its own."""

    def __init__(self, head: bool) -> None:
        from transformers import PretrainedConfig

        super().__init__()
        self.config = PretrainedConfig()
        self.embed = torch.nn.Embedding(5, 3)
        if head:
            self.lm_head = torch.nn.Linear(3, 5, bias=False)


def test_load_refuses_another_architecture(tmp_path: Path) -> None:
    (tmp_path / "two").mkdir()
    (tmp_path / "untied").mkdir()
    save_weights(tiny(1, layers=2), tmp_path / "two" / WEIGHTS)
    save_weights(tiny(1, tied=False), tmp_path / "untied" / WEIGHTS)
    with pytest.raises(ValueError, match=r"does not match the model: missing=\[\] unexpected=\['model\.layers\.1"):
        load_weights(tiny(2, layers=1), tmp_path / "two")
    with pytest.raises(ValueError, match=r"missing=\['model\.layers\.1\..*unexpected=\[\]"):
        load_weights(tiny(2, layers=2), tmp_path / "untied")
    # an untied model needs its head: a tied checkpoint (no lm_head.weight) is refused
    (tmp_path / "tied").mkdir()
    save_weights(tiny(1), tmp_path / "tied" / WEIGHTS)
    with pytest.raises(ValueError, match=r"missing=\['lm_head\.weight'\]"):
        load_weights(tiny(2, tied=False), tmp_path / "tied")
    with pytest.raises(FileNotFoundError, match=f"no {WEIGHTS} in checkpoint"):
        load_weights(tiny(2), tmp_path)
    assert not hasattr(NoTieConfig(True).config, "tie_word_embeddings")
    (tmp_path / "headless").mkdir()
    save_weights(NoTieConfig(False), tmp_path / "headless" / WEIGHTS)
    with pytest.raises(ValueError, match=r"missing=\['lm_head\.weight'\]"):
        load_weights(NoTieConfig(True), tmp_path / "headless")


def test_save_checkpoint_contents_latest_and_replace(tmp_path: Path) -> None:
    from rlf_train.config import load_config
    from rlf_train.policy.tokenizer import load_tokenizer

    tok = load_tokenizer(load_config(None, []).model)
    run = tmp_path / "run"
    state = {"optimizer": {"x": torch.arange(3)}, "order": [2, 0, 1]}
    meta = CheckpointMeta(stage="rl", step=3, sft_done=True, extra={"k": 1})
    m1 = tiny(1)
    p = save_checkpoint(run, "step_3", m1, state, meta, keep_last=5, tokenizer=tok)
    assert p == run / "checkpoints" / "step_3"
    assert {f.name for f in p.iterdir()} >= {WEIGHTS, STATE, META, "config.json", "tokenizer.json"}
    assert json.loads((p / META).read_text()) == {"stage": "rl", "step": 3, "sft_done": True, "extra": {"k": 1}}
    assert json.loads((p / "config.json").read_text())["hidden_size"] == 16
    assert (run / "checkpoints" / "latest").read_text() == "step_3"
    assert latest_checkpoint(run) == p
    got_meta, got_state = read_checkpoint(p)
    assert got_meta == meta
    assert got_state["order"] == [2, 0, 1] and torch.equal(got_state["optimizer"]["x"], torch.arange(3))
    # no tokenizer: none saved; the newest save is `latest`
    q = save_checkpoint(run, "step_4", m1, state, CheckpointMeta("rl", 4, True), keep_last=5)
    assert not (q / "tokenizer.json").exists() and latest_checkpoint(run) == q
    # the same name again: replaced by the new weights and meta, nothing temporary left
    m2 = tiny(2)
    save_checkpoint(run, "step_3", m2, {"order": []}, CheckpointMeta("rl", 3, False), keep_last=5)
    assert latest_checkpoint(run) == p
    fresh = tiny(3)
    load_weights(fresh, p)
    assert_same_weights(fresh, m2)
    meta3, st3 = read_checkpoint(p)
    assert meta3.sft_done is False and st3 == {"order": []}
    assert sorted(x.name for x in (run / "checkpoints").iterdir()) == ["latest", "step_3", "step_4"]
    # a tokenizer object that cannot save itself is skipped, not an error
    save_checkpoint(run, "step_4", m2, {}, CheckpointMeta("rl", 4, True), keep_last=5, tokenizer=object())
    assert not (q / "tokenizer.json").exists()


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    import os

    run = tmp_path / "run"
    m = tiny(1)
    good = save_checkpoint(run, "step_1", m, {"order": [1]}, CheckpointMeta("rl", 1, True), keep_last=3)
    # a temp dir left by a crashed save of this process: cleared, not mixed into the new checkpoint
    stale = run / "checkpoints" / f".tmp_step_2_{os.getpid()}"
    stale.mkdir()
    (stale / "junk").write_text("x")
    p = save_checkpoint(run, "step_2", m, {"order": [2]}, CheckpointMeta("rl", 2, True), keep_last=3)
    assert not (p / "junk").exists() and not stale.exists()
    with pytest.raises((AttributeError, TypeError), match="pickle"):  # an unpicklable trainer state
        save_checkpoint(run, "step_1", m, {"fn": lambda: 0}, CheckpointMeta("rl", 1, True), keep_last=3)
    assert sorted(x.name for x in (run / "checkpoints").iterdir()) == ["latest", "step_1", "step_2"]
    assert read_checkpoint(good)[1] == {"order": [1]} and latest_checkpoint(run) == p


def test_reads_back_the_trainer_state(tmp_path: Path) -> None:
    """What the trainer saves (optimizer and scheduler, torch / numpy / python RNG states, data order) is
    read back equal, on the CPU."""
    from train_envs import spec_cfg

    from rlf_train.trainer import Trainer

    tr = Trainer(spec_cfg(tmp_path / "run"))
    opt = torch.optim.AdamW(tr.model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    tr.model(input_ids=torch.tensor([[1, 2]])).logits.sum().backward()
    opt.step()
    sched.step()
    tr._next_tasks(2)
    p = tr._save("step_1", "rl", 1, opt, sched)
    meta, state = read_checkpoint(p)
    assert meta == CheckpointMeta("rl", 1, True)
    assert state["order_pos"] == 2 and state["order"] == tr.order and state["data_rng"] == tr._data_state()["data_rng"]
    assert torch.equal(state["torch_rng"], torch.get_rng_state())
    assert state["scheduler"] == sched.state_dict()
    for k, v in opt.state_dict()["state"][0].items():
        got = state["optimizer"]["state"][0][k]
        assert torch.equal(got, v) and got.device.type == "cpu"


def test_keep_last_per_series_by_number(tmp_path: Path) -> None:
    run = tmp_path / "run"
    root = run / "checkpoints"
    m = tiny(1)
    (root / "step_x").mkdir(parents=True)  # not a numbered checkpoint: never pruned
    (root / "sft").mkdir()
    for n in (9, 10, 2):  # by number: 10 > 9 > 2 (by name "2" > "10")
        save_checkpoint(run, f"sft_{n}", m, {}, CheckpointMeta("sft", n, False), keep_last=2)
    for n in (1, 11, 3):
        save_checkpoint(run, f"step_{n}", m, {}, CheckpointMeta("rl", n, True), keep_last=2)
    assert sorted(x.name for x in root.iterdir()) == ["latest", "sft", "sft_10", "sft_9", "step_11", "step_3",
                                                      "step_x"]
    save_checkpoint(run, "step_12", m, {}, CheckpointMeta("rl", 12, True), keep_last=1)
    assert sorted(x.name for x in root.iterdir()) == ["latest", "sft", "sft_10", "step_12", "step_x"]
    remove_checkpoints(run, "sft_")
    assert sorted(x.name for x in root.iterdir()) == ["latest", "sft", "step_12", "step_x"]
    remove_checkpoints(tmp_path / "nothing here", "sft_")  # no checkpoints dir: nothing to do


def test_latest_checkpoint_needs_a_complete_dir(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert latest_checkpoint(run) is None
    root = run / "checkpoints"
    root.mkdir(parents=True)
    (root / "latest").write_text("step_5\n")
    assert latest_checkpoint(run) is None  # names a dir that is not there
    (root / "step_5").mkdir()
    assert latest_checkpoint(run) is None  # a dir without its meta (an interrupted copy)
    (root / "step_5" / META).write_text("{}")
    assert latest_checkpoint(run) == root / "step_5"


def test_prepare_run_dir(tmp_path: Path) -> None:
    run = tmp_path / "a" / "b"
    prepare_run_dir(run)
    assert run.is_dir() and list(run.iterdir()) == []  # the write probe is removed
    prepare_run_dir(run)  # an existing run dir is fine (resume)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"^logging\.run_dir: cannot write to .*file/run \(Not a directory\); set "
                                          r"logging\.run_dir \(or name\) to a writable directory$"):
        prepare_run_dir(tmp_path / "file" / "run")
