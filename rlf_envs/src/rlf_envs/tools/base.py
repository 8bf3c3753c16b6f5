"""The Tool contract: name, description, JSON-Schema parameters, `async call(args) -> str`."""

from __future__ import annotations

import abc
from typing import Any

from rlf_envs.errors import RlfError
from rlf_envs.tools.limits import Limiter
from rlf_envs.types import ToolSpec  # plain data, defined with the other shared types; re-exported here


class ToolError(RlfError):
    """Raise from a tool to return a clean error message to the policy (no traceback)."""


class ToolCrashed(RlfError):
    """The process or connection behind a tool died; the toolset restarts it for the next call."""


class InvalidArguments(ToolError):
    """The arguments did not match the tool's schema."""


class Tool(abc.ABC):
    """Anything the policy can call.

    `idempotent` tools may be retried by the caller after a timeout or crash; `timeout_s` overrides
    the caller's default deadline; `max_concurrency` caps in-flight calls of this tool. A tool with
    `takes_context` is called as `call(arguments, context)`, `context` the per-episode state its env bound to the
    call (`ToolCall.context`, e.g. rlf/SQL-v0's database), which the policy cannot name or forge.
    """

    spec: ToolSpec
    idempotent: bool = False
    #: True when `call` validates its own arguments (the caller then skips JSON-Schema validation)
    validates_arguments: bool = False
    timeout_s: float | None = None
    max_concurrency: int | None = None
    takes_context: bool = False

    _gate: Limiter | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def concurrency_gate(self) -> Limiter | None:
        """The semaphore that caps this tool's in-flight calls process-wide (None: unlimited)."""
        if self.max_concurrency and self._gate is None:
            self._gate = Limiter(self.max_concurrency)
        return self._gate

    @abc.abstractmethod
    async def call(self, arguments: dict[str, Any]) -> str:
        """Run the tool. Return the text the policy sees; raise ToolError for a clean error."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Tool:
        # tools are shared resources (sessions, processes): gymnasium.make deep-copies kwargs, never copy them
        return self

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release resources (sessions, processes). Called once by the Toolbox on close."""
