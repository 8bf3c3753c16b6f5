"""JSON schemas of Python functions, the same as Hugging Face transformers' `get_json_schema` makes
(without importing transformers): so `apply_chat_template(tools=[fn])` and an rlf env given the same
function show the model the same prompt.

The rules (transformers' documented behaviour): the description is the docstring up to `Args:` /
`Returns:` / `Raises:`; parameter descriptions come from a Google-style `Args:` block, where a trailing
`(choices: [...])` becomes an `enum`; types map as int -> integer, float -> number, str -> string,
bool -> boolean, None -> null, list[T] -> array + items, tuple[A, B] -> array + prefixItems,
dict[str, T] -> object + additionalProperties, Literal / Enum -> enum, Optional[T] -> T + nullable,
unions of plain types -> a list of types, other unions -> anyOf; `required` lists parameters without a
default; a return annotation becomes `return` (with the `Returns:` text as its description). No `title`,
`default` or `additionalProperties: false` keys.

Where transformers would refuse (a parameter without a description, a type it cannot express, such as a
pydantic model), rlf still makes a schema: the description is left out, the type's pydantic schema is used.
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
from collections.abc import Callable
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import pydantic

from rlf_envs.errors import RlfError

_FIRST_SECTION = re.compile(r"Args:|Returns:|Raises:")
_ARGS_BLOCK = re.compile(r"\n\s*Args:\n(.*?)(?=\s*(?:Returns:|Raises:|\Z))", re.DOTALL)
_RETURNS_BLOCK = re.compile(r"\n\s*Returns:\n\s*(.*?)(?=\s*(?:Raises:|\Z))", re.DOTALL)
_ARG = re.compile(r"^([ \t]*)(\w+):\s*(.*)$")
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)
_SCALARS: dict[Any, str] = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BARE: dict[Any, dict[str, Any]] = {
    **{t: {"type": n} for t, n in _SCALARS.items()},
    list: {"type": "array"}, tuple: {"type": "array"}, dict: {"type": "object"}, Any: {},
}


class Unsupported(RlfError, TypeError):
    """A type transformers' schema rules cannot express."""


def _sections(doc: str) -> tuple[str, str | None, str | None]:
    """(description, Args block, Returns text) of a cleaned docstring."""
    head = _FIRST_SECTION.search(doc)
    description = (doc[: head.start()] if head else doc).strip()
    args = _ARGS_BLOCK.search(doc)
    returns = _RETURNS_BLOCK.search(doc)
    return description, args.group(1) if args else None, returns.group(1).strip() if returns else None


def _arg_descriptions(block: str) -> dict[str, str]:
    """name -> description from an `Args:` block; continuation lines are indented deeper than the name."""
    out: dict[str, list[str]] = {}
    current: str | None = None
    indent = ""
    for line in (raw for raw in block.split("\n") if raw.strip()):
        m = _ARG.match(line)
        if m and (current is None or not (m.group(1).startswith(indent) and len(m.group(1)) > len(indent))):
            indent, current = m.group(1), m.group(2)
            out[current] = [m.group(3).strip()]
        elif current is not None:
            out[current].append(line.strip())
    return {k: " ".join(p for p in parts if p) for k, parts in out.items()}


def _enum(values: list[Any]) -> dict[str, Any]:
    if any(type(v) not in _SCALARS for v in values):
        raise Unsupported(f"enum values must be JSON scalars, got {values!r}")
    kinds = list(dict.fromkeys(_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def type_schema(hint: Any) -> dict[str, Any]:
    """The JSON schema transformers gives a type hint (raises Unsupported where it would refuse)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is None:
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return _enum([m.value for m in hint])
        if hint in _BARE:
            return dict(_BARE[hint])
        raise Unsupported(f"no JSON schema rule for {hint!r}")
    if origin is Union or origin is types.UnionType:
        parts = [type_schema(a) for a in args if a is not type(None)]
        if len(parts) == 1:
            out = parts[0]
        elif all(p.keys() == {"type"} and isinstance(p["type"], str) for p in parts):
            names = sorted({p["type"] for p in parts})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": parts}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is Literal and args:
        return _enum(list(args))
    if origin is list:
        return {"type": "array", "items": type_schema(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or ... in args:
            raise Unsupported("tuple[X] and tuple[X, ...] have no JSON schema rule; use list[X]")
        return {"type": "array", "prefixItems": [type_schema(a) for a in args]}
    if origin is dict:
        if len(args) == 2:
            return {"type": "object", "additionalProperties": type_schema(args[1])}
        return {"type": "object"}
    raise Unsupported(f"no JSON schema rule for {hint!r}")


def _fallback_schema(hint: Any) -> dict[str, Any]:
    schema = pydantic.TypeAdapter(hint).json_schema()
    schema.pop("title", None)
    return schema


def function_schema(fn: Callable[..., Any], name: str | None = None, description: str | None = None) -> dict[str, Any]:
    """`{"type": "function", "function": {name, description, parameters[, return]}}` for `fn`, as
    `transformers.utils.get_json_schema(fn)` makes it."""
    doc = (inspect.getdoc(fn) or "").strip()
    summary, args_block, returns_doc = _sections(doc)
    arg_docs = _arg_descriptions(args_block) if args_block else {}
    hints = get_type_hints(fn)
    sig = inspect.signature(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for pname, p in sig.parameters.items():
        if p.default is p.empty:
            required.append(pname)
    for pname, hint in hints.items():
        if pname == "return" or pname not in sig.parameters:
            continue
        try:
            prop = type_schema(hint)
        except Unsupported:
            prop = _fallback_schema(hint)
        desc = arg_docs.get(pname)
        if desc is not None:
            m = _CHOICES.search(desc)
            if m:
                try:
                    prop["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(m.group(1))]
                    desc = desc[: m.start()].strip()
                except json.JSONDecodeError:
                    pass
            prop["description"] = desc
        properties[pname] = prop
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    out: dict[str, Any] = {"name": name or fn.__name__, "description": description or summary, "parameters": parameters}
    if "return" in hints:
        try:
            ret = type_schema(hints["return"])
        except Unsupported:
            ret = None
        if ret is not None:
            if returns_doc is not None:
                ret["description"] = returns_doc
            out["return"] = ret
    return {"type": "function", "function": out}


__all__ = ["Unsupported", "function_schema", "type_schema"]
