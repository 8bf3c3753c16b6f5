"""Tool-call formats (protocols) with observation markers."""

from __future__ import annotations

from typing import Any

from rlf_envs.formats.base import Format
from rlf_envs.formats.qwen3 import Qwen3Format
from rlf_envs.formats.search_r1 import SearchR1Format

FORMATS: dict[str, type[Format]] = {"qwen3": Qwen3Format, "hermes": Qwen3Format, "search_r1": SearchR1Format}


def get_format(spec: str | Format, **kwargs: Any) -> Format:
    """A Format instance from a name (`qwen3`, `hermes`, `search_r1`) or an instance."""
    if isinstance(spec, Format):
        if kwargs:
            raise ValueError("format options can only be given with a format name, not an instance")
        return spec
    try:
        cls = FORMATS[spec]
    except KeyError:
        raise ValueError(
            f"unknown format {spec!r}; choose one of {sorted(FORMATS)} or pass a Format instance"
        ) from None
    return cls(**kwargs)


__all__ = ["FORMATS", "Format", "Qwen3Format", "SearchR1Format", "get_format"]
