"""rlf_train: RL (GRPO) training of tool-using LLM policies on rlf envs."""

__version__ = "0.1.0"
