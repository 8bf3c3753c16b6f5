"""OpenAI-shaped chat messages <-> the exact text a format's policy sees: what the agent endpoint
(`rlf_train.rollout.endpoint`) renders prompts with and parses replies with.

A `ChatCodec` wraps one rlf `Format`, so an agent talking to the endpoint sees the same prompt text an rlf
env of that format would show (tools in the system turn for Qwen3, Search-R1's tags for `search_r1`), and
the policy's reply is parsed by the format's own parser:

- `render(messages, tools)`: a whole conversation, as the format's chat template renders it (Qwen3's
  published template for `qwen3`, including its assistant/tool turns and its `<think>` rules), ending with
  the generation prompt. Used when a segment starts.
- `render_tail(action_text, tail)`: the text after a reply the policy generated, up to the next generation
  prompt: the rest of the policy's turn (`<|im_end|>` when generation stopped early), then the new messages
  (tool results grouped as the template groups them). The endpoint appends its ids to the exact ids of the
  conversation so far, so the policy's own tokens are never re-tokenised.
- `parse_reply(text)`: the generated text as an assistant message: `content`, `reasoning` (a Qwen3 `<think>`
  block) and `tool_calls` (the format's parser; a malformed call stays plain content).

Nothing here imports torch; messages are frozen dataclasses, compared as values.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rlf_envs.formats.base import Format
from rlf_envs.formats.qwen3 import IM_END, IM_START, TOOLS_FOOTER, TOOLS_HEADER, Qwen3Format, _tojson
from rlf_envs.formats.search_r1 import SearchR1Format
from rlf_envs.types import ActionKind, ToolCall, ToolResult, ToolSpec

Role = Literal["system", "user", "assistant", "tool"]
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ChatToolCall:
    """A function call of an assistant message, OpenAI's shape: `arguments` is the JSON text."""

    id: str
    name: str
    arguments: str

    def args_value(self) -> Any:
        """The arguments as a value (the text itself when it is not JSON): what two calls are compared by."""
        try:
            return json.loads(self.arguments)
        except (ValueError, RecursionError):
            return self.arguments


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat message. `reasoning` is an assistant's `reasoning_content` (None when not given)."""

    role: Role
    content: str = ""
    tool_calls: tuple[ChatToolCall, ...] = ()
    tool_call_id: str | None = None
    reasoning: str | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    """A generated turn read as an assistant message."""

    text: str  # everything generated, stop string included
    content: str
    reasoning: str | None
    tool_calls: tuple[ChatToolCall, ...]
    answer: str | None  # the format's final answer (`<answer>...</answer>`), when the turn gave one

    def message(self) -> ChatMessage:
        return ChatMessage("assistant", self.content, self.tool_calls, reasoning=self.reasoning)

    def matches(self, sent: ChatMessage) -> bool:
        """Whether `sent` (an assistant message a client sent back) is this reply: the same tool calls (ids,
        names, argument values) and the same content, with or without its reasoning / think block (clients
        drop `reasoning_content`, some keep the whole text)."""
        if sent.role != "assistant":
            return False
        mine = [(c.id, c.name, c.args_value()) for c in self.tool_calls]
        theirs = [(c.id, c.name, c.args_value()) for c in sent.tool_calls]
        if mine != theirs:
            return False
        got = sent.content.strip()
        return got in {self.content.strip(), _strip_end(self.text).strip()}


def _strip_end(text: str) -> str:
    return text[: -len(IM_END)] if text.endswith(IM_END) else text


def split_think(text: str) -> tuple[str | None, str]:
    """(reasoning, rest) of a reply that opens with a `<think>` block (Qwen3), else (None, text)."""
    head = text.lstrip("\n")
    if not head.startswith(THINK_OPEN):
        return None, text
    close = head.find(THINK_CLOSE)
    if close < 0:  # cut off while thinking: everything is reasoning
        return head[len(THINK_OPEN):].strip("\n"), ""
    return head[len(THINK_OPEN):close].strip("\n"), head[close + len(THINK_CLOSE):].lstrip("\n")


class ChatCodec:
    """Render/parse chat messages for one rlf format (`qwen3` or `search_r1`); see the module docstring."""

    def __init__(self, fmt: Format) -> None:
        if not isinstance(fmt, Qwen3Format | SearchR1Format):
            raise ValueError(f"the agent endpoint renders chats for the qwen3 and search_r1 formats, not "
                             f"{type(fmt).__name__}; use env.kwargs.format qwen3 or search_r1")
        self.format = fmt
        self.qwen3 = isinstance(fmt, Qwen3Format)
        self.stop_strings = tuple(fmt.stop_strings)

    # -- rendering --------------------------------------------------------------------------------
    def render(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec | dict[str, Any]]) -> str:
        """The whole conversation and the generation prompt (see the module docstring). A tool given as a
        dict (what a client sent) is rendered as it is, key order kept, as the chat template renders it."""
        if not messages:
            raise ValueError("messages is empty")
        return self._render_qwen3(messages, tools) if self.qwen3 else self._render_plain(messages)

    def render_tail(self, action_text: str, tail: Sequence[ChatMessage]) -> str:
        """The text after the generated `action_text`: its turn's end, the `tail` messages, the generation
        prompt."""
        if self.qwen3:
            fmt = self.format
            assert isinstance(fmt, Qwen3Format)
            close = "\n" if action_text.endswith(IM_END) else f"{IM_END}\n"
            return close + self._qwen3_messages(tail, first=1, last_query=-1, prior_tool=False) \
                + fmt.generation_prompt()
        return self._plain_messages(tail)

    def _render_qwen3(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec | dict[str, Any]]) -> str:
        fmt = self.format
        assert isinstance(fmt, Qwen3Format)
        out: list[str] = []
        rest = list(messages)
        first_system = rest[0].content if rest[0].role == "system" else None
        if tools:
            listed = "".join("\n" + _tojson(t if isinstance(t, dict) else t.to_openai()) for t in tools)
            out.append(f"{IM_START}system\n" + (first_system + "\n\n" if first_system is not None else "")
                       + TOOLS_HEADER + listed + TOOLS_FOOTER + f"{IM_END}\n")
        elif first_system is not None:
            out.append(f"{IM_START}system\n{first_system}{IM_END}\n")
        start = 1 if first_system is not None else 0
        # the template's last_query_index: the last user message that is not a tool response wrapped by hand
        last_query = len(messages) - 1
        for i in range(len(messages) - 1, -1, -1):
            m = messages[i]
            if m.role == "user" and not (m.content.startswith("<tool_response>")
                                         and m.content.endswith("</tool_response>")):
                last_query = i
                break
        out.append(self._qwen3_messages(rest[start:], first=start, last_query=last_query, prior_tool=False,
                                        total=len(messages)))
        out.append(fmt.generation_prompt())
        return "".join(out)

    def _qwen3_messages(self, msgs: Sequence[ChatMessage], *, first: int, last_query: int, prior_tool: bool,
                        total: int | None = None) -> str:
        """Messages rendered as Qwen3's template renders them at positions first, first+1, ... of a
        conversation of `total` messages (None: a tail, where the assistant rules of the last query do not
        apply: a tail's assistant messages are rendered as written)."""
        out: list[str] = []
        for k, m in enumerate(msgs):
            index = first + k
            prev_tool = (msgs[k - 1].role == "tool") if k else prior_tool
            next_tool = k + 1 < len(msgs) and msgs[k + 1].role == "tool"
            if m.role in ("user", "system"):
                out.append(f"{IM_START}{m.role}\n{m.content}{IM_END}\n")
            elif m.role == "assistant":
                content, reasoning = m.content, m.reasoning
                if reasoning is None:
                    reasoning = ""
                    if THINK_CLOSE in content:
                        reasoning = content.split(THINK_CLOSE)[0].rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n")
                        content = content.split(THINK_CLOSE)[-1].lstrip("\n")
                is_last = total is not None and index == total - 1
                if total is not None and index > last_query and (is_last or reasoning):
                    out.append(f"{IM_START}assistant\n{THINK_OPEN}\n{reasoning.strip(chr(10))}\n{THINK_CLOSE}\n\n"
                               + content.lstrip("\n"))
                else:
                    out.append(f"{IM_START}assistant\n{content}")
                for j, c in enumerate(m.tool_calls):
                    if j or content:
                        out.append("\n")
                    out.append(f'<tool_call>\n{{"name": "{c.name}", "arguments": {c.arguments}}}\n</tool_call>')
                out.append(f"{IM_END}\n")
            else:  # tool
                if not prev_tool:
                    out.append(f"{IM_START}user")
                out.append(f"\n<tool_response>\n{m.content}\n</tool_response>")
                if not next_tool:
                    out.append(f"{IM_END}\n")
        return "".join(out)

    def _render_plain(self, messages: Sequence[ChatMessage]) -> str:
        """Search-R1 (a base model, no chat markup): the leading system/user messages as its prompt, the rest
        as the env appends turns and observations."""
        k = 0
        while k < len(messages) and messages[k].role in ("system", "user"):
            k += 1
        if k == 0:
            raise ValueError("the conversation must start with a system or user message")
        fmt = self.format
        assert isinstance(fmt, SearchR1Format)
        if fmt.chat_wrap or fmt.chat_template is not None:
            raise ValueError("the agent endpoint renders search_r1 without chat markup (chat_wrap / chat_template "
                             "unset): use format qwen3 for a chat model")
        head = "\n\n".join(m.content for m in messages[:k])
        return head + self._plain_messages(messages[k:])

    def _plain_messages(self, msgs: Sequence[ChatMessage]) -> str:
        out: list[str] = []
        k = 0
        while k < len(msgs):
            m = msgs[k]
            if m.role == "tool":  # consecutive tool results are one observation, as the env renders them
                j = k
                while j < len(msgs) and msgs[j].role == "tool":
                    j += 1
                results = [ToolResult(ToolCall("tool"), x.content) for x in msgs[k:j]]
                out.append(self.format.render_observation("", results))
                k = j
                continue
            out.append(m.content)
            k += 1
        return "".join(out)

    # -- parsing ----------------------------------------------------------------------------------
    def parse_reply(self, text: str, call_id: str = "call") -> Reply:
        """The generated `text` as an assistant message; tool-call ids are `{call_id}_{k}`."""
        action = self.format.parse(text)
        calls = tuple(ChatToolCall(f"{call_id}_{k}", c.name, _tojson(c.arguments))
                      for k, c in enumerate(action.calls)) if action.kind is ActionKind.TOOL_CALLS else ()
        answer = action.answer if action.kind is ActionKind.ANSWER else None
        if not self.qwen3:
            return Reply(text, text, None, calls, answer)
        reasoning, body = split_think(_strip_end(text))
        if calls:  # the content is what precedes the first call, as the template renders it back
            body = body[: body.find("<tool_call>")].rstrip("\n")
        return Reply(text, body, reasoning, calls, answer)
