"""Per-turn (process) rewards attached to turn boundaries.

The env calls `TurnRewarder.turn_reward(turn)` after each step and stores the value in `turn.reward`
(and in `info`); `ProcessReward` is the same rule as a verifier, so the per-turn values also appear
in `Score.per_turn` and can be mixed into a final reward with `weighted`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rlf_envs.rewards.common import ConfiguredVerifier
from rlf_envs.rewards.config import (
    BuildContext,
    VerifierConfig,
    VerifierConfigError,
    _errors_to_problems,
    register_verifier,
)
from rlf_envs.types import ActionKind, Score, Task, ToolStatus, Trajectory, Turn

_MAG = "a magnitude (>= 0) that is subtracted"


class TurnRewardConfig(BaseModel):
    """Per-turn reward rule. Bonuses are added, penalties (magnitudes, >= 0) are subtracted."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    valid_call_bonus: float = Field(0.0, ge=0, description="per tool call that returned OK")
    tool_error_penalty: float = Field(0.0, ge=0, description=f"per call whose tool raised (ERROR); {_MAG}")
    timeout_penalty: float = Field(0.0, ge=0, description=f"per call that hit its deadline; {_MAG}")
    invalid_call_penalty: float = Field(0.0, ge=0, description=f"per call with bad args / unknown tool; {_MAG}")
    invalid_action_penalty: float = Field(0.0, ge=0, description=f"per malformed turn (no parsable action); {_MAG}")
    crash_penalty: float = Field(0.0, ge=0, description=f"per call whose server crashed (infra, not policy); {_MAG}")
    answer_bonus: float = Field(0.0, ge=0, description="for the turn that gives a final answer")
    answer_in_result_bonus: float = Field(0.0, ge=0, description="for a turn whose OK tool results contain one of "
                                          "the task's gold answers (Search-R1 normalisation): a search that "
                                          "retrieved the answer. Once per turn; needs the task (the env passes it)")
    max_rewarded_calls: int | None = Field(None, ge=0, description="cap on bonus-earning calls per turn")
    clip_min: float | None = None
    clip_max: float | None = None

    @model_validator(mode="after")
    def _clip(self) -> TurnRewardConfig:
        if self.clip_min is not None and self.clip_max is not None and self.clip_min > self.clip_max:
            raise ValueError(f"clip_min ({self.clip_min}) must be <= clip_max ({self.clip_max})")
        return self


class TurnRewarder:
    """Computes one turn's process reward from its action kind and tool results."""

    def __init__(self, config: TurnRewardConfig | None = None, **kwargs: float | int | None) -> None:
        if config is not None and kwargs:
            raise TypeError("TurnRewarder: pass either a config or keyword arguments, not both")
        self.config = config if config is not None else TurnRewardConfig.model_validate(kwargs)

    def turn_reward(self, turn: Turn, task: Task | None = None) -> float:
        c = self.config
        r = 0.0
        if c.answer_in_result_bonus and task is not None and _answer_in_results(turn, task):
            r += c.answer_in_result_bonus
        if turn.action.kind is ActionKind.INVALID:
            r -= c.invalid_action_penalty
        elif turn.action.kind is ActionKind.ANSWER:
            r += c.answer_bonus
        ok = 0
        for res in turn.results:
            st = res.status
            if st is ToolStatus.OK:
                ok += 1
            elif st is ToolStatus.ERROR:
                r -= c.tool_error_penalty
            elif st is ToolStatus.TIMEOUT:
                r -= c.timeout_penalty
            elif st in (ToolStatus.INVALID_ARGS, ToolStatus.UNKNOWN_TOOL):
                r -= c.invalid_call_penalty
            elif st is ToolStatus.CRASHED:
                r -= c.crash_penalty
        if c.max_rewarded_calls is not None:
            ok = min(ok, c.max_rewarded_calls)
        r += ok * c.valid_call_bonus
        if c.clip_min is not None:
            r = max(c.clip_min, r)
        if c.clip_max is not None:
            r = min(c.clip_max, r)
        return r

    def trajectory_rewards(self, trajectory: Trajectory) -> list[float]:
        return [self.turn_reward(t, trajectory.task) for t in trajectory.turns]

    def assign(self, trajectory: Trajectory) -> list[float]:
        """Compute and store `turn.reward` for every turn (for trajectories built outside the env)."""
        values = self.trajectory_rewards(trajectory)
        for t, v in zip(trajectory.turns, values, strict=True):
            t.reward = v
        return values


def _answer_in_results(turn: Turn, task: Task) -> bool:
    from rlf_envs.rewards.rules import normalize_answer

    gold = task.ground_truth
    answers = [gold] if isinstance(gold, str) else [g for g in gold if isinstance(g, str)] \
        if isinstance(gold, list) else []
    if isinstance(gold, dict):  # Search-R1 rows: {"target": [...]}
        target = gold.get("target", [])
        answers = [target] if isinstance(target, str) else [g for g in target if isinstance(g, str)]
    wanted = [n for n in (normalize_answer(a) for a in answers) if n]
    if not wanted:
        return False
    for res in turn.results:
        if res.status is ToolStatus.OK:
            text = f" {normalize_answer(res.content)} "
            if any(f" {w} " in text for w in wanted):
                return True
    return False


def build_turn_rewarder(
    config: TurnRewardConfig | dict[str, Any] | None, *, path: str = "turn_reward"
) -> TurnRewarder | None:
    """A TurnRewarder from a config mapping (e.g. the env's `turn_reward:` YAML section); None if not given.
    Bad fields raise `VerifierConfigError` naming `<path>.<field>`."""
    if config is None:
        return None
    if isinstance(config, TurnRewardConfig):
        return TurnRewarder(config)
    try:
        return TurnRewarder(TurnRewardConfig.model_validate(config))
    except ValidationError as e:
        raise VerifierConfigError(_errors_to_problems(e, path)) from None


@register_verifier
class ProcessRewardConfig(VerifierConfig):
    """Per-turn rewards from `turn` as `Score.per_turn`; the value aggregates them (`sum`, `mean`, or
    `none` = 0 so only the per-turn signal is used)."""

    type: Literal["process"] = "process"
    turn: TurnRewardConfig = TurnRewardConfig.model_validate({})
    aggregate: Literal["sum", "mean", "none"] = "sum"

    def build(self, ctx: BuildContext) -> ProcessReward:
        return ProcessReward(self)


class ProcessReward(ConfiguredVerifier[ProcessRewardConfig]):
    config_cls = ProcessRewardConfig

    def __init__(self, config: ProcessRewardConfig | None = None, **kwargs: object) -> None:
        super().__init__(config, **kwargs)
        self.rewarder = TurnRewarder(self.cfg.turn)

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        per_turn = tuple(self.rewarder.trajectory_rewards(trajectory))
        total = sum(per_turn)
        agg = self.cfg.aggregate
        value = total if agg == "sum" else (total / len(per_turn) if per_turn and agg == "mean" else 0.0)
        return self.result(value, {"turn_sum": total}, per_turn=per_turn)
