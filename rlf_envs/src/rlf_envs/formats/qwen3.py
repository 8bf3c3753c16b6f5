"""Qwen3 / Hermes tool calling, rendered exactly as Qwen3's published chat template renders it.

Prompt: `<|im_start|>system ... # Tools ... <tools>{schemas}</tools> ...<|im_end|>` then the user turn and
the generation prompt. Calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (several per
turn). Results: one user turn holding `<tool_response>\\n...\\n</tool_response>` per call. Final answer:
`<answer>...</answer>`, or (answer_mode="no_call") any turn without tool calls.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from rlf_envs.formats.base import Format
from rlf_envs.formats.tags import first_inner, inners, strip_blocks
from rlf_envs.types import Action, ActionKind, Task, ToolCall, ToolResult, ToolSpec

IM_START, IM_END = "<|im_start|>", "<|im_end|>"

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
CALL_HOWTO = (
    'Call a tool as <tool_call>\n{"name": "<tool name>", "arguments": {<arguments as a JSON object>}}\n</tool_call>'
)


def _tojson(x: Any) -> str:
    # transformers' chat-template `tojson`: key order kept, no ASCII escaping, default separators
    return json.dumps(x, ensure_ascii=False)


def _load_json(raw: str) -> tuple[Any, str | None]:
    """`json.loads(raw)`, or the reason it failed. Hostile input raises more than JSONDecodeError: nesting
    ~1,000 deep raises RecursionError, an integer literal of more than 4,300 digits ValueError."""
    try:
        return json.loads(raw), None
    except json.JSONDecodeError as e:
        return None, e.msg
    except RecursionError:
        return None, "nested too deeply"
    except ValueError as e:  # int literal beyond sys.get_int_max_str_digits(), and the like
        return None, str(e).split(";")[0]


class Qwen3Format(Format):
    """Qwen3 / Hermes tool-call format.

    enable_thinking: None (template default: the model opens its own `<think>`), False (the generation
    prompt carries an empty think block, as `apply_chat_template(enable_thinking=False)` does).
    answer_mode: "tag" (final answer in `<answer>...</answer>`) or "no_call" (a turn without calls ends
    the episode; its text, minus any think block, is the answer).
    """

    name = "qwen3"
    stop_strings = (IM_END,)

    def __init__(
        self,
        answer_mode: Literal["tag", "no_call"] = "tag",
        enable_thinking: bool | None = None,
        max_calls_per_turn: int = 8,
        answer_instruction: str | None = "Give your final answer inside <answer></answer>.",
    ) -> None:
        if answer_mode not in ("tag", "no_call"):
            raise ValueError(f"answer_mode must be 'tag' or 'no_call', got {answer_mode!r}")
        self.answer_mode = answer_mode
        self.enable_thinking = enable_thinking
        self.max_calls_per_turn = max_calls_per_turn
        self.answer_instruction = answer_instruction if answer_mode == "tag" else None
        # the rendered tool list of the last few spec lists, keyed by the specs' identities (specs are frozen and
        # their schemas are not changed after a tool is made: the caller compiles its validators from them once)
        self._tools_text: dict[tuple[int, ...], tuple[tuple[ToolSpec, ...], str]] = {}

    # -- prompt ---------------------------------------------------------------------------------
    def messages(self, task: Task, system_prompt: str | None = None) -> list[dict[str, str]]:
        """The chat messages of the prompt (what `apply_chat_template` would be given)."""
        msgs = [m.to_dict() for m in task.messages]
        if not msgs:
            question = task.question
            if self.answer_instruction:
                question = f"{question}\n{self.answer_instruction}"
            msgs = [{"role": "user", "content": question}]
        if system_prompt and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": system_prompt})
        return msgs

    def generation_prompt(self) -> str:
        g = f"{IM_START}assistant\n"
        if self.enable_thinking is False:
            g += "<think>\n\n</think>\n\n"
        return g

    def render_messages(self, messages: Sequence[dict[str, str]], tools: Sequence[ToolSpec]) -> str:
        """Render system/user messages + generation prompt exactly like Qwen3's template."""
        out: list[str] = []
        rest = list(messages)
        if tools:
            out.append(f"{IM_START}system\n")
            if rest and rest[0]["role"] == "system":
                out.append(rest[0]["content"] + "\n\n")
                rest = rest[1:]
            out.append(self._render_tools(tools))
        elif rest and rest[0]["role"] == "system":
            out.append(f"{IM_START}system\n{rest[0]['content']}{IM_END}\n")
            rest = rest[1:]
        for m in rest:
            if m["role"] not in ("user", "system"):
                raise ValueError(f"prompt messages may only be system/user turns, got role {m['role']!r}")
            out.append(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n")
        out.append(self.generation_prompt())
        return "".join(out)

    def _render_tools(self, tools: Sequence[ToolSpec]) -> str:
        """The system turn's tool list (the same text for the same specs: rendered once, not per episode)."""
        key = tuple(id(t) for t in tools)
        hit = self._tools_text.get(key)
        if hit is not None:
            return hit[1]
        text = TOOLS_HEADER + "".join("\n" + _tojson(spec.to_openai()) for spec in tools) + TOOLS_FOOTER + f"{IM_END}\n"
        if len(self._tools_text) >= 8:
            self._tools_text.clear()  # (simple and safe if two threads render at once)
        self._tools_text[key] = (tuple(tools), text)  # the specs are kept, so their ids are not reused
        return text

    def render_prompt(self, task: Task, tools: Sequence[ToolSpec], system_prompt: str | None = None) -> str:
        return self.render_messages(self.messages(task, system_prompt), tools)

    # -- parsing --------------------------------------------------------------------------------
    def parse(self, text: str) -> Action:
        body = text[: -len(IM_END)] if text.endswith(IM_END) else text
        blocks = inners(body, "tool_call")
        n_open = body.count("<tool_call>")
        if n_open != len(blocks) or body.count("</tool_call>") != len(blocks):
            return Action(ActionKind.INVALID, text, error="a <tool_call> tag is not closed (or a stray </tool_call>)")
        calls: list[ToolCall] = []
        for i, raw in enumerate(blocks):
            obj, problem = _load_json(raw)
            if problem is not None:
                return Action(ActionKind.INVALID, text, error=f"tool call {i + 1} is not valid JSON ({problem})")
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return Action(ActionKind.INVALID, text, error=f'tool call {i + 1} needs a string "name"')
            args = obj.get("arguments", {})
            if isinstance(args, str):  # some models emit arguments as a JSON string
                args, problem = _load_json(args) if args.strip() else ({}, None)
                if problem is not None:
                    err = f'tool call {i + 1}: "arguments" is not JSON ({problem})'
                    return Action(ActionKind.INVALID, text, error=err)
            if not isinstance(args, dict):
                return Action(ActionKind.INVALID, text, error=f'tool call {i + 1}: "arguments" must be a JSON object')
            calls.append(ToolCall(obj["name"], args, id=f"call_{i}"))
        if calls:
            if len(calls) > self.max_calls_per_turn:
                err = f"{len(calls)} tool calls in one turn; at most {self.max_calls_per_turn}"
                return Action(ActionKind.INVALID, text, error=err)
            return Action(ActionKind.TOOL_CALLS, text, calls=tuple(calls))
        answer = first_inner(body, "answer")
        if answer is not None:
            return Action(ActionKind.ANSWER, text, answer=answer.strip())
        if self.answer_mode == "no_call":
            return Action(ActionKind.ANSWER, text, answer=strip_blocks(body, "think").strip())
        return Action(ActionKind.INVALID, text, error="no <tool_call> and no <answer>...</answer> in the turn")

    # -- observations -----------------------------------------------------------------------------
    def _close_turn(self, action_text: str) -> str:
        return "\n" if action_text.endswith(IM_END) else f"{IM_END}\n"

    def render_observation(self, action_text: str, results: Sequence[ToolResult]) -> str:
        parts = [self._close_turn(action_text), f"{IM_START}user"]
        for r in results:
            parts.append(f"\n<tool_response>\n{r.content}\n</tool_response>")
        parts.append(f"{IM_END}\n")
        parts.append(self.generation_prompt())
        return "".join(parts)

    def render_correction(self, action_text: str, action: Action) -> str:
        how = CALL_HOWTO + (", or answer as <answer>...</answer>." if self.answer_mode == "tag" else ".")
        msg = f"Your last turn was invalid: {action.error}. {how}"
        return f"{self._close_turn(action_text)}{IM_START}user\n{msg}{IM_END}\n{self.generation_prompt()}"
