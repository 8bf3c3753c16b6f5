"""`rollout.environment` as a rollout source: the agent source (`AgentSource`, `AgentRunner`) with the foreign
environment's own rollout as the agent function.

Every episode opens a session on the policy endpoint as `rollout.agent` does; the "agent" hands the session's
base URL to the foreign backend, which runs its environment's rollout and scoring on an event loop of its own
(`AgentLoop`: the foreign code's servers live there across batches). Its `Outcome` becomes the episode's reward
and records: named scores in `score_info` (`foreign/<name>`) and the metrics (`foreign/<name>_mean`), an
infrastructure failure on the episode's rows (`Trajectory.infra_error`), whose GRPO group then leaves the loss.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import traceback
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlf_envs.errors import RlfError
from rlf_envs.formats.chat import ChatCodec
from rlf_envs.rewards.base import Verifier
from rlf_envs.types import Task
from rlf_train.config import ConfigError
from rlf_train.rollout.agent_runner import AgentEpisodes, AgentLoop, AgentResult, AgentRunner, _Reporter
from rlf_train.rollout.agent_source import AgentFailed, AgentSource, AgentWorker, run_on_rlf_loop
from rlf_train.rollout.async_worker import AsyncPlan
from rlf_train.rollout.batch import Rollouts, RolloutStats, SamplingParams
from rlf_train.rollout.endpoint.engine import EngineFront
from rlf_train.rollout.endpoint.sessions import EndpointLimits
from rlf_train.rollout.env_factory import Stage
from rlf_train.rollout.env_source import EnvSource
from rlf_train.rollout.foreign import Backend, Episode, ForeignHostFailed, Outcome

log = logging.getLogger(__name__)


class ForeignInfraFailed(AgentFailed):
    """Every GRPO group of a training update held an infrastructure failure: nothing is left to train on."""


@dataclass
class _Slot:
    task: Task  # the task as the env gave it (rows get it back)
    backend: Backend
    group_seed: int
    outcome: Outcome | None = None


@dataclass
class ForeignStats:
    """Per batch: how the foreign episodes ended and what their scorers said."""

    episodes: int = 0
    infra_failed: int = 0
    no_reward: int = 0
    budget: int = 0
    scores: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    metrics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    kinds: Counter[str] = field(default_factory=Counter)

    def add(self, other: ForeignStats) -> None:
        self.episodes += other.episodes
        self.infra_failed += other.infra_failed
        self.no_reward += other.no_reward
        self.budget += other.budget
        for k, v in other.scores.items():
            self.scores[k].extend(v)
        for k, v in other.metrics.items():
            self.metrics[k].extend(v)
        self.kinds.update(other.kinds)

    def as_metrics(self) -> dict[str, float]:
        out = {"foreign_infra_failed": float(self.infra_failed), "foreign_no_reward": float(self.no_reward),
               "foreign_budget_exceeded": float(self.budget)}
        out.update({f"foreign/{k}_mean": sum(v) / len(v) for k, v in sorted(self.scores.items()) if v})
        out.update({f"foreign/{k}_mean": sum(v) / len(v) for k, v in sorted(self.metrics.items()) if v})
        return out

    def summary(self) -> str:
        return (f"{self.episodes} episodes: {self.infra_failed} infrastructure failures (dropped from the loss), "
                f"{self.no_reward} without a reward, {self.budget} past rlf's budgets")


@dataclass
class ForeignEpisodes(AgentEpisodes):
    """A batch of foreign episodes: the agent runner's, plus what the foreign scorers said (`foreign`) and which
    episodes the infrastructure failed (`failed`, indices into the batch)."""

    foreign: ForeignStats = field(default_factory=ForeignStats)
    failed: list[int] = field(default_factory=list)

    def append(self, p: AgentEpisodes) -> None:
        assert isinstance(p, ForeignEpisodes)
        self.failed.extend(len(self.rewards) + e for e in p.failed)
        self.foreign.add(p.foreign)
        super().append(p)


class ForeignRunner(AgentRunner):
    """An `AgentRunner` whose episodes are the foreign environment's: each gets a task object of its own (the same
    task, so rows keep its id) that names its slot, and its rows come back with the outcome applied. Batches may
    run at once (the async worker runs a batch per GRPO group): each one's outcomes come back with it. `stage`
    picks the split's backend."""

    def __init__(self, source: ForeignSource, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.source = source

    async def run(self, tasks: Sequence[Task], verifier: Verifier, seeds: Sequence[int] | None = None,
                  stage: Stage = "train") -> ForeignEpisodes:
        src = self.source
        backend = src.backends[stage]
        copies = [dataclasses.replace(t) for t in tasks]
        first: dict[str, int] = {}
        slots = {}
        for e, (c, t) in enumerate(zip(copies, tasks, strict=True)):
            # one seed per task of the batch: the G episodes of a GRPO group start from the same state
            seed = first.setdefault(t.id, (seeds[e] if seeds is not None else e) & 0x7FFFFFFF)
            slots[id(c)] = _Slot(t, backend, seed)
        src.slots.update(slots)
        try:
            eps = await super().run(copies, verifier, seeds, stage)
        finally:
            for k in slots:
                src.slots.pop(k, None)
        stats = ForeignStats(episodes=len(tasks))
        failed: list[int] = []
        by_copy = {id(c): (e, slots[id(c)]) for e, c in enumerate(copies)}
        for e, c in enumerate(copies):
            o = slots[id(c)].outcome
            if o is None:  # the agent side ended it (a timeout, a cancel): the runner counted and scored it
                continue
            if o.infra_error is not None:
                failed.append(e)
                stats.infra_failed += 1
                stats.kinds[o.infra_error[:160]] += 1
                eps.rewards[e] = 0.0
                continue
            if o.budget_error is not None:
                stats.budget += 1
            if o.reward is None:
                stats.no_reward += 1
            for k, v in o.scores.items():
                stats.scores[k].append(float(v))
            for k, v in o.metrics.items():
                if isinstance(v, int | float) and math.isfinite(float(v)):
                    stats.metrics[k].append(float(v))
        for row in eps.trajectories:
            e, slot = by_copy[id(row.task)]
            row.task = slot.task
            o = slot.outcome
            if o is None:
                continue
            row.score_info.update({f"foreign/{k}": float(v) for k, v in o.scores.items() if _finite(v)})
            if o.infra_error is not None:
                row.infra_error = o.infra_error
                row.reward = 0.0
        return ForeignEpisodes(eps.trajectories, eps.episode_of_row, eps.rewards, eps.stats, stats, failed)


def _finite(v: Any) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


class ForeignSource(AgentSource):
    """`rollout.environment` as a rollout source (a `Source`); see the module docstring. Training rows of a GRPO
    group that holds an infrastructure failure are dropped (the group's reward is no signal); eval drops the
    failed episodes. Both are counted (`foreign_infra_failed`) and said on the console."""

    def __init__(self, spec: str, tokenizer: Any, envs: dict[Stage, Any], engine: EnvSource, limits: EndpointLimits,
                 concurrency: int, group_size: int, sampling: SamplingParams, max_turns: int = 4) -> None:
        self.spec = spec
        self.backends: dict[Stage, Backend] = {stage: v.envs[0].backend for stage, v in envs.items()}
        self.group_size = group_size
        self.sampling = sampling
        self.max_turns = max_turns
        self.slots: dict[int, _Slot] = {}
        self.host: AgentLoop | None = None
        self.started: list[Backend] = []
        self.foreign_totals = {"train": ForeignStats(), "eval": ForeignStats()}
        self.pending_foreign = ForeignStats()
        self._reporter = _Reporter()
        self._logged = False
        super().__init__(spec, tokenizer, envs, engine, limits, concurrency)

    def check(self, spec: str, fmt: Any) -> tuple[Any, ChatCodec]:  # type: ignore[override]
        """What the endpoint needs: the openai SDK (each session's client) and a format it renders."""
        try:
            import openai  # noqa: F401
        except ImportError:
            from rlf_envs.extras import pip_install

            raise ConfigError(f"rollout.environment needs the openai SDK: {pip_install('agents', 'rlf-train')}"
                              ) from None
        try:
            return self._episode, ChatCodec(fmt)
        except ValueError as e:
            raise ConfigError(f"rollout.environment: {e} (set env.kwargs.format)") from None

    # ------------------------------------------------------------------ the foreign side
    def _start_host(self) -> None:
        if self.host is None:
            self.host = AgentLoop()
            self.host.loop.set_exception_handler(lambda loop, ctx: log.debug("foreign loop: %s", ctx.get("message")))

    def _ensure_started(self, backend: Backend) -> None:
        """Bring the backend's servers up (once), on the foreign loop; a failure is the host's: a clear error."""
        if any(b is backend for b in self.started):
            return
        self._start_host()
        assert self.host is not None
        self.started.append(backend)  # (before it starts: close() ends whatever a failed start left running)
        try:
            self.host.submit(backend.start()).result(timeout=600)
        except ForeignHostFailed as e:
            raise ForeignStartFailed(f"rollout.environment {self.spec!r}: the {backend.ecosystem} environment did "
                                     f"not start: {e}") from e
        except RlfError:
            raise
        except Exception as e:
            raise ForeignStartFailed(f"rollout.environment {self.spec!r}: the {backend.ecosystem} environment did "
                                     f"not start: {type(e).__name__}: {e}") from e

    async def _episode(self, task: Task, client: Any) -> AgentResult:
        """The agent function: the foreign rollout of this episode's task against the client's session."""
        slot = self.slots[id(task)]
        ep = Episode(task=slot.task, base_url=str(client.base_url).rstrip("/"), api_key=client.api_key,
                     model=client.model, temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                     max_tokens=self.sampling.max_new_tokens, group_seed=slot.group_seed,
                     max_turns=self.max_turns)
        assert self.host is not None
        fut = self.host.submit(slot.backend.episode(ep))
        try:
            outcome = (await asyncio.wrap_future(fut)).checked()
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except Exception as e:  # the backend's own code failed: the host's, not the policy's
            if not self._logged:
                self._logged = True
                log.warning("the %s backend raised on task %s (an infrastructure failure, dropped from the loss; "
                            "this traceback is shown once):\n%s", slot.backend.ecosystem, slot.task.id,
                            traceback.format_exc())
            outcome = Outcome(infra_error=f"{type(e).__name__}: {e}")
        slot.outcome = outcome
        if outcome.infra_error is not None:
            self._reporter.report("infra", "a %s episode (task %s) failed by infrastructure: %s (dropped from the "
                                  "loss with its group; counted in foreign_infra_failed)", slot.backend.ecosystem,
                                  slot.task.id, outcome.infra_error[:500])
            return AgentResult(reward=0.0)
        return AgentResult(reward=0.0 if outcome.reward is None else float(outcome.reward))

    # ------------------------------------------------------------------ the source
    def collect(self, stage: Stage, task_indices: Sequence[int], params: SamplingParams, seed_base: int,
                gen: torch.Generator | None) -> Rollouts:
        self._ensure_started(self.backends[stage])
        return super().collect(stage, task_indices, params, seed_base, gen)

    def make_runner(self, front: EngineFront) -> ForeignRunner:
        return ForeignRunner(self, self.agent, self.codec, self.tokenizer, self.limits, self.concurrency, front)

    def rollouts(self, stage: Stage, eps: AgentEpisodes, stats: RolloutStats) -> Rollouts:
        """The agent source's rows, with the foreign outcomes: eval drops the infra-failed episodes, training the
        GRPO groups that hold one; the foreign counters join the metrics."""
        assert isinstance(eps, ForeignEpisodes)
        out = super().rollouts(stage, eps, stats)
        self.foreign_totals["train" if stage == "train" else "eval"].add(eps.foreign)
        if stage != "train":
            self.pending_foreign.add(eps.foreign)
            return _drop_episodes(out, set(eps.failed))
        out = self._drop_failed_groups(out, eps.foreign, set(eps.failed))
        out.metrics.update(eps.foreign.as_metrics())
        return out

    def async_worker(self, plan: AsyncPlan) -> AgentWorker:
        """`rollout.mode: async`: the agent worker, its episodes the foreign environment's (started first)."""
        self._ensure_started(self.backends["train"])
        return super().async_worker(plan)

    def _drop_failed_groups(self, out: Rollouts, stats: ForeignStats, failed: set[int]) -> Rollouts:
        """Training: the rows of every GRPO group holding an infra-failed episode leave the batch (the rewards stay
        per episode, in order, as the learner groups them); a batch with no group left stops the run."""
        if not failed:
            return out
        G = self.group_size
        bad_groups = {e // G for e in failed}
        keep = [i for i, e in enumerate(out.episode_of_row) if e // G not in bad_groups]
        if not keep or len(bad_groups) >= len(out.rewards or []) // G:
            raise ForeignInfraFailed(
                f"every GRPO group of this update holds an episode the infrastructure failed ({stats.infra_failed} "
                f"of {stats.episodes} episodes; {', '.join(f'{k} x{n}' for k, n in stats.kinds.most_common(3))}): "
                "nothing is left to train on. The warnings above show why; the run stops (its checkpoints are "
                "kept): fix the environment, then start again or continue with --resume")
        out.metrics["foreign_dropped_groups"] = float(len(bad_groups))
        return Rollouts([out.trajectories[i] for i in keep], [out.episode_of_row[i] for i in keep], out.stats,
                        out.metrics, out.rewards)

    def eval_metrics(self) -> dict[str, float]:
        out = super().eval_metrics()
        got, self.pending_foreign = self.pending_foreign, ForeignStats()
        out.update(got.as_metrics())
        return out

    def summary(self) -> str:
        t = self.foreign_totals
        return (f"{super().summary()}; {self.spec}: training {t['train'].summary()}; eval {t['eval'].summary()}")

    def close(self, timeout_s: float = 60.0) -> None:
        """The endpoint and the engine (the agent source's), then the foreign environment's servers and loop."""
        try:
            super().close(timeout_s)
        finally:
            host, self.host = self.host, None
            started, self.started = self.started, []
            if host is not None:
                for b in started:
                    try:
                        host.submit(b.close()).result(timeout=timeout_s)
                    except Exception as e:
                        log.warning("closing the %s environment: %s: %s", b.ecosystem, type(e).__name__, e)
                try:
                    run_on_rlf_loop(host.close(), timeout=10)
                except Exception as e:
                    log.warning("the foreign environment's event loop did not stop: %s", e)


class ForeignStartFailed(RlfError, RuntimeError):
    """The foreign environment could not be brought up (its server did not start, its serving context raised)."""


def _drop_episodes(out: Rollouts, failed: set[int]) -> Rollouts:
    """Eval: an infra-failed episode is no result; its rows and reward leave the batch."""
    if not failed:
        return out
    renum: dict[int, int] = {}
    kept_rewards = []
    for e, r in enumerate(out.rewards or []):
        if e not in failed:
            renum[e] = len(kept_rewards)
            kept_rewards.append(r)
    rows = [(t, renum[e]) for t, e in zip(out.trajectories, out.episode_of_row, strict=True) if e in renum]
    return Rollouts([t for t, _ in rows], [e for _, e in rows], out.stats, out.metrics, kept_rewards)


__all__ = ["ForeignEpisodes", "ForeignInfraFailed", "ForeignRunner", "ForeignSource", "ForeignStats",
           "ForeignStartFailed"]
