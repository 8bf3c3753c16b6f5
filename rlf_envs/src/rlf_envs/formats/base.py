"""The tool-call protocol: how tool schemas appear in the prompt, how a policy turn is parsed into an
Action, and how tool results come back as an observation between markers."""

from __future__ import annotations

import abc
from collections.abc import Sequence

from rlf_envs.types import Action, Task, ToolResult, ToolSpec


class Format(abc.ABC):
    """A tool-call format. Stateless and cheap: one instance may serve many envs."""

    name: str = "format"
    #: strings at which the policy's generation for one turn must stop (kept in the action text)
    stop_strings: tuple[str, ...] = ()

    @abc.abstractmethod
    def render_prompt(self, task: Task, tools: Sequence[ToolSpec], system_prompt: str | None = None) -> str:
        """The full prompt text the policy continues from (ends where the policy starts writing)."""

    @abc.abstractmethod
    def parse(self, text: str) -> Action:
        """Parse one policy turn."""

    @abc.abstractmethod
    def render_observation(self, action_text: str, results: Sequence[ToolResult]) -> str:
        """The text appended after a tool-calling turn: tool results between the observation markers,
        up to where the policy writes its next turn."""

    @abc.abstractmethod
    def render_correction(self, action_text: str, action: Action) -> str:
        """The observation after an invalid turn: what was wrong and how to call tools properly."""
