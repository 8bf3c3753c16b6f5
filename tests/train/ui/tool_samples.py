"""Python tools for the web UI's tests: one that makes a good tool, one whose schema cannot be made."""

from __future__ import annotations


def shout(text: str) -> str:
    """Say the text louder.

    Args:
        text: what to say
    """
    return text.upper() + "!"


def untyped(x):  # type: ignore[no-untyped-def]  # no type hint: rlf cannot make its schema
    """A tool without type hints."""
    return x
