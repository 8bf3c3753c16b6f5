"""Typed data that crosses module boundaries: tool calls and results, parsed actions, tasks,
turns, trajectories and scores.

Everything here is a plain dataclass with no heavy dependencies, so any RL code can consume it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

JSONValue = Any  # a JSON-serialisable value (dict / list / str / int / float / bool / None)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the policy asked for: a tool name and its JSON arguments. `context`: what the env binds to the call
    for its tool (the episode's database, work dir or workspace: `ToolEnv.bind_calls`); never set from the policy's
    text, never recorded, and passed only to tools that take it (`Tool.takes_context`)."""

    name: str
    arguments: dict[str, JSONValue] = field(default_factory=dict)
    id: str = ""
    context: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """The schema the policy sees (OpenAI / Qwen3 function-calling shape)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    #: schema of the result (transformers' `return` key, from a Python tool's return annotation); optional
    returns: dict[str, Any] | None = None

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "description": self.description, "parameters": self.parameters}
        if self.returns is not None:
            function["return"] = self.returns
        return {"type": "function", "function": function}


class ToolStatus(enum.StrEnum):
    """How a tool call ended. Everything but OK is an error observation the policy sees."""

    OK = "ok"
    ERROR = "error"  # the tool raised / returned an error
    TIMEOUT = "timeout"  # our deadline fired
    INVALID_ARGS = "invalid_args"  # arguments failed schema validation
    UNKNOWN_TOOL = "unknown_tool"  # no tool of that name in the env's toolbox
    CRASHED = "crashed"  # the server behind the tool died / the connection broke


@dataclass(slots=True)
class ToolResult:
    """What a call produced, as the text the policy will see, plus bookkeeping for metrics."""

    call: ToolCall
    content: str
    status: ToolStatus = ToolStatus.OK
    latency_s: float = 0.0
    truncated: bool = False
    attempts: int = 1

    @property
    def ok(self) -> bool:
        return self.status is ToolStatus.OK


class ActionKind(enum.StrEnum):
    TOOL_CALLS = "tool_calls"  # one or more well-formed tool calls
    ANSWER = "answer"  # a final answer, episode ends
    INVALID = "invalid"  # malformed call / no recognisable action: corrective observation


@dataclass(frozen=True, slots=True)
class Action:
    """A policy turn parsed by a Format."""

    kind: ActionKind
    text: str
    calls: tuple[ToolCall, ...] = ()
    answer: str | None = None
    error: str | None = None  # for INVALID: what was wrong and how to fix it


@dataclass(frozen=True, slots=True)
class Message:
    """A chat message (OpenAI / HF chat-template shape)."""

    role: str
    content: str

    def to_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True, slots=True)
class Task:
    """One problem: what the policy is asked, and what the verifier checks against.

    `question` is the user's text; `messages`, when given, is a full chat prefix (system/user
    turns, e.g. from Search-R1's parquet `prompt` column) and takes precedence over `question`.
    `ground_truth` is whatever the verifier needs: a string, a list of acceptable answers, a SQL
    query, test code...
    """

    id: str
    question: str
    ground_truth: JSONValue = None
    messages: tuple[Message, ...] = ()
    meta: dict[str, JSONValue] = field(default_factory=dict)

    @property
    def gold_answers(self) -> list[str]:
        """Ground truth as a list of acceptable answer strings (for answer-matching verifiers)."""
        gt = self.ground_truth
        if gt is None:
            return []
        if isinstance(gt, dict) and "target" in gt:
            gt = gt["target"]
        if isinstance(gt, str | int | float):
            return [str(gt)]
        return [str(g) for g in gt]


@dataclass(slots=True)
class TurnStats:
    """Per-turn tool statistics, reported in `info["turn_stats"]` after every step."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    truncated: int = 0
    invalid: bool = False  # the turn could not be parsed into an action (a malformed call): a correction was shown
    unknown_tools: int = 0  # calls naming a tool the env does not declare
    invalid_args: int = 0  # calls whose arguments failed the tool's schema
    tool_seconds: float = 0.0  # wall time of this turn's tool batch

    @property
    def unusable(self) -> bool:
        """Nothing of the turn could run: unparsed, or every call named an undeclared tool or had bad arguments."""
        return self.invalid or (self.calls > 0 and self.unknown_tools + self.invalid_args >= self.calls)


@dataclass(slots=True)
class Turn:
    """One policy turn and the env's answer to it."""

    action: Action
    results: list[ToolResult] = field(default_factory=list)
    observation: str = ""  # rendered observation text ('' for the final turn)
    reward: float = 0.0  # per-turn (process) reward
    stats: TurnStats = field(default_factory=TurnStats)
    # token mode: [start, end) spans into Trajectory.token_ids
    action_span: tuple[int, int] | None = None
    observation_span: tuple[int, int] | None = None
    # asynchronous RL: the policy version that sampled this action and its tokens' behaviour log-probs
    # (under the sampling distribution); None when the trainer did not record them
    policy_version: int | None = None
    behaviour_logprobs: list[float] | None = None


class EndReason(enum.StrEnum):
    RUNNING = "running"
    ANSWER = "answer"  # terminated: final answer given
    SUBMIT = "submit"  # terminated: a submit() tool call (envs whose answer is their state, e.g. rlf/SWE-v0)
    MAX_TURNS = "max_turns"  # truncated
    INVALID_CALLS = "invalid_calls"  # truncated: `max_invalid_streak` unusable turns in a row
    TOKEN_BUDGET = "token_budget"  # truncated


@dataclass(slots=True)
class Trajectory:
    """A whole episode. In token mode `token_ids`/`loss_mask` hold the exact ids the policy saw and
    produced (1 = policy token, 0 = prompt / observation token); they are never re-tokenised."""

    task: Task
    prompt: str
    turns: list[Turn] = field(default_factory=list)
    answer: str | None = None
    end: EndReason = EndReason.RUNNING
    token_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    reward: float = 0.0  # final (outcome) score value
    score_info: dict[str, float] = field(default_factory=dict)
    #: why the episode failed by infrastructure (a sandbox session that could not start, died from the host's
    #: side, lost its engine: `SessionInfraError`), else None. Such an episode's reward means nothing: the trainer
    #: drops it (and its GRPO group) from the loss and counts it (`infra_failed` in the step's metrics).
    infra_error: str | None = None

    @property
    def infra_failed(self) -> bool:
        return self.infra_error is not None

    @property
    def text(self) -> str:
        """Full text: prompt, then each action and observation in order."""
        parts = [self.prompt]
        for t in self.turns:
            parts.append(t.action.text)
            parts.append(t.observation)
        return "".join(parts)

    @property
    def completion(self) -> str:
        """Everything after the prompt (actions and observations)."""
        return self.text[len(self.prompt) :]

    @property
    def num_tool_calls(self) -> int:
        return sum(t.stats.calls for t in self.turns)

    @property
    def num_tool_errors(self) -> int:
        return sum(t.stats.errors for t in self.turns)

    @property
    def num_invalid_turns(self) -> int:
        """Turns that could not be parsed (malformed calls)."""
        return sum(t.stats.invalid for t in self.turns)

    @property
    def num_unknown_tool_calls(self) -> int:
        """Calls naming a tool the env does not declare."""
        return sum(t.stats.unknown_tools for t in self.turns)

    @property
    def per_turn_rewards(self) -> list[float]:
        return [t.reward for t in self.turns]


@dataclass(frozen=True, slots=True)
class Score:
    """A verifier's verdict: the final value, optional per-turn (process) values, named components."""

    value: float
    per_turn: tuple[float, ...] = ()
    info: dict[str, float] = field(default_factory=dict)
