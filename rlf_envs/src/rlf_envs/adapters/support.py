"""Helpers of the SkyRL, verl, NeMo-Gym and OpenEnv adapters: a trainer row's task as rlf reset options, and rlf
text as chat messages for trainers whose env protocol speaks messages (SkyRL-Gym, NeMo-Gym, OpenEnv).

An rlf env renders its whole context as text: the prompt (tool schemas in the system turn, the user turn, the
generation prompt) and, after each policy turn, an observation that closes the policy's turn and opens the
next one. For ChatML formats (`qwen3`/`hermes`, `search_r1` with `chat_wrap=True`) that text is a sequence of
`<|im_start|>ROLE\\n...<|im_end|>\\n` blocks; `chatml_messages` splits it into the messages that a ChatML chat
template (Qwen's) renders back to the same text, so a trainer that re-applies its chat template to the
messages reproduces rlf's prompt and observations byte for byte. Text that is not ChatML (e.g. Search-R1's
base-model prompt) becomes one user message holding it verbatim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlf_envs.types import Message, Task

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


@dataclass(frozen=True, slots=True)
class ChatSplit:
    """A ChatML text split into messages. `generation_prompt` is the open turn at the end (e.g.
    `<|im_start|>assistant\\n`, with an empty think block when thinking is off): a chat template adds it itself
    (`add_generation_prompt=True`). `chatml` is False when the text had no ChatML markers (one user message)."""

    messages: list[dict[str, str]]
    generation_prompt: str
    chatml: bool


def chatml_messages(text: str) -> ChatSplit:
    """Split rlf's rendered text into chat messages (see the module docstring). A leading `<|im_end|>\\n`
    (the close of the policy's turn that an observation starts with) is dropped: the chat template closes the
    assistant turn itself. Linear in the text length."""
    if IM_START not in text:
        return ChatSplit([{"role": "user", "content": text}] if text else [], "", False)
    messages: list[dict[str, str]] = []
    gen = ""
    pos = text.find(IM_START)
    while pos >= 0:
        head_end = text.find("\n", pos)
        if head_end < 0:  # `<|im_start|>role` with nothing after: an open turn
            gen = text[pos:]
            break
        role = text[pos + len(IM_START): head_end]
        end = text.find(IM_END, head_end + 1)
        if end < 0:  # the open turn the policy continues (the generation prompt)
            gen = text[pos:]
            break
        messages.append({"role": role, "content": text[head_end + 1: end]})
        pos = text.find(IM_START, end + len(IM_END))
    return ChatSplit(messages, gen, True)


def observation_content(text: str) -> str:
    """The observation as the content of one message: the non-assistant turns' contents of a ChatML observation
    joined by a newline (Qwen3: the user turn holding the `<tool_response>` blocks), or the text verbatim."""
    split = chatml_messages(text)
    if not split.chatml:
        return text
    return "\n".join(m["content"] for m in split.messages if m["role"] != "assistant")


def task_options(fields: Mapping[str, Any], prompt: Sequence[Mapping[str, str]] | None = None, ground_truth: Any = None,
                 task_id: str = "row") -> dict[str, Any] | None:
    """rlf reset options from a trainer's dataset row: `fields["task"]` (an rlf task dict), `fields["task_index"]`,
    or the trainer's own ground truth with the row's prompt messages (kept verbatim as the task's messages; the
    last user message is its question). None: the env picks one of its tasks."""
    if fields.get("task") is not None:
        return {"task": fields["task"]}
    if fields.get("task_index") is not None:
        return {"task_index": int(fields["task_index"])}
    if ground_truth is not None:
        if not prompt:
            raise ValueError("a row with a ground truth but no task needs its prompt messages to make the rlf task")
        msgs = tuple(Message(str(m["role"]), str(m["content"])) for m in prompt)
        question = next((m.content for m in reversed(msgs) if m.role == "user"), msgs[-1].content)
        gt = ground_truth.tolist() if hasattr(ground_truth, "tolist") else ground_truth  # numpy from parquet rows
        return {"task": Task(id=task_id, question=question, ground_truth=gt, messages=msgs)}
    return None
