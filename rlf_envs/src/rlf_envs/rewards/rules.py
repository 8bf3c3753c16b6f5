"""Rule-based verifiers: answer matching (EM, substring EM, token F1, numeric), regex and format checks,
tool-call validity and call-count shaping, and constants."""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlf_envs.rewards.common import ConfiguredVerifier, action_texts
from rlf_envs.rewards.config import BuildContext, VerifierConfig, register_verifier
from rlf_envs.rewards.normalize import (
    exact_match,
    max_token_f1,
    normalize_answer,
    parse_number,
    substring_match,
)
from rlf_envs.types import ActionKind, Score, Task, ToolStatus, Trajectory

_INVALID_CALL = frozenset({ToolStatus.INVALID_ARGS, ToolStatus.UNKNOWN_TOOL})


def _golds(task: Task) -> list[str]:
    golds = task.gold_answers
    if not golds:
        raise ValueError(f"task {task.id!r} has no gold answer (ground_truth is {task.ground_truth!r})")
    return golds


# ---------------------------------------------------------------------------------------------- matching


@register_verifier
class ExactMatchConfig(VerifierConfig):
    """1.0 if the answer equals any gold answer after Search-R1 normalisation (or after strip only)."""

    type: Literal["exact_match"] = "exact_match"
    normalize: bool = True

    def build(self, ctx: BuildContext) -> ExactMatch:
        return ExactMatch(self)


class ExactMatch(ConfiguredVerifier[ExactMatchConfig]):
    config_cls = ExactMatchConfig

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        golds = _golds(task)
        if trajectory.answer is None:
            return self.result(0.0, {"no_answer": 1.0})
        if self.cfg.normalize:
            hit = exact_match(trajectory.answer, golds)
        else:
            hit = any(trajectory.answer.strip() == g.strip() for g in golds)
        return self.result(float(hit))


@register_verifier
class SubstringMatchConfig(VerifierConfig):
    """1.0 if some normalised gold answer occurs in the normalised answer (Search-R1's `subem_check`)."""

    type: Literal["substring_match"] = "substring_match"

    def build(self, ctx: BuildContext) -> SubstringMatch:
        return SubstringMatch(self)


class SubstringMatch(ConfiguredVerifier[SubstringMatchConfig]):
    config_cls = SubstringMatchConfig

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        golds = _golds(task)
        if trajectory.answer is None:
            return self.result(0.0, {"no_answer": 1.0})
        return self.result(float(substring_match(trajectory.answer, golds)))


@register_verifier
class TokenF1Config(VerifierConfig):
    """Best token-level F1 (or precision / recall) of the answer against any gold answer."""

    type: Literal["token_f1"] = "token_f1"
    metric: Literal["f1", "precision", "recall"] = "f1"

    def build(self, ctx: BuildContext) -> TokenF1:
        return TokenF1(self)


class TokenF1(ConfiguredVerifier[TokenF1Config]):
    config_cls = TokenF1Config

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        golds = _golds(task)
        if trajectory.answer is None:
            return self.result(0.0, {"no_answer": 1.0})
        f1, p, r = max_token_f1(trajectory.answer, golds)
        value = {"f1": f1, "precision": p, "recall": r}[self.cfg.metric]
        return self.result(value, {"precision": p, "recall": r} if self.cfg.metric == "f1" else None)


@register_verifier
class NumericMatchConfig(VerifierConfig):
    """1.0 if the answer's number is within `abs_tol` or `rel_tol` of any gold number (math.isclose)."""

    type: Literal["numeric"] = "numeric"
    abs_tol: float = Field(1e-6, ge=0)
    rel_tol: float = Field(1e-6, ge=0)
    extract: Literal["last", "first"] = Field(
        "last", description="which number to take when the answer is not a bare number"
    )

    def build(self, ctx: BuildContext) -> NumericMatch:
        return NumericMatch(self)


class NumericMatch(ConfiguredVerifier[NumericMatchConfig]):
    config_cls = NumericMatchConfig

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        golds = []
        for g in _golds(task):
            v = parse_number(g)
            if v is None:
                raise ValueError(f"task {task.id!r}: gold answer {g!r} is not a number")
            golds.append(v)
        if trajectory.answer is None:
            return self.result(0.0, {"no_answer": 1.0})
        pred = parse_number(trajectory.answer, last=self.cfg.extract == "last")
        if pred is None:
            return self.result(0.0, {"unparsable": 1.0})
        hit = any(math.isclose(pred, g, rel_tol=self.cfg.rel_tol, abs_tol=self.cfg.abs_tol) for g in golds)
        return self.result(float(hit))


# ------------------------------------------------------------------------------------------ regex / format

_FLAGS = {"ignorecase": re.IGNORECASE, "dotall": re.DOTALL, "multiline": re.MULTILINE}


@register_verifier
class RegexConfig(VerifierConfig):
    """`pass_value` if `pattern` matches (or, with `must_match: false`, does not match) the target text."""

    type: Literal["regex"] = "regex"
    pattern: str
    target: Literal["answer", "completion", "actions", "last_action"] = "answer"
    mode: Literal["search", "fullmatch"] = "search"
    flags: list[Literal["ignorecase", "dotall", "multiline"]] = Field(default_factory=list)
    must_match: bool = True
    pass_value: float = 1.0
    fail_value: float = 0.0

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a valid Python regular expression: {e}; escape literal characters with \\") from None
        return v

    def build(self, ctx: BuildContext) -> RegexMatch:
        return RegexMatch(self)


class RegexMatch(ConfiguredVerifier[RegexConfig]):
    config_cls = RegexConfig

    def __init__(self, config: RegexConfig | None = None, **kwargs: object) -> None:
        super().__init__(config, **kwargs)
        flags = 0
        for f in self.cfg.flags:
            flags |= _FLAGS[f]
        self._re = re.compile(self.cfg.pattern, flags)

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        target = self.cfg.target
        if target == "answer":
            text = trajectory.answer
        elif target == "completion":
            text = trajectory.completion
        elif target == "actions":
            text = "\n".join(action_texts(trajectory))
        else:
            text = trajectory.turns[-1].action.text if trajectory.turns else None
        if text is None:
            return self.result(self.cfg.fail_value, {"no_text": 1.0})
        m = self._re.search(text) if self.cfg.mode == "search" else self._re.fullmatch(text)
        ok = (m is not None) == self.cfg.must_match
        return self.result(self.cfg.pass_value if ok else self.cfg.fail_value)


def tags_well_formed(text: str, tag: str) -> bool:
    """True if `<tag ...>` and `</tag>` strictly alternate in `text` (no nesting, none left open)."""
    is_open = False
    for m in re.finditer(rf"<(/?){re.escape(tag)}(?:\s[^<>]*)?>", text):
        closing = bool(m.group(1))
        if closing != is_open:
            return False
        is_open = not closing
    return not is_open


@register_verifier
class FormatConfig(VerifierConfig):
    """`pass_value` if every enabled check holds, else `fail_value` (use it as a gate, bonus or penalty).

    Checks: a final answer was given; each policy turn has well-formed `tags`; no turn was an
    invalid action (malformed call); optionally all tool calls succeeded; call count within limits.
    """

    type: Literal["format"] = "format"
    require_answer: bool = True
    tags: list[str] = Field(default_factory=list, description="tag names that must be balanced, e.g. [think, answer]")
    forbid_invalid_turns: bool = True
    require_tool_success: bool = False
    min_calls: int = Field(0, ge=0)
    max_calls: int | None = Field(None, ge=0)
    pass_value: float = 1.0
    fail_value: float = 0.0

    @field_validator("tags")
    @classmethod
    def _tag_names(cls, v: list[str]) -> list[str]:
        for t in v:
            if not re.fullmatch(r"[A-Za-z_][\w:.-]*", t):
                raise ValueError(f"tag {t!r} is not a tag name; write it without angle brackets, e.g. 'answer'")
        return v

    @model_validator(mode="after")
    def _limits(self) -> FormatConfig:
        if self.max_calls is not None and self.max_calls < self.min_calls:
            raise ValueError(f"max_calls ({self.max_calls}) must be >= min_calls ({self.min_calls})")
        return self

    def build(self, ctx: BuildContext) -> FormatCheck:
        return FormatCheck(self)


class FormatCheck(ConfiguredVerifier[FormatConfig]):
    config_cls = FormatConfig

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        c = self.cfg
        failed: dict[str, float] = {}
        if c.require_answer and trajectory.answer is None:
            failed["no_answer"] = 1.0
        texts = action_texts(trajectory)
        for tag in c.tags:
            if not all(tags_well_formed(t, tag) for t in texts):
                failed[f"bad_tag_{tag}"] = 1.0
        if c.forbid_invalid_turns and any(t.action.kind is ActionKind.INVALID for t in trajectory.turns):
            failed["invalid_turn"] = 1.0
        if c.require_tool_success and any(not r.ok for t in trajectory.turns for r in t.results):
            failed["tool_failure"] = 1.0
        calls = _count_calls(trajectory)
        if calls < c.min_calls:
            failed["too_few_calls"] = 1.0
        if c.max_calls is not None and calls > c.max_calls:
            failed["too_many_calls"] = 1.0
        return self.result(c.fail_value if failed else c.pass_value, failed)


def _count_calls(trajectory: Trajectory) -> int:
    """Tool calls the policy made: parsed calls of TOOL_CALLS turns (falls back to TurnStats)."""
    n = 0
    for t in trajectory.turns:
        if t.action.kind is ActionKind.TOOL_CALLS:
            n += max(len(t.action.calls), t.stats.calls)
    return n


# ------------------------------------------------------------------------------------------ call shaping


@register_verifier
class ToolCallFormatConfig(VerifierConfig):
    """Linear in the fraction of well-formed calls: `low` when none were valid, `high` when all were.

    A call counts as malformed if its turn was an invalid action or its result was INVALID_ARGS /
    UNKNOWN_TOOL. With no call attempts at all the value is `no_calls_value`.
    """

    type: Literal["tool_call_format"] = "tool_call_format"
    low: float = -1.0
    high: float = 1.0
    no_calls_value: float = 0.0

    def build(self, ctx: BuildContext) -> ToolCallFormat:
        return ToolCallFormat(self)


class ToolCallFormat(ConfiguredVerifier[ToolCallFormatConfig]):
    config_cls = ToolCallFormatConfig

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        ok = bad = 0
        for t in trajectory.turns:
            if t.action.kind is ActionKind.INVALID:
                bad += 1
            elif t.action.kind is ActionKind.TOOL_CALLS:
                if t.results:
                    for r in t.results:
                        bad += r.status in _INVALID_CALL
                        ok += r.status not in _INVALID_CALL
                else:
                    ok += len(t.action.calls)
        if ok + bad == 0:
            return self.result(self.cfg.no_calls_value, {"valid": 0.0, "invalid": 0.0})
        frac = ok / (ok + bad)
        value = self.cfg.low + (self.cfg.high - self.cfg.low) * frac
        return self.result(value, {"valid": ok, "invalid": bad})


@register_verifier
class CallCountConfig(VerifierConfig):
    """0 within [min_calls, max_calls]; outside it, minus `penalty` per call too many/few (`per_call`)
    or minus `penalty` once (`flat`). Meant as a shaping term in a weighted sum."""

    type: Literal["call_count"] = "call_count"
    max_calls: int | None = Field(None, ge=0)
    min_calls: int = Field(0, ge=0)
    penalty: float = Field(0.1, ge=0, description="a magnitude; it is subtracted")
    mode: Literal["per_call", "flat"] = "per_call"

    @model_validator(mode="after")
    def _limits(self) -> CallCountConfig:
        if self.max_calls is None and self.min_calls == 0:
            raise ValueError("set max_calls and/or min_calls, otherwise call_count never penalises anything")
        if self.max_calls is not None and self.max_calls < self.min_calls:
            raise ValueError(f"max_calls ({self.max_calls}) must be >= min_calls ({self.min_calls})")
        return self

    def build(self, ctx: BuildContext) -> CallCount:
        return CallCount(self)


class CallCount(ConfiguredVerifier[CallCountConfig]):
    config_cls = CallCountConfig

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        c = self.cfg
        calls = _count_calls(trajectory)
        off = 0
        if c.max_calls is not None and calls > c.max_calls:
            off = calls - c.max_calls
        elif calls < c.min_calls:
            off = c.min_calls - calls
        value = 0.0 if off == 0 else -c.penalty * (off if c.mode == "per_call" else 1)
        return self.result(value, {"calls": calls})


@register_verifier
class ConstantConfig(VerifierConfig):
    """Always `value` (an offset in a weighted sum, or a branch of a gate)."""

    type: Literal["constant"] = "constant"
    value: float

    def build(self, ctx: BuildContext) -> Constant:
        return Constant(self)


class Constant(ConfiguredVerifier[ConstantConfig]):
    config_cls = ConstantConfig

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        return self.result(self.cfg.value)


__all__ = [
    "CallCount",
    "Constant",
    "ExactMatch",
    "FormatCheck",
    "NumericMatch",
    "RegexMatch",
    "SubstringMatch",
    "TokenF1",
    "ToolCallFormat",
    "normalize_answer",
    "tags_well_formed",
]
