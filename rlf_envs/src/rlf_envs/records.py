"""Trajectory records: one JSON line per episode, the format every rlf tool writes and reads.

Training (`runs/X/trajectories/step_K.jsonl`), `python -m rlf_train.eval`, `python -m rlf_envs.eval` and the
viewer (`python -m rlf_envs.view`) all use `TrajectoryRecord`. Build one from an env's finished
`Trajectory` with `TrajectoryRecord.from_trajectory`, write with `write_records` / `append_step_records`
(atomic: a reader never sees a half-written file) and read back with `read_records`.

Schema (version 1), one JSON object per line:

- `schema_version`, `source` (who sampled it: "train", "eval_greedy", "eval_sampled", "api_eval", ...),
  `step` (training step; 0 = before RL), `index` (episode number within its source and step)
- `task`: `id`, `question`, `ground_truth`, `meta`
- `prompt`: the rendered prompt text the policy started from
- `turns`: one per policy turn: `action` (the policy's text), `kind` ("tool_calls" | "answer" | "invalid"),
  `error` (why an invalid turn was invalid), `tool_calls` (`name`, `arguments`, `id`), `results` (`name`,
  `content`, `status` ("ok", "error", "timeout", "invalid_args", "unknown_tool", "crashed"), `latency_s`,
  `truncated`, `attempts`), `observation` (the env's answer text, "" after the last turn), `reward`
  (per-turn reward), `tool_seconds`, and in token mode `action_span` / `observation_span` ([start, end)
  into `token_ids`); from an asynchronous RL run, `policy_version` (the weights version that sampled the
  action: staleness = the update's version - 1 - this) and `behaviour_logprobs` (one per action token)
- `answer`, `end_reason` ("answer" | "max_turns" | "token_budget", or "policy_error" when the policy itself
  failed, e.g. an API that kept erroring; "infra_error" when the infrastructure failed the episode, e.g. its
  sandbox session died: no reward signal, dropped from the loss; `error` then says why), `reward` (final score),
  `score_info`
- `success` (reward >= `success_threshold`), `num_tool_calls`, `num_tool_errors`
- token mode: `token_ids` and `loss_mask` (1 = policy token, trained on; 0 = prompt/observation token)
- `usage`: optional counters from the policy (e.g. `prompt_tokens`, `completion_tokens`, `latency_s`)

Everything a policy wrote is stored verbatim: treat it as hostile when displaying it.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rlf_envs.errors import RlfError
from rlf_envs.types import (
    Action,
    ActionKind,
    EndReason,
    Task,
    ToolCall,
    ToolResult,
    ToolStatus,
    Trajectory,
    Turn,
)

SCHEMA_VERSION = 1
SUCCESS_THRESHOLD = 1.0 - 1e-6
TRAJECTORY_DIR = "trajectories"
_STEP_FILE = re.compile(r"^step_(\d+)\.jsonl$")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TaskRecord(_Model):
    id: str
    question: str
    ground_truth: Any = None
    meta: dict[str, Any] = Field(default_factory=dict)


class ToolCallRecord(_Model):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    id: str = ""


class ToolResultRecord(_Model):
    name: str
    content: str
    status: str = "ok"
    latency_s: float = 0.0
    truncated: bool = False
    attempts: int = 1


class TurnRecord(_Model):
    action: str
    kind: str
    error: str | None = None
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    results: list[ToolResultRecord] = Field(default_factory=list)
    observation: str = ""
    reward: float = 0.0
    tool_seconds: float = 0.0
    action_span: tuple[int, int] | None = None
    observation_span: tuple[int, int] | None = None
    policy_version: int | None = None  # async RL: the weights version that sampled this action
    behaviour_logprobs: list[float] | None = None

    @classmethod
    def from_turn(cls, turn: Turn) -> TurnRecord:
        a = turn.action
        return cls(
            action=a.text,
            kind=a.kind.value,
            error=a.error,
            tool_calls=[ToolCallRecord(name=c.name, arguments=dict(c.arguments), id=c.id) for c in a.calls],
            results=[
                ToolResultRecord(name=r.call.name, content=r.content, status=r.status.value, latency_s=r.latency_s,
                                 truncated=r.truncated, attempts=r.attempts)
                for r in turn.results
            ],
            observation=turn.observation,
            reward=turn.reward,
            tool_seconds=turn.stats.tool_seconds,
            action_span=turn.action_span,
            observation_span=turn.observation_span,
            policy_version=turn.policy_version,
            behaviour_logprobs=turn.behaviour_logprobs,
        )


class TrajectoryRecord(_Model):
    """One episode as stored on disk (see the module docstring for every field)."""

    schema_version: int = SCHEMA_VERSION
    source: str = "eval"
    step: int = 0
    index: int = 0
    task: TaskRecord
    prompt: str
    turns: list[TurnRecord] = Field(default_factory=list)
    answer: str | None = None
    end_reason: str = "running"
    error: str | None = None
    reward: float = 0.0
    score_info: dict[str, float] = Field(default_factory=dict)
    success: bool = False
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    token_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    usage: dict[str, float] = Field(default_factory=dict)

    @classmethod
    def from_trajectory(cls, traj: Trajectory, *, source: str = "eval", step: int = 0, index: int = 0,
                        error: str | None = None, usage: dict[str, float] | None = None,
                        success_threshold: float = SUCCESS_THRESHOLD) -> TrajectoryRecord:
        t = traj.task
        return cls(
            source=source,
            step=step,
            index=index,
            task=TaskRecord(id=t.id, question=t.question, ground_truth=t.ground_truth, meta=dict(t.meta)),
            prompt=traj.prompt,
            turns=[TurnRecord.from_turn(turn) for turn in traj.turns],
            answer=traj.answer,
            end_reason="policy_error" if error is not None else "infra_error" if traj.infra_error is not None
            else traj.end.value,
            error=error if error is not None else traj.infra_error,
            reward=traj.reward,
            score_info={k: float(v) for k, v in traj.score_info.items()},
            success=traj.reward >= success_threshold,
            num_tool_calls=sum(len(turn.results) for turn in traj.turns),
            num_tool_errors=sum(not r.ok for turn in traj.turns for r in turn.results),
            token_ids=list(traj.token_ids) if traj.token_ids is not None else None,
            loss_mask=list(traj.loss_mask) if traj.loss_mask is not None else None,
            usage=dict(usage or {}),
        )

    def to_trajectory(self) -> Trajectory:
        """The episode back as a `Trajectory` (what the trainer's loss reads: tokens, mask, spans, rewards,
        policy versions, behaviour log-probs; tool calls and results as recorded). Turn statistics other than
        `tool_seconds` are not recorded and come back zero."""
        turns = []
        for tr in self.turns:
            calls = tuple(ToolCall(name=c.name, arguments=dict(c.arguments), id=c.id) for c in tr.tool_calls)
            by_name = {c.name: c for c in calls}
            kind = ActionKind(tr.kind)
            turn = Turn(action=Action(kind=kind, text=tr.action, calls=calls, error=tr.error,
                                      answer=self.answer if kind is ActionKind.ANSWER else None),
                        results=[ToolResult(call=by_name.get(r.name, ToolCall(r.name)), content=r.content,
                                            status=ToolStatus(r.status), latency_s=r.latency_s, truncated=r.truncated,
                                            attempts=r.attempts) for r in tr.results],
                        observation=tr.observation, reward=tr.reward, action_span=tr.action_span,
                        observation_span=tr.observation_span, policy_version=tr.policy_version,
                        behaviour_logprobs=tr.behaviour_logprobs)
            turn.stats.tool_seconds = tr.tool_seconds
            turns.append(turn)
        end = EndReason(self.end_reason) if self.end_reason in EndReason.__members__.values() else EndReason.RUNNING
        return Trajectory(task=Task(id=self.task.id, question=self.task.question, ground_truth=self.task.ground_truth,
                                    meta=dict(self.task.meta)),
                          prompt=self.prompt, turns=turns, answer=self.answer, end=end,
                          token_ids=list(self.token_ids) if self.token_ids is not None else None,
                          loss_mask=list(self.loss_mask) if self.loss_mask is not None else None,
                          reward=self.reward, score_info=dict(self.score_info),
                          infra_error=self.error if self.end_reason == "infra_error" else None)

    def to_json(self) -> str:
        """One JSON line (no newline inside: JSON escapes newlines in strings)."""
        return self.model_dump_json()

    @classmethod
    def from_json(cls, line: str) -> TrajectoryRecord:
        return cls.model_validate_json(line)


class RecordError(RlfError, ValueError):
    """A trajectory file that cannot be read as records."""


def _umask() -> int:
    """The process's umask, read without changing it (Linux: /proc; elsewhere the common 022)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` atomically (a temp file in the same folder, then a rename), with the mode a plain
    `open(path, "w")` gives (0644 under the usual umask; mkstemp's temp files are 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_records(path: str | Path, records: Iterable[TrajectoryRecord]) -> Path:
    """Write records as JSON lines to `path`, atomically (a temp file in the same folder, then a rename)."""
    path = Path(path)
    atomic_write_text(path, "".join(r.to_json() + "\n" for r in records))
    return path


def read_records(path: str | Path) -> list[TrajectoryRecord]:
    """Read a JSONL file of records; a bad line raises RecordError naming the file and line."""
    path = Path(path)
    out = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(TrajectoryRecord.from_json(line))
            except ValueError as e:
                raise RecordError(f"{path}:{n}: not a trajectory record ({str(e).splitlines()[0]})") from None
    return out


def step_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / TRAJECTORY_DIR / f"step_{step}.jsonl"


def append_step_records(run_dir: str | Path, step: int, records: Sequence[TrajectoryRecord]) -> Path:
    """Add `records` to `run_dir/trajectories/step_K.jsonl`, replacing records of the same source(s) already
    there (a resumed run re-writes a step instead of duplicating it). Atomic."""
    path = step_path(run_dir, step)
    sources = {r.source for r in records}
    kept = [r for r in read_records(path) if r.source not in sources] if path.is_file() else []
    return write_records(path, [*kept, *records])


def sample_records(trajs: Sequence[Trajectory], k: int, *, source: str, step: int) -> list[TrajectoryRecord]:
    """Records of the first `k` trajectories (all when k < 0). Evals keep the same task order at every
    step, so the first k are the same tasks each time and can be compared across steps."""
    chosen = trajs if k < 0 else trajs[:k]
    return [TrajectoryRecord.from_trajectory(t, source=source, step=step, index=i) for i, t in enumerate(chosen)]


def write_trajectories(run_dir: str | Path, step: int, trajs: Sequence[Trajectory], k: int, source: str) -> Path | None:
    """The training/eval hook: store up to `k` of `trajs` as `run_dir/trajectories/step_{step}.jsonl`."""
    if k == 0 or not trajs:
        return None
    return append_step_records(run_dir, step, sample_records(trajs, k, source=source, step=step))


def list_steps(run_dir: str | Path) -> list[tuple[int, Path]]:
    """The (step, path) of every `trajectories/step_K.jsonl` of a run, by step."""
    d = Path(run_dir) / TRAJECTORY_DIR
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _STEP_FILE.match(p.name))]
    return sorted(found)


def record_text_sample(rec: TrajectoryRecord, max_chars: int = 4000) -> str:
    """A short markdown rendering of one record (TensorBoard text summaries, console)."""
    lines = [f"**task** `{rec.task.id}`: {rec.task.question}", "",
             f"**reward** {rec.reward:.3f}  **end** {rec.end_reason}  **answer** {rec.answer!r}  "
             f"**gold** {rec.task.ground_truth!r}", ""]
    for i, t in enumerate(rec.turns, 1):
        lines.append(f"turn {i} ({t.kind}, reward {t.reward:.3f}):")
        lines.append("    " + t.action.replace("\n", "\n    "))
        if t.observation:
            lines.append("    -> " + t.observation.strip().replace("\n", "\n    "))
    text = "\n".join(lines)
    return text if len(text) <= max_chars else text[:max_chars] + "\n...[cut]"
