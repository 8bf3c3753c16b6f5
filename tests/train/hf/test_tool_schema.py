"""`@tool` schemas equal `transformers.utils.get_json_schema` of the same function (rlf_envs builds them
without transformers), so a prompt rendered by the env equals `apply_chat_template(tools=[fn])`."""

from __future__ import annotations

import enum
from typing import Any, Literal, Optional, Union

import pytest

from rlf_envs import ToolEnv, tool
from rlf_envs.types import Task

transformers = pytest.importorskip("transformers")
from transformers.utils import get_json_schema  # noqa: E402


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


def lookup(city: str, year: int = 2024) -> str:
    """Population of a city.

    Args:
        city: the city name
        year: census year
    """
    return city


async def search(query: str, topk: int = 3, filters: Optional[dict[str, str]] = None) -> list[str]:  # noqa: UP045
    """Search the corpus.

    Returns the best documents first. Ünïcødé ✓ kept.

    Args:
        query: what to look for; may span
            several lines of description
        topk: how many documents
        filters: field -> value constraints

    Returns:
        the documents, best first
    """
    return []


def many(xs: list[int], mode: Literal["a", "b"] = "a", flag: bool = False, u: Union[int, float] = 1,  # noqa: UP007
         pair: tuple[int, str] = (1, "x"), color: Color = Color.RED, maybe: str | None = None,
         drink: str = "tea", anything: Any = None) -> None:
    """Do many things.

    Args:
        xs: numbers
        mode: the mode
        flag: a flag
        u: a number
        pair: a pair
        color: a colour
        maybe: optional text
        drink: the beverage (choices: ["tea", "coffee"])
        anything: whatever
    """


def no_args() -> int:
    """Roll a die."""
    return 4


def no_return_annotation(a: float, b: float):  # type: ignore[no-untyped-def]
    """Multiply two numbers.

    Args:
        a: first
        b: second
    Raises:
        ValueError: never
    """
    return a * b


FUNCTIONS = [lookup, search, many, no_args, no_return_annotation]


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_schema_equals_get_json_schema(fn: Any) -> None:
    ours = tool(fn).spec.to_openai()
    theirs = get_json_schema(fn)
    assert ours == theirs
    assert list(ours["function"]) == list(theirs["function"])  # key order too: templates dump JSON in order
    assert list(ours["function"]["parameters"]["properties"]) == list(theirs["function"]["parameters"]["properties"])


def test_env_prompt_equals_apply_chat_template_with_the_functions(qwen3_template_tokenizer: Any) -> None:
    env = ToolEnv(tools=[tool(lookup), tool(search)], tasks=[Task("1", "Population of Oslo?")])
    prompt, _ = env.reset(seed=0)
    ref = qwen3_template_tokenizer.apply_chat_template(
        env.format.messages(env.trajectory.task), tools=[lookup, search], tokenize=False, add_generation_prompt=True
    )
    assert prompt == ref
