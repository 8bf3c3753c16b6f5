"""The policy: its weights built or loaded (`load_policy`, the one entry above `model`, `checkpoint` and `lora`), LoRA
adapters (`lora`), checkpoints (`checkpoint`) and the tokenizer (`tokenizer`)."""

from rlf_train.policy.load import export_merged, load_policy
from rlf_train.policy.model import build_tiny_model, num_parameters, resolve_device
from rlf_train.policy.tokenizer import build_tiny_tokenizer, load_tokenizer

__all__ = ["build_tiny_model", "build_tiny_tokenizer", "export_merged", "load_policy", "load_tokenizer",
           "num_parameters", "resolve_device"]
