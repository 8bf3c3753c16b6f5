"""Search-R1's tag protocol: `<search>q</search>` -> `<information>...</information>`, `<answer>a</answer>`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlf_envs.formats.base import Format
from rlf_envs.formats.tags import tagged
from rlf_envs.types import Action, ActionKind, Task, ToolCall, ToolResult, ToolSpec

SEARCH_R1_INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
    "get new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. Question: {question}\n"
)

CORRECTION = (
    "\nMy previous action is invalid{why}. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)


class SearchR1Format(Format):
    """Search-R1 tags. Every `<search>` block before an `<answer>` is one call (run concurrently).

    `instruction` is a template with `{question}`; set `instruction=None` to use the task's own chat
    messages / question verbatim (e.g. Search-R1 parquet prompts, which already contain it; every message
    is kept, system messages included).

    How the messages become the prompt text:
    - default (base models): the messages' contents, joined by a blank line;
    - `chat_template=<tokenizer>` (anything with transformers' `apply_chat_template`, or a callable
      `messages -> str`): the tokenizer's own chat template with the generation prompt, as Search-R1's
      dataset does whenever the tokenizer has one (for a chat model);
    - `chat_wrap=True`: Qwen/ChatML markup (`<|im_start|>role ... <|im_start|>assistant`) without a tokenizer.
    """

    name = "search_r1"
    stop_strings = ("</search>", "</answer>")

    def __init__(
        self,
        instruction: str | None = SEARCH_R1_INSTRUCTION,
        tool_name: str = "search",
        query_arg: str = "query",
        chat_wrap: bool = False,
        max_calls_per_turn: int = 4,
        explain_errors: bool = True,
        chat_template: Any = None,
    ) -> None:
        if chat_template is not None and chat_wrap:
            raise ValueError("give chat_template (a tokenizer's template) or chat_wrap=True (ChatML), not both")
        if chat_template is not None and not (
            callable(chat_template) or callable(getattr(chat_template, "apply_chat_template", None))
        ):
            raise TypeError(
                "chat_template must be a tokenizer with apply_chat_template (e.g. transformers' AutoTokenizer) "
                f"or a callable messages -> str, got {type(chat_template).__name__}"
            )
        self.chat_template = chat_template
        self.explain_errors = explain_errors  # False: Search-R1's exact correction text
        self.instruction = instruction
        self.tool_name = tool_name
        self.query_arg = query_arg
        self.chat_wrap = chat_wrap
        self.max_calls_per_turn = max_calls_per_turn

    def messages(self, task: Task, system_prompt: str | None = None) -> list[dict[str, str]]:
        """The prompt as chat messages: the task's own (instruction=None) or the instruction on its question."""
        if self.instruction is None:
            msgs = [m.to_dict() for m in task.messages] or [{"role": "user", "content": task.question}]
        else:
            msgs = [{"role": "user", "content": self.instruction.format(question=task.question.strip())}]
        if system_prompt and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": system_prompt})
        return msgs

    def render_prompt(self, task: Task, tools: Sequence[ToolSpec], system_prompt: str | None = None) -> str:
        msgs = self.messages(task, system_prompt)
        if self.chat_template is not None:
            apply = getattr(self.chat_template, "apply_chat_template", None)
            if apply is None:
                return str(self.chat_template(msgs))
            return str(apply(msgs, add_generation_prompt=True, tokenize=False))
        if self.chat_wrap:
            turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
            return f"{turns}<|im_start|>assistant\n"
        return "\n\n".join(m["content"] for m in msgs)

    def __deepcopy__(self, memo: dict[int, Any]) -> SearchR1Format:
        # stateless; the tokenizer behind chat_template is shared, never copied (gymnasium.make deep-copies kwargs)
        return self

    def parse(self, text: str) -> Action:
        calls: list[ToolCall] = []
        for tag, raw in tagged(text, "search", "answer"):
            inner = raw.strip()
            if tag == "answer":
                if calls:  # searches before an answer in the same turn: run them, answer next turn
                    break
                return Action(ActionKind.ANSWER, text, answer=inner)
            if not inner:
                return Action(ActionKind.INVALID, text, error="empty <search></search> query")
            calls.append(ToolCall(self.tool_name, {self.query_arg: inner}, id=f"call_{len(calls)}"))
        if not calls:
            return Action(ActionKind.INVALID, text, error="no <search>...</search> or <answer>...</answer> found")
        if len(calls) > self.max_calls_per_turn:
            return Action(
                ActionKind.INVALID, text, error=f"{len(calls)} searches in one turn; at most {self.max_calls_per_turn}"
            )
        return Action(ActionKind.TOOL_CALLS, text, calls=tuple(calls))

    def render_observation(self, action_text: str, results: Sequence[ToolResult]) -> str:
        body = "\n".join(r.content.strip() for r in results)
        return f"\n\n<information>{body}</information>\n\n"

    def render_correction(self, action_text: str, action: Action) -> str:
        why = f" ({action.error})" if self.explain_errors and action.error else ""
        return CORRECTION.format(why=why)
