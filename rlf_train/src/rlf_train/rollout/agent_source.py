"""The agent source: `rollout.agent`'s code as a rollout source (docs/guides/own-agent.md). The env gives the tasks,
the format and the verifier; every episode is the user's agent function against the policy endpoint
(`agent_runner.AgentRunner`), generating with the env source's engine. Its rows are the episodes' segments.
`AgentWorker` runs them ahead of the learner (`rollout.mode: async`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlf_envs import runtime
from rlf_envs.errors import RlfError
from rlf_envs.formats.chat import ChatCodec
from rlf_train.config import ConfigError
from rlf_train.rollout.agent_runner import AgentEpisodes, AgentFn, AgentRunner, AgentStats, load_agent
from rlf_train.rollout.async_worker import AsyncBatch, AsyncPlan, AsyncWorker, frozen_copy
from rlf_train.rollout.batch import Rollouts, RolloutStats, SamplingParams
from rlf_train.rollout.endpoint.engine import EngineFront, EngineStats
from rlf_train.rollout.endpoint.sessions import EndpointLimits
from rlf_train.rollout.env_factory import Stage
from rlf_train.rollout.env_source import EnvSource
from rlf_train.rollout.local import local_generate_batch
from rlf_train.rollout.sampling import row_seeds
from rlf_train.rollout.seeds import mix_seed
from rlf_train.rollout.vllm import VllmRollout
from rlf_train.rollout.weights import WeightStore

log = logging.getLogger(__name__)


class AgentSource:
    """`rollout.agent` as a rollout source (a `Source`): unmodified agent code becomes GRPO rows. The agent function
    runs against the policy endpoint (started at the first rollout, on rlf's event loop, loopback), generating with
    the env source's engine (`EnvSource.generate_batch`), which this source owns. The env (made by the trainer)
    gives the tasks, the format and the verifier; it is not stepped."""

    def __init__(self, spec: str, tokenizer: Any, envs: dict[Stage, Any], engine: EnvSource, limits: EndpointLimits,
                 concurrency: int) -> None:
        self.agent, self.codec = self.check(spec, envs["train"].envs[0].format)
        self.envs = envs
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.concurrency = concurrency
        self.runner: AgentRunner | None = None
        self.front: EngineFront | None = None
        self.totals = {"train": AgentStats(), "eval": AgentStats()}  # the run's, per stage (the end-of-run summary)
        self.pending_eval = AgentStats()  # eval batches since `take_eval` (the trainer's eval rows)

    @staticmethod
    def check(spec: str, fmt: Any) -> tuple[AgentFn, ChatCodec]:
        """What `rollout.agent` needs before any work (the trainer and `--dry-run` both check it): the function,
        the openai SDK, a format the endpoint renders. A problem is a ConfigError naming the key."""
        fn = load_agent(spec)
        try:
            import openai  # noqa: F401  (each episode's client)
        except ImportError:
            from rlf_envs.extras import pip_install

            raise ConfigError(f"rollout.agent needs the openai SDK: {pip_install('agents', 'rlf-train')}") from None
        try:
            return fn, ChatCodec(fmt)
        except ValueError as e:
            raise ConfigError(f"rollout.agent: {e}") from None

    @property
    def vllm(self) -> VllmRollout | None:
        """The engine's vLLM (`rollout.engine: vllm`), once the first rollout built it."""
        return self.engine.vllm

    def collect(self, stage: Stage, task_indices: Sequence[int], params: SamplingParams, seed_base: int,
                gen: torch.Generator | None) -> Rollouts:
        """One agent episode per task of `stage`'s split, in order; rows are segments (`Rollouts`)."""
        env = self.envs[stage].envs[0]
        generate_batch = self.engine.generate_batch(params, gen, self.codec.stop_strings)
        version = self.engine.version()
        if self.runner is None:
            self.front = EngineFront(generate_batch, self.codec.stop_strings, version)
            self.runner = self.make_runner(self.front)
            run_on_rlf_loop(self.runner.start())
        front = self.front
        assert front is not None
        front.set_engine(generate_batch, version)
        model = self.engine.model()
        was_training = model.training
        model.eval()
        base = row_seeds(1, gen)[0]  # episode e samples with mix_seed(base, e): the run's seed fixes the run
        try:
            eps = run_on_rlf_loop(self.runner.run([env.tasks[i] for i in task_indices], env.verifier,
                                                  [mix_seed(base, e) for e in range(len(task_indices))], stage))
        finally:
            model.train(was_training)
        stats = RolloutStats(gen_seconds=front.stats.gen_seconds, total_seconds=eps.stats.seconds,
                             gen_tokens=front.stats.gen_tokens, turns=eps.stats.calls)
        front.stats = EngineStats()
        self.account(stage, eps.stats)
        return self.rollouts(stage, eps, stats)

    def make_runner(self, front: EngineFront) -> AgentRunner:
        """The runner of this source's episodes against `front` (the sync engine's, or the async worker's)."""
        return AgentRunner(self.agent, self.codec, self.tokenizer, self.limits, self.concurrency, front)

    def rollouts(self, stage: Stage, eps: AgentEpisodes, stats: RolloutStats) -> Rollouts:
        """A batch of episodes (accounted) as the learner's rows: every segment, the rewards per episode."""
        return Rollouts(eps.trajectories, eps.episode_of_row, stats, eps.stats.metrics(), eps.rewards)

    def account(self, stage: str, stats: AgentStats) -> None:
        """Add a batch to the run's totals; a training batch whose every episode failed stops the run
        (`AgentFailed`): its rewards are all 0, so nothing trains, and the next batch would fail the same way."""
        self.totals["train" if stage == "train" else "eval"].add(stats)
        if stage != "train":
            self.pending_eval.add(stats)
        elif stats.episodes and stats.failed == stats.episodes:
            blocked = ", the agents blocked their event loop" if stats.blocked else ""
            raise AgentFailed(f"every one of the {stats.episodes} agent episodes of this update failed "
                              f"({stats.errors} raised, {stats.timeouts} timed out after rollout.agent_timeout_s="
                              f"{self.limits.timeout_s:g} s{blocked}"
                              "); the warnings above show why. The run stops (its checkpoints are kept): fix the "
                              "agent, then start again or continue with --resume")

    def async_worker(self, plan: AsyncPlan) -> AgentWorker:
        """Agent episodes ahead of the learner, against an endpoint of their own (`AgentWorker`)."""
        return AgentWorker(self, frozen_copy(plan.model), plan.params, store=WeightStore(keep=plan.keep),
                           admission=plan.admission, prompts_for=plan.prompts.__getitem__, group_size=plan.group_size,
                           first_update=plan.first_update, last_update=plan.last_update, batch_size=plan.batch_size,
                           gen=plan.gen)

    def eval_metrics(self) -> dict[str, float]:
        """The agents' counters (errors, timeouts, no-answer episodes, breaks) of the eval batches since the last
        call."""
        return self.take_eval().metrics()

    def take_eval(self) -> AgentStats:
        """The eval batches' counts since the last call."""
        out, self.pending_eval = self.pending_eval, AgentStats()
        return out

    def summary(self) -> str:
        t = self.totals
        return f"agent: training {t['train'].summary()}; eval {t['eval'].summary()}"

    def close(self, timeout_s: float = 60.0) -> None:
        """The endpoint, then the engine. Bounded: an agent that blocks its loop cannot hold the run's end up
        (`AgentLoop`)."""
        runner, self.runner = self.runner, None
        try:
            if runner is not None:
                try:
                    run_on_rlf_loop(runner.close(), timeout=timeout_s)
                except TimeoutError:
                    log.warning("closing the agent endpoint took over %.0f s; left behind", timeout_s)
        finally:
            self.engine.close()


def run_on_rlf_loop(coro: Any, timeout: float | None = None) -> Any:
    """`rlf_envs.runtime.run`, waiting in short slices: a wait on a lock is not woken by a signal that another
    thread received, so a plain wait could hold Ctrl-C back for as long as the agents run."""
    fut = asyncio.run_coroutine_threadsafe(coro, runtime.get_loop())
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            left = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError
            try:
                return fut.result(left)
            except concurrent.futures.TimeoutError:
                continue
    except BaseException:  # Ctrl-C or our timeout: do not leave the work running on the loop
        fut.cancel()
        raise


class AgentFailed(RlfError, RuntimeError):
    """Every agent episode of a training update failed: the run stops (the CLI exits 1)."""


class AgentWorker(AsyncWorker):
    """`rollout.mode: async` with `rollout.agent`: agent episodes run ahead of the learner, on rlf's loop, against
    an endpoint of their own whose engine is a copy of the policy (`model`) that takes the newest published
    weights (`store`) before each batch of requests, so a weight swap happens between engine calls and requests
    just wait for it (partial rollouts: an episode in flight continues with the new weights; each generation
    records the version that sampled it and its log-probs). Groups start under the staleness bound
    (`admission`), in data order; the parts of an update's batch are its groups."""

    what = "async agent worker"
    items = "agent episodes"

    def __init__(self, source: AgentSource, model: Any, params: Any, *, store: Any, admission: Any,
                 prompts_for: Callable[[int], Sequence[int]], group_size: int, first_update: int,
                 last_update: int, batch_size: int, gen: Any) -> None:
        super().__init__(store, admission)
        self.source, self.model = source, model
        self.prompts_for, self.G = prompts_for, group_size
        self.first_update, self.last_update = first_update, last_update
        self.version = -1
        inner = local_generate_batch(model, source.tokenizer, params, source.codec.stop_strings,
                                     batch_size=batch_size, gen=gen, logprobs=True)
        self.front = EngineFront(inner, source.codec.stop_strings)
        self.front.refresh = self._refresh
        self.runner = source.make_runner(self.front)
        self._seed_base = row_seeds(1, gen)[0]  # group k's episode i samples with mix_seed(base, k * G + i)
        self._t0 = 0.0

    def _refresh(self) -> int:
        """On the engine's thread, before a batch: the newest published weights (requests wait meanwhile)."""
        got = self.store.newer_than(self.version)
        if got is not None:
            self.version, state = got
            self.model.load_state_dict(state)
        return self.version

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self.model.eval()
        super().start()

    def _halt(self, future: Any) -> None:
        future.cancel()  # the episodes in flight are abandoned at once (a resumed run starts them again)

    async def _finish(self) -> None:
        await self.runner.close()

    async def _work(self) -> None:
        await self.runner.start()
        B = self.admission.groups_per_update
        env = self.source.envs["train"].envs[0]
        groups: list[asyncio.Task[None]] = []

        async def group(k: int, update: int, task_index: int) -> None:
            eps = await self.runner.run([env.tasks[task_index]] * self.G, env.verifier,
                                        [mix_seed(self._seed_base, k * self.G + i) for i in range(self.G)])
            self._put(update, k % B, eps)

        for k in range((self.first_update - 1) * B, self.last_update * B):
            update = self.admission.update_of(k)
            while not self.admission.allows(k, self.store.version):
                await asyncio.sleep(0.01)  # the bound: wait for the learner's next version
            self.admission.admit(k, self.store.version)
            groups.append(asyncio.ensure_future(group(k, update, self.prompts_for(update)[k % B])))
            await asyncio.sleep(0)
        await asyncio.gather(*groups)

    def _parts(self, update: int) -> int:
        return self.admission.groups_per_update

    def _batch(self, update: int, parts: dict[int, AgentEpisodes]) -> AsyncBatch:
        """Every group of `update`, rows in data order; `episodes` says which episode each row is (segments)."""
        first = parts[0]
        eps = type(first).concat([parts[b] for b in range(self.admission.groups_per_update)])
        self.source.account("train", eps.stats)
        tokens = sum(sum(r.loss_mask or []) for r in eps.trajectories)
        self.times.generate = self.front.stats.gen_seconds
        self.times.wall = time.perf_counter() - self._t0
        episodes = self.source.rollouts("train", eps, RolloutStats(gen_tokens=tokens))
        return AsyncBatch(update, episodes.trajectories, tokens, episodes)
