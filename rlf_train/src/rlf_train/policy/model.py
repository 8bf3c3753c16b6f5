"""Building the policy network: the offline tiny Qwen3-architecture causal LM (random init, seeded) and the device it
runs on. Loading one from a checkpoint or the Hugging Face cache is `rlf_train.policy.load`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlf_train.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def resolve_device(spec: str) -> torch.device:
    """`model.device` as a torch device; a device this machine lacks is a ConfigError naming the key."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"model.device: {spec!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ConfigError(f"model.device: {spec!r} but no CUDA GPU is visible here; use model.device=cpu "
                              "(or auto, which picks a GPU when there is one)")
        if dev.index is not None and dev.index >= n:
            raise ConfigError(f"model.device: {spec!r} but only {n} CUDA GPU(s) are visible (cuda:0..cuda:{n - 1})")
    elif dev.type not in ("cpu", "mps", "xpu"):
        raise ConfigError(f"model.device: {spec!r} is not supported; use auto, cpu, cuda or cuda:N")
    return dev


def build_tiny_model(cfg: ModelConfig, vocab_size: int, seed: int, pad_token_id: int | None) -> PreTrainedModel:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    t = cfg.tiny
    qc = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers,
        num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_kv_heads,
        head_dim=t.hidden_size // t.num_heads,
        max_position_embeddings=t.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        eos_token_id=pad_token_id,
        bos_token_id=None,
        initializer_range=0.02,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(qc)
    return model


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
