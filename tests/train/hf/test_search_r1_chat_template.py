"""Search-R1 parity of prompts with a real chat template: `gym.make("rlf/Search-v0", format_kwargs={"chat_template":
tok})` prompts exactly as Search-R1's dataset does with a chat model (a Qwen3 tokenizer's own template, built offline;
tests/envs/formats/test_search_r1_prompt.py checks the rest without transformers)."""

from __future__ import annotations

from typing import Any

from rlf_envs.tasks.parquet import row_to_task

ROW = {
    "data_source": "nq",
    "prompt": [{"role": "system", "content": "You are a careful researcher."},
               {"role": "user", "content": "Answer the given question... Question: who wrote hamlet?\n"}],
    "ability": "fact-reasoning",
    "reward_model": {"style": "rule", "ground_truth": {"target": ["Shakespeare"]}},
    "extra_info": {"split": "train", "index": 7},
}


def test_chat_template_of_a_real_tokenizer_through_the_env(qwen3_template_tokenizer: Any) -> None:
    """`gym.make("rlf/Search-v0", format_kwargs={"chat_template": tok})` prompts as Search-R1 does with a chat model."""
    from rlf_envs.env.tool_env import ToolEnv

    hf = qwen3_template_tokenizer
    task = row_to_task(ROW, default_id="x", where="row 0")
    env = ToolEnv(tasks=[task], format="search_r1", format_kwargs={"instruction": None, "chat_template": hf})
    obs, _ = env.reset(seed=0)
    assert obs == hf.apply_chat_template(ROW["prompt"], add_generation_prompt=True, tokenize=False)
    assert obs.startswith("<|im_start|>system\nYou are a careful researcher.<|im_end|>\n")
