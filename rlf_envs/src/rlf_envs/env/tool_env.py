"""ToolEnv: a multi-turn tool-use episode as a `gymnasium.Env`.

Text mode (default): observations and actions are strings. Token mode (given a tokenizer): actions are
the policy's token ids, observations are the ids of the new context tokens (the prompt after reset, the
rendered tool results after a tool turn), and `trajectory.token_ids` / `trajectory.loss_mask` hold the
whole episode exactly as the policy saw and produced it, never re-tokenised.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from rlf_envs import runtime
from rlf_envs.env.spaces import AnyText, as_token_array, token_space
from rlf_envs.env.tokens import TokenizerAdapter
from rlf_envs.formats import Format, get_format
from rlf_envs.rewards.base import Verifier
from rlf_envs.tasks import TaskSource, load_tasks
from rlf_envs.tools.caller import CallerConfig, truncate
from rlf_envs.tools.toolbox import MCPSource, Toolbox, ToolLike, shared_toolbox
from rlf_envs.types import (
    Action,
    ActionKind,
    EndReason,
    Score,
    Task,
    ToolCall,
    ToolResult,
    ToolStatus,
    Trajectory,
    Turn,
    TurnStats,
)

CHARS_PER_TOKEN = 4  # text mode measures budgets in characters / 4
log = logging.getLogger(__name__)
_warned: set[tuple[str, str]] = set()


def _takes_task(fn: Any) -> bool:
    try:
        return "task" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _warn_once(where: str, exc: BaseException) -> None:
    """Log a contained failure once per (place, exception type): a hostile policy must not flood the log."""
    key = (where, type(exc).__name__)
    if key not in _warned:
        _warned.add(key)
        log.warning("%s failed with %s: %s (contained: the env answers with an error observation; "
                    "logged once per exception type)", where, type(exc).__name__, str(exc)[:300])


def _default_verifier() -> Verifier:
    from rlf_envs.rewards import ExactMatch

    return ExactMatch()


@dataclass(slots=True)
class PendingStep:
    """A step between its phases: the recorded turn and the policy's text for it."""

    turn: Turn
    action_text: str


StepReturn = tuple[Any, float, bool, bool, dict[str, Any]]
#: where an env's episode stood before a step: turns, token ids, token count, done, answer, end reason
Mark = tuple[int, int, int, bool, str | None, EndReason]


def encode_texts(envs: Sequence[ToolEnv], texts: Sequence[str]) -> list[list[int] | None]:
    """Token ids of each env's text (None for text mode or an empty text), one batched tokenizer call per
    tokenizer instead of one call per env."""
    out: list[list[int] | None] = [None] * len(envs)
    groups: dict[int, list[int]] = {}
    for k, (e, t) in enumerate(zip(envs, texts, strict=True)):
        if e.tok is not None and t:
            groups.setdefault(id(e.tok), []).append(k)
    for ks in groups.values():
        tok = envs[ks[0]].tok
        assert tok is not None
        try:
            batch = tok.encode_batch([texts[k] for k in ks])
        except Exception as e:  # one text the tokenizer refuses (e.g. a lone surrogate from a tool): one by one
            _warn_once("encoding observations", e)
            batch = [_encode_one(tok, texts[k]) for k in ks]
        for k, ids in zip(ks, batch, strict=True):
            out[k] = ids
    return out


def _encode_one(tok: TokenizerAdapter, text: str) -> list[int]:
    try:
        return tok.encode(text)
    except Exception:
        return tok.encode(text.encode("utf-8", "replace").decode("utf-8"))


def start_episodes(
    envs: Sequence[ToolEnv], seeds: Sequence[int | None], options: Sequence[dict[str, Any] | None]
) -> list[tuple[Any, dict[str, Any]]]:
    """Reset each env: seed, pick the task and render the prompt, then encode every prompt in one call."""
    prepared = [e._prepare_episode(s, o) for e, s, o in zip(envs, seeds, options, strict=True)]
    ids = encode_texts(envs, [prompt for _, prompt in prepared])
    return [
        e._start_episode(task, prompt, (p_ids or []) if e.tok is not None else None)
        for e, (task, prompt), p_ids in zip(envs, prepared, ids, strict=True)
    ]


async def step_envs(envs: Sequence[ToolEnv], actions: Sequence[Any]) -> list[StepReturn]:
    """Step each env with its action, phase by phase for the whole batch: _record (sync; every action is
    checked before any is recorded) -> _call_tools (one gather, tool turns only) -> _observation_text
    (sync) -> one tokenizer call -> _finish (sync) -> _score_end (one gather, finished episodes only).

    No phase raises for one env's action or tools: a parse failure (nesting, huge literals, a buggy
    Format), a failing tool batch or a failing render becomes that env's error observation. Whatever
    still escapes (a bug, a cancellation) rewinds every env of the batch to where it was before the step,
    so no env is left with a half-recorded turn."""
    decoded = [e._decode_action(a) for e, a in zip(envs, actions, strict=True)]
    marks = [e._mark() for e in envs]
    try:
        steps = [e._record(*d) for e, d in zip(envs, decoded, strict=True)]
        calling = [k for k, st in enumerate(steps) if st.turn.action.kind is ActionKind.TOOL_CALLS]
        if calling:
            await asyncio.gather(*(envs[k]._call_tools(steps[k]) for k in calling))
        texts = [e._observation_text(st) for e, st in zip(envs, steps, strict=True)]
        ids = encode_texts(envs, texts)
        results = [e._finish(st, t, i) for e, st, t, i in zip(envs, steps, texts, ids, strict=True)]
        ending = [k for k, e in enumerate(envs) if e.done]
        if ending:
            scored = await asyncio.gather(*(envs[k]._score_end(results[k]) for k in ending))
            for k, r in zip(ending, scored, strict=True):
                results[k] = r
    except BaseException:
        for e, m in zip(envs, marks, strict=True):
            e._rewind(m)
        raise
    return results


class ToolEnv(gym.Env[Any, Any]):
    """A multi-turn tool environment.

    Args:
        tools: rlf Tools or typed Python functions the policy may call.
        tasks: Tasks, dicts, or a path to a JSONL file (see `rlf_envs.tasks.load_tasks`).
        format: "qwen3" | "hermes" | "search_r1" or a Format instance; `format_kwargs` configure a named one.
        verifier: scores the finished episode (a Verifier, a reward config dict, or the path of a reward YAML
            file); default exact match.
        turn_rewarder: optional per-turn (process) reward: a TurnRewarder, its config dict, or anything with
            `turn_reward(turn) -> float`.
        max_turns: policy turns per episode (truncation after that).
        max_total_tokens: budget for the whole trajectory (prompt + actions + observations).
        max_obs_tokens: cap for one observation (tool outputs are shortened with a visible marker).
        max_invalid_streak: end the episode (truncated, `end_reason` "invalid_calls") after this many turns in a row
            of which nothing could run (unparsed, or only undeclared tools / bad arguments); None: never.
        tokenizer: enables token mode (transformers tokenizer or tokenizers.Tokenizer).
        mcp_servers: an `mcpServers` config (dict or YAML/JSON path) whose tools are added.
        caller: tool-caller limits (CallerConfig or dict: timeout_s, max_retries, max_concurrency, ...).
        toolbox: a ready Toolbox (instead of tools/mcp_servers/caller).

    Hooks a subclass overrides (rlf/SQL-v0, Code-v0 and SWE-v0 are examples):
        parse_action(text): the policy's text as an Action (default: the format's parser; an exception is an
            invalid turn).
        bind_calls(step): the calls to run for this turn: the policy's, with per-episode state the env owns bound
            as each call's `context` (`ToolCall.context`; a tool with `takes_context` receives it), where the
            policy's text cannot reach it.
        end_episode(): release the episode's own resources; called once the episode is scored, at the next reset
            and on close; idempotent.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}
    #: the hooks' names before they were public: a subclass that still overrides one gets it called, with a warning
    _OLD_HOOKS = {"_parse": "parse_action", "_tool_calls": "bind_calls", "_end_episode": "end_episode"}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for old, new in ToolEnv._OLD_HOOKS.items():
            if old in cls.__dict__ and new not in cls.__dict__:
                import warnings

                warnings.warn(f"{cls.__name__}.{old} overrides a ToolEnv hook that is now public: rename it "
                              f"{new} (the old name works for one release)", DeprecationWarning, stacklevel=2)
                setattr(cls, new, cls.__dict__[old])

    def __init__(
        self,
        tools: Sequence[ToolLike] = (),
        tasks: TaskSource = (),
        format: str | Format = "qwen3",
        verifier: Verifier | dict[str, Any] | str | os.PathLike[str] | None = None,
        turn_rewarder: Any = None,
        max_turns: int = 4,
        max_total_tokens: int = 4096,
        max_obs_tokens: int = 512,
        tokenizer: Any = None,
        system_prompt: str | None = None,
        mcp_servers: MCPSource | None = None,
        caller: CallerConfig | dict[str, Any] | None = None,
        toolbox: Toolbox | None = None,
        format_kwargs: dict[str, Any] | None = None,
        render_mode: str | None = None,
        max_invalid_streak: int | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_obs_tokens < 16 or max_total_tokens < 16:
            raise ValueError("max_obs_tokens and max_total_tokens must be >= 16")
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.render_mode = render_mode
        self.tasks: list[Task] = load_tasks(tasks)
        if not self.tasks:
            raise ValueError("ToolEnv needs at least one task (tasks=[...] or a JSONL path)")
        self.format = get_format(format, **(format_kwargs or {}))
        self.toolbox = toolbox or shared_toolbox(tools, mcp_servers, caller)
        if isinstance(verifier, dict):
            from rlf_envs.rewards import build_verifier

            verifier = build_verifier(verifier, tools=self.toolbox)
        elif isinstance(verifier, str | os.PathLike):
            from rlf_envs.rewards import load_verifier_yaml

            verifier = load_verifier_yaml(os.fspath(verifier), tools=self.toolbox)
        self.verifier: Verifier = verifier or _default_verifier()
        if isinstance(turn_rewarder, dict):
            from rlf_envs.rewards import build_turn_rewarder

            turn_rewarder = build_turn_rewarder(turn_rewarder)
        self.turn_rewarder = turn_rewarder
        # a rewarder whose turn_reward takes the task (e.g. TurnRewarder's answer_in_result_bonus) gets it
        self._reward_task = turn_rewarder is not None and _takes_task(turn_rewarder.turn_reward)
        self.max_turns = max_turns
        if max_invalid_streak is not None and (not isinstance(max_invalid_streak, int) or max_invalid_streak < 1):
            raise ValueError(f"max_invalid_streak must be a positive int or None, got {max_invalid_streak!r}")
        self.max_invalid_streak = max_invalid_streak
        self.max_total_tokens = max_total_tokens
        self.max_obs_tokens = max_obs_tokens
        self.system_prompt = system_prompt
        self.tok = TokenizerAdapter.shared(tokenizer) if tokenizer is not None else None
        if self.tok is None:
            self.observation_space: gym.Space[Any] = AnyText()
            self.action_space: gym.Space[Any] = AnyText()
        else:
            self.observation_space = token_space(self.tok.vocab_size)
            self.action_space = token_space(self.tok.vocab_size)
        self._traj: Trajectory | None = None
        self._done = True
        self._n_tokens = 0

    # -- properties ---------------------------------------------------------------------------------
    @property
    def token_mode(self) -> bool:
        return self.tok is not None

    @property
    def trajectory(self) -> Trajectory:
        if self._traj is None:
            raise RuntimeError("no episode yet: call reset() first")
        return self._traj

    @property
    def done(self) -> bool:
        return self._done

    # -- reset --------------------------------------------------------------------------------------
    #: the reset options rlf envs take: `task` (a Task or a task dict), `task_index` (into `tasks`), `task_id` (the
    #: id of one of `tasks`); any other key is refused, not ignored
    RESET_OPTIONS = ("task", "task_index", "task_id")

    def _pick_task(self, options: dict[str, Any] | None) -> Task:
        options = options or {}
        unknown = sorted(set(options) - set(self.RESET_OPTIONS))
        if unknown:
            raise ValueError(f"unknown reset options {unknown}: an rlf env takes task (a Task or task dict), "
                             "task_index (an index into env.tasks) or task_id (the id of one of env.tasks)")
        if "task_id" in options:
            ids = getattr(self, "_task_ids", None)  # (tasks, their count, id -> first index), built once
            if ids is None or ids[0] is not self.tasks or ids[1] != len(self.tasks):
                index: dict[str, int] = {}
                for n, t in enumerate(self.tasks):
                    index.setdefault(t.id, n)
                ids = self._task_ids = (self.tasks, len(self.tasks), index)
            tid = str(options["task_id"])
            if tid not in ids[2]:
                raise ValueError(f"task_id {tid!r}: none of this env's {len(self.tasks)} tasks has that id")
            return self.tasks[ids[2][tid]]
        if "task" in options:
            t = options["task"]
            return t if isinstance(t, Task) else load_tasks([t])[0]
        if "task_index" in options:
            i = int(options["task_index"])
            if not 0 <= i < len(self.tasks):
                raise IndexError(f"task_index {i} out of range: this env has {len(self.tasks)} tasks")
            return self.tasks[i]
        return self.tasks[int(self.np_random.integers(len(self.tasks)))]

    def _begin(self, seed: int | None, options: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
        return start_episodes([self], [seed], [options])[0]

    def _prepare_episode(self, seed: int | None, options: dict[str, Any] | None) -> tuple[Task, str]:
        """Seed, pick the task and render its prompt (ToolVectorEnv encodes a batch of prompts at once)."""
        self.end_episode()  # the previous episode's resources, finished or not
        super().reset(seed=seed)
        task = self._pick_task(options)
        return task, self.format.render_prompt(task, self.toolbox.specs, self.system_prompt)

    def _start_episode(self, task: Task, prompt: str, ids: list[int] | None) -> tuple[Any, dict[str, Any]]:
        traj = Trajectory(task=task, prompt=prompt)
        obs: Any
        if ids is not None:
            traj.token_ids = list(ids)
            traj.loss_mask = [0] * len(ids)
            self._n_tokens = len(ids)
            obs = as_token_array(ids)
        else:
            self._n_tokens = -(-len(prompt) // CHARS_PER_TOKEN)
            obs = prompt
        self._traj = traj
        self._done = False
        return obs, {"task_id": task.id, "turn": 0}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        return self._begin(seed, options)

    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        return self._begin(seed, options)

    # -- step ---------------------------------------------------------------------------------------
    def step(self, action: Any) -> StepReturn:
        return runtime.run(self.astep(action))

    def _action_text(self, action: Any) -> tuple[str, list[int] | None, str | None]:
        """(text, token ids, why the ids could not be decoded). A wrong action type is the caller's bug and
        raises; ids the tokenizer cannot decode (e.g. from a model's padded vocabulary) are a bad action."""
        if self.tok is None:
            if not isinstance(action, str):
                raise TypeError(f"text-mode ToolEnv takes str actions, got {type(action).__name__}")
            return action, None, None
        if isinstance(action, str):  # convenience: text given to a token-mode env
            return action, _encode_one(self.tok, action), None
        ids = [int(x) for x in (action.tolist() if isinstance(action, np.ndarray) else action)]
        try:
            return self.tok.decode(ids), ids, None
        except Exception as e:
            return "", ids, f"the token ids could not be decoded ({type(e).__name__})"

    def _cap_results(self, results: list[ToolResult]) -> None:
        """Shorten tool outputs so one observation stays within max_obs_tokens."""
        if not results:
            return
        per = max(8, (self.max_obs_tokens - 16 * len(results)) // len(results))
        for r in results:
            if self.tok is None:
                r.content, cut = truncate(r.content, per * CHARS_PER_TOKEN)
            elif len(r.content.encode("utf-8")) <= per:  # a token is >= 1 byte: surely within budget
                cut = False
            else:
                ids = self.tok.encode(r.content)
                cut = len(ids) > per
                if cut:
                    r.content = self.tok.decode(ids[:per]) + f"\n...[truncated: {len(ids) - per} more tokens]"
            r.truncated = r.truncated or cut

    # A step runs in phases (see `step_envs`), so that ToolVectorEnv can run each phase for a whole batch;
    # `astep` is a batch of one.
    async def astep(self, action: Any) -> StepReturn:
        return (await step_envs([self], [action]))[0]

    def _decode_action(self, action: Any) -> tuple[str, list[int] | None, str | None]:
        """Check the env can step and convert the action; raises before anything is recorded."""
        if self._done or self._traj is None:
            raise RuntimeError("episode is over: call reset() (or areset()) before step()")
        return self._action_text(action)

    def _mark(self) -> Mark:
        traj = self._traj
        assert traj is not None
        n_ids = len(traj.token_ids) if traj.token_ids is not None else 0
        return len(traj.turns), n_ids, self._n_tokens, self._done, traj.answer, traj.end

    def _rewind(self, mark: Mark) -> None:
        """Undo a step that did not complete (see `step_envs`)."""
        traj = self._traj
        assert traj is not None
        n_turns, n_ids, self._n_tokens, self._done, traj.answer, traj.end = mark
        del traj.turns[n_turns:]
        if traj.token_ids is not None and traj.loss_mask is not None:
            del traj.token_ids[n_ids:], traj.loss_mask[n_ids:]

    def parse_action(self, text: str) -> Action:
        """The format's parse; any exception in it is an invalid turn, not a crash of the step."""
        try:
            return self.format.parse(text)
        except Exception as e:
            _warn_once(f"{type(self.format).__name__}.parse", e)
            return Action(ActionKind.INVALID, text, error=f"the turn could not be parsed ({type(e).__name__})")

    def _record(self, text: str, ids: list[int] | None, problem: str | None = None) -> PendingStep:
        """Parse the action and append it (ids with loss mask 1) to the trajectory as a new turn."""
        traj = self._traj
        assert traj is not None
        parsed = self.parse_action(text) if problem is None else Action(ActionKind.INVALID, text, error=problem)
        turn = Turn(action=parsed, stats=TurnStats(invalid=parsed.kind is ActionKind.INVALID))
        if ids is not None and traj.token_ids is not None and traj.loss_mask is not None:
            start = len(traj.token_ids)
            traj.token_ids.extend(ids)
            traj.loss_mask.extend([1] * len(ids))
            turn.action_span = (start, len(traj.token_ids))
            self._n_tokens = len(traj.token_ids)
        else:
            self._n_tokens += -(-len(text) // CHARS_PER_TOKEN)
        traj.turns.append(turn)
        return PendingStep(turn, text)

    async def _call_tools(self, step: PendingStep) -> None:
        turn = step.turn
        t0 = time.perf_counter()
        try:
            turn.results = await self.toolbox.call_batch(self.bind_calls(step))
            for r, call in zip(turn.results, turn.action.calls, strict=True):
                r.call = call  # the trajectory records the policy's calls, not what an env bound to them
            self._cap_results(turn.results)
        except Exception as e:  # the caller turns each tool's faults into results; this is a last resort
            _warn_once("the tool batch", e)
            msg = f"Error: the tool call failed ({type(e).__name__})."
            turn.results = [ToolResult(c, msg, ToolStatus.ERROR) for c in turn.action.calls]
        turn.stats.tool_seconds = time.perf_counter() - t0
        st = turn.stats
        st.calls = len(turn.results)
        for r in turn.results:
            st.errors += not r.ok
            st.timeouts += r.status is ToolStatus.TIMEOUT
            st.truncated += r.truncated
            st.unknown_tools += r.status is ToolStatus.UNKNOWN_TOOL
            st.invalid_args += r.status is ToolStatus.INVALID_ARGS

    def bind_calls(self, step: PendingStep) -> Sequence[ToolCall]:
        """The calls to run for this turn: the policy's. An env that binds per-episode state to its shared
        tools (e.g. rlf/SQL-v0's database) adds it here, where the policy cannot forge it."""
        return step.turn.action.calls

    def _observation_text(self, step: PendingStep) -> str:
        """The text the env answers with ("" when the episode ends here)."""
        parsed = step.turn.action
        if parsed.kind is ActionKind.ANSWER or len(self._traj.turns) >= self.max_turns:  # type: ignore[union-attr]
            return ""
        try:
            if parsed.kind is ActionKind.TOOL_CALLS:
                return self.format.render_observation(step.action_text, step.turn.results)
            return self.format.render_correction(step.action_text, parsed)
        except Exception as e:
            _warn_once(f"{type(self.format).__name__}.render", e)
            why = f"the observation could not be rendered ({type(e).__name__})"
            try:
                return self.format.render_correction(step.action_text, Action(ActionKind.INVALID, "", error=why))
            except Exception:
                return f"\nError: {why}.\n"

    def _finish(
        self, step: PendingStep, obs_text: str, obs_ids: list[int] | None
    ) -> StepReturn:
        """Budgets, end of episode, per-turn reward, the step's return values (before the final score)."""
        traj = self._traj
        assert traj is not None
        turn = step.turn
        parsed = turn.action
        terminated = parsed.kind is ActionKind.ANSWER
        truncated = False
        if terminated:
            traj.answer = parsed.answer
            traj.end = EndReason.ANSWER
        elif len(traj.turns) >= self.max_turns:
            truncated, traj.end = True, EndReason.MAX_TURNS
        elif self.max_invalid_streak is not None and len(traj.turns) >= self.max_invalid_streak and all(
                t.stats.unusable for t in traj.turns[-self.max_invalid_streak:]):
            truncated, traj.end = True, EndReason.INVALID_CALLS
            obs_text, obs_ids = "", None
        else:
            n_obs = len(obs_ids) if obs_ids is not None else -(-len(obs_text) // CHARS_PER_TOKEN)
            if self._n_tokens + n_obs >= self.max_total_tokens:
                truncated, traj.end = True, EndReason.TOKEN_BUDGET
                obs_text, obs_ids = "", None
        turn.observation = obs_text
        if obs_ids and traj.token_ids is not None and traj.loss_mask is not None:
            start = len(traj.token_ids)
            traj.token_ids.extend(obs_ids)
            traj.loss_mask.extend([0] * len(obs_ids))
            turn.observation_span = (start, len(traj.token_ids))
            self._n_tokens = len(traj.token_ids)
        elif obs_text:
            self._n_tokens += -(-len(obs_text) // CHARS_PER_TOKEN)
        if self.turn_rewarder is not None:
            try:
                turn.reward = float(self.turn_rewarder.turn_reward(turn, task=traj.task)) if self._reward_task \
                    else float(self.turn_rewarder.turn_reward(turn))
            except Exception as e:
                _warn_once("the turn rewarder", e)
        info: dict[str, Any] = {
            "turn": len(traj.turns),
            "action_kind": parsed.kind.value,
            "turn_stats": turn.stats,
            "tool_calls": turn.stats.calls,
            "tool_errors": turn.stats.errors,
            "invalid": turn.stats.invalid,
            "turn_reward": turn.reward,
        }
        if terminated or truncated:
            self._done = True
        obs: Any = as_token_array(obs_ids or []) if self.tok is not None else obs_text
        return obs, float(turn.reward), terminated, truncated, info

    async def _score_end(self, result: StepReturn) -> StepReturn:
        """The verifier's score of the finished episode, added to the last step's reward."""
        traj = self._traj
        assert traj is not None
        obs, reward, terminated, truncated, info = result
        score: Score = await runtime.bridge(self.verifier.safe_score(traj, traj.task))
        traj.reward = score.value
        traj.score_info = dict(score.info)
        if score.per_turn:
            for t, value in zip(traj.turns, score.per_turn, strict=False):
                t.reward += value
        info.update(trajectory=traj, score=score, end_reason=traj.end.value)
        self.end_episode()
        return obs, reward + score.value, terminated, truncated, info

    # -- misc ---------------------------------------------------------------------------------------
    def render(self) -> str | None:
        if self.render_mode != "ansi" or self._traj is None:
            return None
        return self._traj.text

    def end_episode(self) -> None:
        """Hook: release the episode's own resources (e.g. rlf/Code-v0's work dir). Called once the episode is
        scored, at the next reset (also when the episode never finished) and on close; must be idempotent."""

    def close(self) -> None:
        """Envs share their toolbox (servers stay up for other envs); see `rlf_envs.close_all()`."""
        self._done = True
        self.end_episode()


