"""Search-R1's tag protocol: `<search>q</search>` -> `<information>...</information>`, `<answer>a</answer>`."""

from __future__ import annotations

from collections.abc import Sequence

from rlf_envs.formats.base import Format
from rlf_envs.formats.tags import tagged
from rlf_envs.tools.base import ToolSpec
from rlf_envs.types import Action, ActionKind, Task, ToolCall, ToolResult

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
    messages / question verbatim (e.g. Search-R1 parquet prompts, which already contain it).
    `chat_wrap` wraps the prompt in Qwen/ChatML markup (`<|im_start|>user ... <|im_start|>assistant`).
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
    ) -> None:
        self.explain_errors = explain_errors  # False: Search-R1's exact correction text
        self.instruction = instruction
        self.tool_name = tool_name
        self.query_arg = query_arg
        self.chat_wrap = chat_wrap
        self.max_calls_per_turn = max_calls_per_turn

    def render_prompt(self, task: Task, tools: Sequence[ToolSpec], system_prompt: str | None = None) -> str:
        user = [m.content for m in task.messages if m.role == "user"]
        if self.instruction is None:
            body = user[-1] if user else task.question
        else:
            body = self.instruction.format(question=task.question.strip())
        if not self.chat_wrap:
            return (system_prompt + "\n\n" if system_prompt else "") + body
        sys_part = f"<|im_start|>system\n{system_prompt}<|im_end|>\n" if system_prompt else ""
        return f"{sys_part}<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"

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
