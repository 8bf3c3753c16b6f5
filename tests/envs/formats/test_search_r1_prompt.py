"""Search-R1 parity of prompts: every message of a parquet `prompt` is kept (system included) with
instruction=None, and a tokenizer's chat template can render the prompt, as Search-R1's dataset does."""

from __future__ import annotations

from typing import Any

import pytest

from rlf_envs.formats import SearchR1Format
from rlf_envs.tasks.parquet import row_to_task
from rlf_envs.types import Task

ROW = {
    "data_source": "nq",
    "prompt": [{"role": "system", "content": "You are a careful researcher."},
               {"role": "user", "content": "Answer the given question... Question: who wrote hamlet?\n"}],
    "ability": "fact-reasoning",
    "reward_model": {"style": "rule", "ground_truth": {"target": ["Shakespeare"]}},
    "extra_info": {"split": "train", "index": 7},
}


def test_instruction_none_keeps_the_system_message() -> None:
    task = row_to_task(ROW, default_id="x", where="row 0")
    fmt = SearchR1Format(instruction=None)
    assert fmt.messages(task) == ROW["prompt"]
    prompt = fmt.render_prompt(task, [])
    assert prompt == "You are a careful researcher.\n\nAnswer the given question... Question: who wrote hamlet?\n"
    wrapped = SearchR1Format(instruction=None, chat_wrap=True).render_prompt(task, [])
    assert wrapped == ("<|im_start|>system\nYou are a careful researcher.<|im_end|>\n<|im_start|>user\n"
                       "Answer the given question... Question: who wrote hamlet?\n<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_option() -> None:
    seen: list[Any] = []

    class FakeTokenizer:  # the duck type: transformers' apply_chat_template signature
        def apply_chat_template(self, messages: Any, add_generation_prompt: bool, tokenize: bool) -> str:
            seen.append((messages, add_generation_prompt, tokenize))
            return "RENDERED"

    task = row_to_task(ROW, default_id="x", where="row 0")
    assert SearchR1Format(instruction=None, chat_template=FakeTokenizer()).render_prompt(task, []) == "RENDERED"
    assert seen == [(ROW["prompt"], True, False)]
    # the default instruction, through a plain callable
    out = SearchR1Format(chat_template=lambda msgs: f"{len(msgs)}:{msgs[0]['role']}").render_prompt(Task("1", "Q?"), [])
    assert out == "1:user"
    assert SearchR1Format().render_prompt(Task("1", "Q?"), []).endswith("Question: Q?\n")  # off by default
    with pytest.raises(TypeError, match="apply_chat_template"):
        SearchR1Format(chat_template="qwen3")
    with pytest.raises(ValueError, match="not both"):
        SearchR1Format(chat_template=FakeTokenizer(), chat_wrap=True)
