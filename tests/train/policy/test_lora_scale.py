"""LoRA's scale is what the config says (issue 42, item 13): with a non-default `model.lora.alpha` the adapter's
update is `alpha / rank * B @ A` in peft's layers, in the merged view vLLM reloads and in the exported weights
(every other LoRA test uses alpha 8, which is peft's own default, so an alpha dropped on the way passed them).
The export's weights file also gets the mode of its siblings (item 10)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rlf_train.config import LoraConfig
from rlf_train.policy import lora
from rlf_train.policy.load import export_merged
from rlf_train.trainer import Trainer
from tests.train.policy.test_lora import _perturb, _tiny
from tests.train.test_learning_signal import parity_cfg

pytest.importorskip("peft")

RANK, ALPHA = 4, 32.0  # scale 8, not peft's default alpha 8 / rank 4 = 2


def _by_hand(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """W + alpha / rank * B @ A for every adapted layer, from the base and the adapter tensors."""
    norm = {k.removeprefix("base_model.model.").replace(f".{lora.ADAPTER}.", ".").removesuffix(".weight"): v
            for k, v in adapter.items()}  # <layer>.lora_A / <layer>.lora_B
    out = {}
    for k, a in norm.items():
        if not k.endswith(".lora_A"):
            continue
        layer = k.removesuffix(".lora_A")
        b = norm[f"{layer}.lora_B"]
        w = base[f"{layer}.weight"]
        out[f"{layer}.weight"] = w + (ALPHA / RANK) * (b @ a)
    return out


def test_alpha_reaches_peft_and_the_merged_view() -> None:
    plain = _tiny()
    base = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    policy = lora.attach(plain, LoraConfig(rank=RANK, alpha=ALPHA), seed=0)
    _perturb(policy)
    from peft.tuners.lora import LoraLayer

    layers = [m for m in policy.modules() if isinstance(m, LoraLayer)]
    assert layers and all(m.scaling[lora.ADAPTER] == pytest.approx(ALPHA / RANK) for m in layers)
    adapter = {k: v.detach() for k, v in policy.named_parameters() if ".lora_" in k}
    want = _by_hand(base, adapter)
    merged = lora.hf_state(policy)
    assert want and all(torch.allclose(merged[k], v, atol=1e-6) for k, v in want.items())


def test_alpha_reaches_the_export_and_its_mode(tmp_path: Path) -> None:
    run = tmp_path / "run"
    tr = Trainer(parity_cfg(run, 1, [f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", "logging.save_every=1",
                                     "optim.lr=0.1"]))
    tr.run()
    ckpt = run / "checkpoints" / "step_1"
    adapter = load_file(str(ckpt / lora.ADAPTER_WEIGHTS))
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # the update moved B
    base = _tiny_base(tr)
    out = export_merged(ckpt, tmp_path / "hf")
    exported = load_file(str(out / "model.safetensors"))
    want = _by_hand(base, adapter)
    assert want and all(torch.allclose(exported[k], v, atol=1e-5) for k, v in want.items())
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o666 & ~umask, modes


def _tiny_base(tr: Trainer) -> dict[str, torch.Tensor]:
    """The frozen base the run's adapter sits on (the policy's weights with the adapter off)."""
    return {lora._hf_name(k): v.detach() for k, v in tr.model.get_base_model().state_dict().items()
            if ".lora_" not in k}


class RecordingLLM:
    """A stand-in for `vllm.LLM` at the boundary `VllmRollout.sync` calls: records what it is sent."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[int]:
        state = torch.load(args[0], map_location="cpu", weights_only=True)  # what every worker reads
        self.calls.append(("collective_rpc", method, state))
        return [len(state)]

    def reset_prefix_cache(self) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return True


def test_the_vllm_reload_sends_the_merged_policy_under_plain_names(tmp_path: Path) -> None:
    from rlf_train.rollout.vllm import VllmRollout, VllmWorkerExtension

    plain = _tiny()
    base = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    engine = object.__new__(VllmRollout)  # the engine as built from the policy before RL, with vLLM stood in
    engine.work_dir, engine.timeout_s, engine.procs, engine.version, engine.reloads = tmp_path, 60.0, [], 0, 0
    engine.shapes = {k: tuple(v.shape) for k, v in lora.hf_state(plain).items()}
    engine.llm = llm = RecordingLLM()
    policy = lora.attach(plain, LoraConfig(rank=RANK, alpha=ALPHA), seed=0)
    _perturb(policy)
    engine.sync(policy, 1)
    assert [c[:2] for c in llm.calls] == [("collective_rpc", "rlf_reload_state_file"), ("reset_prefix_cache",)]
    sent = llm.calls[0][2]
    assert set(sent) == set(engine.shapes)  # the plain transformers names: no base_layer, no lora_ tensors
    adapter = {k: v.detach() for k, v in policy.named_parameters() if ".lora_" in k}
    want = _by_hand(base, adapter)
    assert want and all(torch.allclose(sent[k], v, atol=1e-6) for k, v in want.items())
    assert all(torch.equal(sent[k], base[k]) for k in sent if k not in want)  # the rest: the frozen base
    assert engine.version == 1 and not (tmp_path / "weights.pt").exists()
    engine.sync(policy, 1)  # the version it holds: nothing sent
    assert len(llm.calls) == 2
    # the worker side reads that file into vLLM's runner in checkpoint format
    got: dict[str, Any] = {}

    class Runner:
        def reload_weights(self, weights_iterator: Any, is_checkpoint_format: bool) -> None:
            got.update(dict(weights_iterator), fmt=is_checkpoint_format)

        def get_model(self) -> Any:
            return object()

    worker = VllmWorkerExtension()
    worker.model_runner = Runner()
    path = tmp_path / "w.pt"
    torch.save(sent, path)
    assert worker.rlf_reload_state_file(str(path)) == len(sent)
    assert got.pop("fmt") is True and set(got) == set(sent)
