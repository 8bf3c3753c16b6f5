"""rlf's Qwen3 format renders exactly what a real Qwen3 tokenizer's chat template renders.

Uses transformers' own chat-template machinery with Qwen3's published template
(tests/support/assets/qwen3_chat_template.jinja, Apache-2.0: see tests/support/assets/NOTICE.md) on a tokenizer
built offline.
"""

from __future__ import annotations

import json

import pytest
from repo_paths import SUPPORT

from rlf_envs.formats import Qwen3Format
from rlf_envs.tools.base import ToolSpec
from rlf_envs.types import Task, ToolCall, ToolResult

TEMPLATE = SUPPORT / "assets" / "qwen3_chat_template.jinja"  # shipped, see NOTICE.md

SPECS = [
    ToolSpec("search", "Search a corpus. Returns top documents.",
             {"type": "object", "properties": {"query": {"type": "string", "description": "what to look for"},
                                               "topk": {"type": "integer", "default": 3}}, "required": ["query"]}),
    ToolSpec("calculator", "Évalue une expression (unicode kept)", {"type": "object", "properties": {}}),
]


@pytest.fixture(scope="module")
def hf_tokenizer():  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    if not TEMPLATE.exists():
        pytest.fail(f"test asset {TEMPLATE} is missing")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world tool call search answer"], trainer)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    hf.chat_template = TEMPLATE.read_text()
    return hf


def tools_json() -> list[dict]:  # type: ignore[type-arg]
    return [s.to_openai() for s in SPECS]


@pytest.mark.parametrize("system", [None, "You are a helpful assistant."])
@pytest.mark.parametrize("thinking", [None, False])
def test_prompt_matches_chat_template(hf_tokenizer, system, thinking) -> None:  # type: ignore[no-untyped-def]
    fmt = Qwen3Format(enable_thinking=thinking)
    task = Task("1", "What is the capital of Zorbania?")
    ours = fmt.render_prompt(task, SPECS, system_prompt=system)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    ref = hf_tokenizer.apply_chat_template(fmt.messages(task, system), tools=tools_json(), tokenize=False,
                                           add_generation_prompt=True, **kwargs)
    assert ours == ref


def test_prompt_without_tools_matches(hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    fmt = Qwen3Format()
    task = Task("1", "Hi", messages=())
    for system in (None, "sys"):
        msgs = fmt.messages(task, system)
        assert fmt.render_messages(msgs, []) == hf_tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True)


def test_whole_episode_matches_chat_template(hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """prompt + policy turns + rendered tool responses == the template applied to the whole conversation."""
    fmt = Qwen3Format()
    task = Task("1", "Capital of Zorbania, and 6*7?")
    calls1 = [{"name": "search", "arguments": {"query": "Zorbania", "topk": 2}},
              {"name": "calculator", "arguments": {"expression": "6*7"}}]
    reasoning1, reasoning2 = "I should look it up.", "Now I know."
    turn1 = (f"<think>\n{reasoning1}\n</think>\n\n"
             + "\n".join(f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls1)
             + "<|im_end|>")
    results = [ToolResult(ToolCall("search", {}), "Doc 1(Title: Zorbania) Its capital is Velmora."),
               ToolResult(ToolCall("calculator", {}), "42")]
    turn2 = f"<think>\n{reasoning2}\n</think>\n\n<answer>Velmora, 42</answer><|im_end|>"

    text = fmt.render_prompt(task, SPECS)
    action = fmt.parse(turn1)
    assert [c.arguments for c in action.calls] == [c["arguments"] for c in calls1]
    text += turn1 + fmt.render_observation(turn1, results) + turn2

    messages = [
        *fmt.messages(task),
        {"role": "assistant", "content": "", "reasoning_content": reasoning1,
         "tool_calls": [{"type": "function", "function": c} for c in calls1]},
        *({"role": "tool", "content": r.content} for r in results),
        {"role": "assistant", "content": "<answer>Velmora, 42</answer>", "reasoning_content": reasoning2},
    ]
    ref = hf_tokenizer.apply_chat_template(messages, tools=tools_json(), tokenize=False)
    assert text == ref.rstrip("\n")  # the template adds the newline after the final <|im_end|>
