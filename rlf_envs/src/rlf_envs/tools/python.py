"""Tools from typed Python functions: schema from type hints + docstring (the same as transformers'
`get_json_schema`, see `rlf_envs.tools.schema`), arguments validated by pydantic."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable
from typing import Any, get_type_hints, overload

import pydantic

from rlf_envs.tools.base import InvalidArguments, Tool, ToolSpec
from rlf_envs.tools.schema import function_schema


class FunctionTool(Tool):
    """Wraps a Python function (sync or async) as a Tool.

    Sync functions run in a worker thread so they never block the loop, unless `inline=True` (for
    cheap pure functions: no thread hop, but no deadline can interrupt them either).
    """

    validates_arguments = True  # pydantic, from the type hints

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        idempotent: bool = False,
        timeout_s: float | None = None,
        max_concurrency: int | None = None,
        inline: bool = False,
    ) -> None:
        self.fn = fn
        self.is_async = inspect.iscoroutinefunction(fn)
        self.inline = inline
        self.idempotent = idempotent
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        sig = inspect.signature(fn)
        try:
            hints = get_type_hints(fn)
        except Exception as e:
            raise TypeError(f"tool {fn.__name__!r}: cannot resolve type hints ({e})") from e
        fields: dict[str, Any] = {}
        for pname, p in sig.parameters.items():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"tool {fn.__name__!r}: *args/**kwargs are not supported; list parameters explicitly")
            if pname not in hints:
                raise TypeError(
                    f"tool {fn.__name__!r}: parameter {pname!r} has no type hint; annotate it (e.g. `{pname}: str`)"
                )
            default = ... if p.default is p.empty else p.default
            fields[pname] = (hints[pname], pydantic.Field(default))
        self._model = pydantic.create_model(  # type: ignore[call-overload]
            f"{fn.__name__}_args", __config__=pydantic.ConfigDict(extra="forbid"), **fields
        )
        self._fields = tuple(fields)
        f = function_schema(fn, name=name, description=description)["function"]
        self.spec = ToolSpec(name=f["name"], description=f["description"], parameters=f["parameters"],
                             returns=f.get("return"))

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        try:
            model = self._model.model_validate(arguments)
        except pydantic.ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(x) for x in err['loc']) or '(arguments)'}: {err['msg']}" for err in e.errors()
            )
            raise InvalidArguments(f"invalid arguments for {self.spec.name}: {problems}") from None
        return {k: getattr(model, k) for k in self._fields}

    async def call(self, arguments: dict[str, Any]) -> str:
        kwargs = self.validate(arguments)
        if self.is_async:
            out = await self.fn(**kwargs)
        elif self.inline:
            out = self.fn(**kwargs)
        else:
            out = await asyncio.to_thread(self.fn, **kwargs)
        return out if isinstance(out, str) else json.dumps(out, ensure_ascii=False, default=str)


@overload
def tool(fn: Callable[..., Any], /) -> FunctionTool: ...
@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    idempotent: bool = False,
    timeout_s: float | None = None,
    max_concurrency: int | None = None,
    inline: bool = False,
) -> Callable[[Callable[..., Any]], FunctionTool]: ...


def tool(fn: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """Decorator: turn a typed function into a Tool.

    >>> @tool(idempotent=True)
    ... def add(a: int, b: int) -> int:
    ...     '''Add two integers.
    ...
    ...     Args:
    ...         a: first term
    ...         b: second term
    ...     '''
    ...     return a + b
    """
    if fn is not None:
        return FunctionTool(fn, **options)
    return lambda f: FunctionTool(f, **options)
