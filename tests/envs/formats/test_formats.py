"""Tool-call formats: parsing (good and malformed turns) and observation rendering."""

from __future__ import annotations

import pytest

from rlf_envs.formats import Qwen3Format, SearchR1Format, get_format
from rlf_envs.tools.base import ToolSpec
from rlf_envs.types import ActionKind, Task, ToolCall, ToolResult, ToolStatus

Q = Qwen3Format()


def test_qwen3_parses_several_calls() -> None:
    text = (
        "<think>\nneed two lookups\n</think>\n\n"
        '<tool_call>\n{"name": "search", "arguments": {"query": "a"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calc", "arguments": "{\\"x\\": 2}"}\n</tool_call><|im_end|>'
    )
    a = Q.parse(text)
    assert a.kind is ActionKind.TOOL_CALLS
    assert a.calls == (ToolCall("search", {"query": "a"}, "call_0"), ToolCall("calc", {"x": 2}, "call_1"))
    assert a.text == text


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('<tool_call>\n{"name": "s", "arguments": {}}', "not closed"),
        ('<tool_call>{"name": "s", "arguments": {}</tool_call>', "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'needs a string "name"'),
        ('<tool_call>["s"]</tool_call>', 'needs a string "name"'),
        ('<tool_call>{"name": "s", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "s", "arguments": "{oops"}</tool_call>', '"arguments" is not JSON'),
        ("just chatting<|im_end|>", "no <tool_call> and no <answer>"),
        ("</tool_call>", "not closed"),
    ],
)
def test_qwen3_malformed_turns_get_specific_errors(text: str, error: str) -> None:
    a = Q.parse(text)
    assert a.kind is ActionKind.INVALID
    assert error in (a.error or "")
    correction = Q.render_correction(text, a)
    assert error in correction and "<tool_call>" in correction  # says what was wrong and how to call
    assert correction.endswith("<|im_start|>assistant\n")


def test_qwen3_answers() -> None:
    assert Q.parse("<answer> Paris </answer><|im_end|>").answer == "Paris"
    no_call = Qwen3Format(answer_mode="no_call")
    a = no_call.parse("<think>\nhmm\n</think>\n\nIt is Paris.<|im_end|>")
    assert a.kind is ActionKind.ANSWER and a.answer == "It is Paris."
    with pytest.raises(ValueError, match="answer_mode"):
        Qwen3Format(answer_mode="maybe")  # type: ignore[arg-type]
    many = "".join('<tool_call>{"name": "s", "arguments": {}}</tool_call>' for _ in range(9))
    assert "at most 8" in (Q.parse(many).error or "")


def test_qwen3_observation_markers() -> None:
    res = [ToolResult(ToolCall("s", {}), "r1"), ToolResult(ToolCall("s", {}), "Error: x", ToolStatus.ERROR)]
    obs = Q.render_observation("...</tool_call><|im_end|>", res)
    assert obs == (
        "\n<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nError: x\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    # a turn that did not end with <|im_end|> gets it closed by the env (as an observation token)
    assert Q.render_observation("...</tool_call>", res).startswith("<|im_end|>\n<|im_start|>user")
    assert Qwen3Format(enable_thinking=False).render_observation("<|im_end|>", res).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_search_r1_parse_and_render() -> None:
    f = SearchR1Format()
    a = f.parse("<think>need it</think>\n<search> capital of Zorbania </search>")
    assert a.kind is ActionKind.TOOL_CALLS
    assert a.calls == (ToolCall("search", {"query": "capital of Zorbania"}, "call_0"),)
    assert f.parse("<think>ok</think><answer> Velmora </answer>").answer == "Velmora"
    two = f.parse("<search>a</search><search>b</search>")
    assert [c.arguments["query"] for c in two.calls] == ["a", "b"]
    bad = f.parse("I think the answer is 4")
    assert bad.kind is ActionKind.INVALID
    corr = f.render_correction(bad.text, bad)
    assert corr.startswith("\nMy previous action is invalid (no <search>")
    assert SearchR1Format(explain_errors=False).render_correction(bad.text, bad).startswith(
        "\nMy previous action is invalid. If I want to search"
    )
    assert f.parse("<search>  </search>").error == "empty <search></search> query"
    obs = f.render_observation("", [ToolResult(ToolCall("search", {}), "Doc 1(Title: X) x\n")])
    assert obs == "\n\n<information>Doc 1(Title: X) x</information>\n\n"
    prompt = f.render_prompt(Task("1", "Who?"), [])
    assert prompt.endswith("Question: Who?\n") and "<search> query </search>" in prompt
    wrapped = SearchR1Format(chat_wrap=True).render_prompt(Task("1", "Who?"), [])
    assert wrapped.startswith("<|im_start|>user\n") and wrapped.endswith("<|im_start|>assistant\n")
    assert SearchR1Format.stop_strings == ("</search>", "</answer>")


def test_get_format() -> None:
    assert isinstance(get_format("hermes"), Qwen3Format)
    assert get_format("qwen3", answer_mode="no_call").answer_mode == "no_call"
    with pytest.raises(ValueError, match="unknown format 'xml'"):
        get_format("xml")


def test_qwen3_prompt_has_tools_block() -> None:
    spec = ToolSpec("search", "Search the web", {"type": "object", "properties": {"q": {"type": "string"}}})
    p = Q.render_prompt(Task("1", "Capital of Zorbania?"), [spec], system_prompt="Be brief.")
    assert p.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '\n{"type": "function", "function": {"name": "search", "description": "Search the web"' in p
    assert p.endswith("<|im_start|>user\nCapital of Zorbania?\nGive your final answer inside <answer></answer>."
                      "<|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_renders_each_tool_list_as_if_fresh() -> None:
    """The tool list is rendered once per list of specs and reused: a format used with several tool lists (and
    more than it keeps) still renders each exactly as a fresh format does."""
    fmt = Qwen3Format()
    task = Task(id="t", question="q")
    lists = [[ToolSpec(name=f"tool{i}_{j}", description=f"d{i}") for j in range(i % 3 + 1)] for i in range(12)]
    for _ in range(2):
        for specs in lists:
            got = fmt.render_prompt(task, specs)
            assert got == Qwen3Format().render_prompt(task, specs)
            assert all(f'"name": "{s.name}"' in got for s in specs)
    assert fmt.render_prompt(task, []) == Qwen3Format().render_prompt(task, [])
