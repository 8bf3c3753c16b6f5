"""`rlf_ui/Pool-v0`: `rlf/Tools-v0` plus Python tools named by import path (`python_tools: ["pkg.mod:fn"]`).

A config can only name things, and `rlf/Tools-v0` takes Python tools as objects, so a run whose tool pool holds
Python tools uses this id (registered when `env.imports` lists `rlf_train.ui.pool_env`): the same YAML then runs
from the command line. Each name is resolved here and nowhere else (the web UI's pool uses the same function):

- `pkg.mod:name`: that attribute: an rlf `Tool`, a typed Python function (made a `FunctionTool`, its schema from
  the type hints and docstring, as everywhere in rlf), or a list/tuple of them;
- `pkg.mod`: every rlf `Tool` object at the module's top level.

Every tool's parameter schema is checked to be a valid JSON Schema for an object (`ToolSchemaError` otherwise).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import jsonschema

from rlf_envs.envs.demo import ToolsEnv
from rlf_envs.errors import RlfError
from rlf_envs.registration import register_env
from rlf_envs.tools.base import Tool
from rlf_envs.tools.python import FunctionTool

ENV_ID = "rlf_ui/Pool-v0"
MODULE = "rlf_train.ui.pool_env"


class ToolSourceError(RlfError, ValueError):
    """A Python tool source that cannot be loaded (no such module or attribute, not a tool)."""


class ToolSchemaError(ToolSourceError):
    """A tool whose parameters are not a valid JSON Schema for an object."""


def schema_problem(parameters: Any) -> str | None:
    """Why `parameters` is not a usable tool schema (None: it is): the policy's arguments are a JSON object, so
    the root must be an object schema, and the whole must be valid JSON Schema (the caller validates with it)."""
    if not isinstance(parameters, dict):
        return f"the parameters schema must be a JSON object, got {type(parameters).__name__}"
    kind = parameters.get("type", "object")
    if kind != "object":
        return (f"the parameters schema must have type 'object' at its root (the arguments are a JSON object), "
                f"got {kind!r}")
    cls = jsonschema.validators.validator_for(parameters, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(parameters)
    except jsonschema.exceptions.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        return f"not a valid JSON Schema at {where}: {e.message}"
    return None


def _as_tools(obj: Any, spec: str) -> list[Tool]:
    if isinstance(obj, Tool):
        return [obj]
    if isinstance(obj, list | tuple):
        return [t for item in obj for t in _as_tools(item, spec)]
    if callable(obj) and not isinstance(obj, type):
        try:
            return [FunctionTool(obj)]
        except TypeError as e:  # no type hints, *args, unresolvable hints: rlf's own message
            raise ToolSchemaError(f"{spec}: bad tool schema: {e}") from None
    raise ToolSourceError(f"{spec}: {type(obj).__name__} is not a tool (give an rlf Tool, a typed function, or a "
                          "list of them)")


_cache: dict[str, list[Tool]] = {}


def load_python_tools(spec: str) -> list[Tool]:
    """The tools `spec` names (`pkg.mod` or `pkg.mod:attr`), each with a checked schema. The same spec gives the
    same Tool objects in one process (so the envs of a vector env share one toolbox)."""
    spec = spec.strip()
    if spec in _cache:
        return _cache[spec]
    mod_name, sep, attr = spec.partition(":")
    if not mod_name or (sep and not attr) or not all(p.isidentifier() for p in mod_name.split(".")):
        raise ToolSourceError(f"{spec!r}: give a module ('pkg.module') or one of its attributes ('pkg.module:name')")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (mod_name == e.name or mod_name.startswith(e.name + ".")):
            raise ToolSourceError(f"{spec}: no module named {mod_name!r} (install it in this Python, or run from "
                                  "the directory that holds it)") from None
        raise ToolSourceError(f"{spec}: importing {mod_name} failed: {type(e).__name__}: {e}") from None
    except Exception as e:  # the module's own import-time error
        raise ToolSourceError(f"{spec}: importing {mod_name} failed: {type(e).__name__}: {e}") from None
    if attr:
        if not hasattr(mod, attr):
            raise ToolSourceError(f"{spec}: module {mod_name} has no attribute {attr!r}")
        tools = _as_tools(getattr(mod, attr), spec)
    else:
        seen: dict[int, Tool] = {}
        for value in vars(mod).values():
            if isinstance(value, Tool):
                seen.setdefault(id(value), value)
        tools = list(seen.values())
        if not tools:
            raise ToolSourceError(f"{spec}: module {mod_name} has no rlf Tool objects at its top level; name a "
                                  f"function or tool in it: '{mod_name}:function_name'")
    for t in tools:
        problem = schema_problem(t.spec.parameters)
        if problem is not None:
            raise ToolSchemaError(f"{spec}: tool {t.name!r}: bad tool schema: {problem}")
    _cache[spec] = tools
    return tools


class PoolEnv(ToolsEnv):
    """`rlf/Tools-v0` whose `python_tools` are import paths (see the module docstring); every other keyword is
    `ToolEnv`'s (`mcp_servers`, `tasks`, `verifier`, `format`, ...)."""

    def __init__(self, python_tools: Sequence[str] = (), **kwargs: Any) -> None:
        if isinstance(python_tools, str):
            python_tools = [python_tools]
        tools = [t for spec in python_tools for t in load_python_tools(spec)]
        super().__init__(tools=[*kwargs.pop("tools", ()), *tools], **kwargs)


register_env(ENV_ID, f"{MODULE}:PoolEnv")
