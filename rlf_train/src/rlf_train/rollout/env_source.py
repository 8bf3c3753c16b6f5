"""The env source: env-driven episodes, the default way a run gets them. The configured engine generates (rlf's
local sampler, or a `vllm.LLM` given the current weights before every rollout: `rollout.engine`) and the env steps,
through the token-episode driver (`rlf_train.rollout.batch.drive_episodes`). With `rollout.mode: async` its worker
(`AsyncRollout`, in the trainer's process, or `ProcessRollout`, a process of its own) generates ahead of the learner.
"""

from __future__ import annotations

import asyncio
import copy
import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlf_envs.env.episodes import GenerateBatchFn, obs_ids
from rlf_envs.env.vector import ToolVectorEnv
from rlf_envs.types import Trajectory
from rlf_train.config import TrainConfig
from rlf_train.policy.load import load_policy
from rlf_train.policy.tokenizer import load_tokenizer
from rlf_train.rollout.async_worker import (
    Admission,
    AsyncBatch,
    AsyncPlan,
    AsyncWorker,
    RolloutWorker,
    WorkerTimes,
    frozen_copy,
)
from rlf_train.rollout.batch import Rollouts, RolloutStats, SamplingParams
from rlf_train.rollout.env_factory import Stage, make_envs
from rlf_train.rollout.local import StopChecker, generate_batched, local_generate_batch, rollout
from rlf_train.rollout.seeds import sampler_seed, seed_base
from rlf_train.rollout.vllm import VllmRollout
from rlf_train.rollout.weights import SharedWeights, WeightStore


class EnvSource:
    """Where a run's episodes come from by default: the env steps, the configured engine generates (a `Source`,
    `rlf_train.rollout.source`). `model()` is the current policy and `version()` its version (the vLLM engine
    reloads its weights when the version moved on). The agent source generates through it too (`generate_batch`)."""

    def __init__(self, cfg: TrainConfig, tokenizer: Any, envs: dict[Stage, ToolVectorEnv], run_dir: Path,
                 model: Callable[[], torch.nn.Module], version: Callable[[], int]) -> None:
        self.cfg, self.tokenizer, self.envs, self.run_dir = cfg, tokenizer, envs, run_dir
        self.model, self.version = model, version
        self.vllm: VllmRollout | None = None

    def collect(self, stage: Stage, task_indices: Sequence[int], params: SamplingParams, seed_base: int,
                gen: torch.Generator | None) -> Rollouts:
        """The episodes of `task_indices` (of `stage`'s split) as GRPO rows, one per episode (`rollouts`)."""
        trajs, stats = self.rollouts(self.envs[stage], task_indices, params, seed_base, gen)
        metrics = {}
        if self.vllm is not None and self.vllm.last_sync_probe is not None:  # the last weight sync's check
            metrics = {"vllm_sync_probe": self.vllm.last_sync_probe, "vllm_sync_probes": float(self.vllm.sync_probes)}
        return Rollouts(trajs, list(range(len(trajs))), stats, metrics)

    def vllm_engine(self) -> VllmRollout:
        """rollout.engine vllm: built at the first rollout, given the current weights on every call."""
        r = self.cfg.rollout
        if self.vllm is None:
            self.vllm = VllmRollout(self.model(), self.tokenizer, self.run_dir / "vllm", version=self.version(),
                                    seed=self.cfg.seed, max_model_len=r.max_total_tokens,
                                    gpu_memory_utilization=r.vllm_gpu_memory_utilization, timeout_s=r.vllm_timeout_s)
        self.vllm.sync(self.model(), self.version())
        return self.vllm

    def generate_batch(self, params: SamplingParams, gen: torch.Generator | None,
                       stop_strings: Sequence[str]) -> GenerateBatchFn:
        """The configured engine, with these sampling settings, recording each token's log-prob."""
        if self.cfg.rollout.engine == "vllm":
            return self.vllm_engine().generate_batch(params, gen)
        return local_generate_batch(self.model(), self.tokenizer, params, stop_strings,
                                    batch_size=self.cfg.rollout.batch_size, gen=gen, logprobs=True)

    def rollouts(self, venv: ToolVectorEnv, task_indices: Sequence[int], params: SamplingParams,
                 seed_base: int, gen: torch.Generator | None) -> tuple[list[Trajectory], RolloutStats]:
        """One episode on each of the first len(task_indices) envs of `venv` (env i on task_indices[i])."""
        seeds = [seed_base + i for i in range(len(task_indices))]
        if self.cfg.rollout.engine == "vllm":
            trajs, stats = self.vllm_engine().rollout(venv, task_indices, params, seeds, gen)
        else:
            trajs, stats = rollout(venv, task_indices, self.model(), self.tokenizer, params, seeds=seeds,
                                   batch_size=self.cfg.rollout.batch_size, gen=gen)
        return [copy.copy(t) for t in trajs], stats

    def async_worker(self, plan: AsyncPlan) -> RolloutWorker:
        """The env worker for `rollout.mode: async`: on rlf's loop with a frozen copy of the policy
        (`rollout.async_worker: thread`), or in a process of its own that rebuilds envs and policy from the config
        (`process`)."""
        cfg, r = self.cfg, self.cfg.rollout
        if r.async_worker == "process":
            import torch.multiprocessing as tmp

            ctx = tmp.get_context("spawn")
            shared = SharedWeights(plan.model, ctx, slots=plan.keep)
            spec = WorkerSpec(cfg.model_dump(mode="json"), plan.prompts, plan.first_update, plan.last_update,
                              plan.env_hook)
            return ProcessRollout(spec, shared, plan.admission, ctx)
        store = WeightStore(keep=plan.keep)
        return AsyncRollout(
            self.envs["train"], frozen_copy(plan.model), self.tokenizer, plan.params, store=store,
            admission=plan.admission, prompts_for=plan.prompts.__getitem__,
            seed_for=lambda u, row: seed_base(cfg.seed, u) + row,
            gen_seed_for=lambda u: sampler_seed(cfg.seed, u),
            group_size=plan.group_size, first_update=plan.first_update, last_update=plan.last_update,
            batch_size=plan.batch_size, gen=plan.gen, partial_rollouts=r.partial_rollouts,
            schedule=r.async_schedule)

    def eval_metrics(self) -> dict[str, float]:
        """Nothing beyond the episodes' own statistics."""
        return {}

    def summary(self) -> str | None:
        return None

    def close(self) -> None:
        """Shut rollout.engine vllm's engine down (no-op otherwise)."""
        if self.vllm is not None:
            self.vllm.close()
            self.vllm = None


@dataclass
class _Episode:
    group: int
    row: int  # position in its update's batch
    slot: int  # env index
    context: list[int]


class AsyncRollout(AsyncWorker):
    """The env worker of `rollout.mode: async` (`rollout.async_worker: thread`): env-driven episodes generated ahead
    of the learner, with its own copy of the policy, on rlf's loop (torch ops release the GIL, so generating and
    updating overlap on two cores). Episodes of different groups are in flight at once and each env steps on its
    own (one slow tool holds only its episode); every generation call batches all episodes that are ready. Partial
    rollouts: weights are refreshed before every generation call, so an episode in flight at an update continues
    with the new weights; each turn records the version and the behaviour log-probs it was sampled with
    (`Turn.policy_version`, `Turn.behaviour_logprobs`)."""

    def __init__(
        self,
        venv: ToolVectorEnv,
        model: torch.nn.Module,
        tokenizer: Any,
        params: SamplingParams,
        *,
        store: WeightStore | SharedWeights,
        admission: Admission,
        prompts_for: Callable[[int], Sequence[int]],
        seed_for: Callable[[int, int], int],
        group_size: int,
        first_update: int,
        last_update: int,
        batch_size: int,
        gen: torch.Generator | None,
        gen_seed_for: Callable[[int], int] | None = None,
        partial_rollouts: bool = True,
        schedule: str = "free",
    ) -> None:
        """`prompts_for(u)` gives update u's task indices (one per group, called in increasing u, from the
        worker's thread); `seed_for(u, row)` the env seed of a row; `gen_seed_for(u)`, if given, re-seeds `gen`
        when update u's first group starts (with max_staleness 0 nothing else is in flight then, so the run is
        reproducible and resumes exactly). Envs: venv.num_envs must be a multiple of `group_size` (a group
        starts when `group_size` envs are free). `partial_rollouts=False`: new weights are loaded only while no
        episode is in flight, so every episode is sampled by one version. `schedule="fixed"`: update u's whole
        batch is generated by weights version max(0, u - 1 - max_staleness) (the store must keep max_staleness + 1
        versions), updates one after another, every turn of the batch generated together as the synchronous
        rollout does: the batches are a function of the seed, whatever the timing (`_work_fixed`)."""
        if schedule not in ("free", "fixed"):
            raise ValueError(f"async schedule {schedule!r}: use 'free' or 'fixed'")
        if venv.num_envs % group_size:
            raise ValueError(f"{venv.num_envs} envs cannot hold whole groups of {group_size}")
        super().__init__(store, admission)
        self.venv, self.model, self.tokenizer, self.params = venv, model, tokenizer, params
        self.prompts_for, self.seed_for = prompts_for, seed_for
        self.G, self.first_update, self.last_update = group_size, first_update, last_update
        self.batch_size, self.gen, self.partial = batch_size, gen, partial_rollouts
        self.gen_seed_for = gen_seed_for
        self.schedule = schedule
        self.version = -1
        self._tokens: dict[int, int] = {}  # update -> tokens generated for it
        self._t_start = 0.0

    # ------------------------------------------------------------------ the batches (AsyncWorker)
    def _parts(self, update: int) -> int:
        return self.admission.groups_per_update * self.G  # rows: one finished trajectory each

    def _take(self, update: int) -> tuple[dict[int, Trajectory], int]:
        return self._done.pop(update), self._tokens.pop(update, 0)

    def _batch(self, update: int, parts: tuple[dict[int, Trajectory], int]) -> AsyncBatch:
        rows, tokens = parts
        return AsyncBatch(update, [rows[i] for i in range(self._parts(update))], tokens)

    # ------------------------------------------------------------------ worker (rlf's loop thread)
    def _refresh_weights(self) -> None:
        got = self.store.newer_than(self.version)
        if got is not None:
            self.version, state = got
            self.model.load_state_dict(state)

    async def _work(self) -> None:
        self._t_start = time.perf_counter()
        await (self._work_fixed() if self.schedule == "fixed" else self._work_free())

    async def _finish(self) -> None:
        self.times.wall = time.perf_counter() - self._t_start

    async def _work_free(self) -> None:
        """The free schedule: groups start whenever the bound and free envs allow, episodes finish in any order."""
        venv, G = self.venv, self.G
        B = self.admission.groups_per_update
        stop = StopChecker(self.tokenizer, list(venv.envs[0].format.stop_strings), self.tokenizer.eos_token_id)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.model.eval()
        free = list(range(venv.num_envs))
        next_group = (self.first_update - 1) * B
        end_group = self.last_update * B
        prompts: dict[int, Sequence[int]] = {}
        ready: list[_Episode] = []
        pending: dict[asyncio.Future[Any], tuple[_Episode, list[float], int]] = {}
        while not self._stop:
            if self.partial or not (pending or ready):
                self._refresh_weights()
            # admission: whole groups, in data order, while envs are free and the bound allows
            while next_group < end_group and len(free) >= G and self.admission.allows(next_group, self.version):
                u = self.admission.update_of(next_group)
                if u not in prompts:
                    prompts[u] = list(self.prompts_for(u))
                    prompts.pop(u - 2, None)
                    if self.gen_seed_for is not None and self.gen is not None:
                        self.gen.manual_seed(self.gen_seed_for(u))
                j = next_group % B
                slots, free = free[:G], free[G:]
                rows = [j * G + r for r in range(G)]
                resets = await venv.areset_envs({s: {"task_index": int(prompts[u][j])} for s in slots},
                                                seeds={s: self.seed_for(u, row) for s, row in zip(slots, rows,
                                                                                                  strict=True)})
                self.admission.admit(next_group, self.version)
                ready += [_Episode(next_group, row, s, obs_ids(resets[s][0])) for s, row in zip(slots, rows,
                                                                                                   strict=True)]
                next_group += 1
            if ready:
                if self.partial:
                    self._refresh_weights()
                t = time.perf_counter()
                lps: list[list[float]] = [[] for _ in ready]
                outs = generate_batched(self.model, [e.context for e in ready], self.params, stop, pad_id,
                                        self.gen, self.batch_size, lps)
                self.times.generate += time.perf_counter() - t
                for ep, out, lp in zip(ready, outs, lps, strict=True):
                    fut = asyncio.ensure_future(venv.astep_active({ep.slot: out}))
                    pending[fut] = (ep, lp, self.version)
                    u = self.admission.update_of(ep.group)
                    self._tokens[u] = self._tokens.get(u, 0) + len(out)
                    ep.context.extend(out)
                ready = []
            if not pending:
                if next_group >= end_group:
                    return
                await asyncio.sleep(0.002)  # waiting for weights (admission) or for the learner to take a batch
                continue
            # let the fast steps finish together (one generation batch for all of them), then go on with
            # what is done; a slow tool holds only its own episode
            done, _ = await asyncio.wait(list(pending), timeout=0.005)
            if not done:
                done, _ = await asyncio.wait(list(pending), timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                ep, lp, version = pending.pop(fut)
                res = fut.result()[ep.slot]
                traj = venv.envs[ep.slot].trajectory
                turn = traj.turns[-1]
                turn.policy_version = version
                turn.behaviour_logprobs = lp
                if res.done:
                    traj = copy.copy(traj)  # the env's next reset starts a new Trajectory; keep this one
                    free.append(ep.slot)
                    self._put(self.admission.update_of(ep.group), ep.row, traj)
                else:
                    ep.context.extend(obs_ids(res.obs))
                    ready.append(ep)

    def fixed_version(self, update: int) -> int:
        """The weights version that generates `update`'s batch under the fixed schedule."""
        return max(0, update - 1 - self.admission.max_staleness)

    async def _load_exact(self, version: int) -> bool:
        """Wait until `version` is published and load it (False: stopped while waiting)."""
        while not self._stop:
            newest = self.store.version  # read before get: if it is >= version and get fails, version is gone
            state = self.store.get(version)
            if state is not None:
                if self.version != version:
                    self.model.load_state_dict(state)
                    self.version = version
                return True
            if newest >= version:
                raise RuntimeError(f"weights version {version} is no longer held (newest {newest}): the weight "
                                   "store keeps too few versions for the fixed schedule")
            await asyncio.sleep(0.002)
        return False

    async def _work_fixed(self) -> None:
        """The fixed schedule: for u = first_update..last_update, load version `fixed_version(u)`, re-seed the
        sampler, start all of u's groups, and run them turn by turn (each generation call holds every episode
        still running, each turn's env steps all awaited): no timing reaches the batch. The learner overlaps
        it: while it updates on batch u - 1 the worker already generates batch u with older weights."""
        venv, G, B = self.venv, self.G, self.admission.groups_per_update
        if venv.num_envs < B * G:
            raise ValueError(f"the fixed schedule runs a whole update at once: {venv.num_envs} envs for {B * G} "
                             "episodes")
        stop = StopChecker(self.tokenizer, list(venv.envs[0].format.stop_strings), self.tokenizer.eos_token_id)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.model.eval()
        for u in range(self.first_update, self.last_update + 1):
            if not await self._load_exact(self.fixed_version(u)):
                return
            if self.gen_seed_for is not None and self.gen is not None:
                self.gen.manual_seed(self.gen_seed_for(u))
            prompts = list(self.prompts_for(u))
            rows = range(B * G)
            resets = await venv.areset_envs({row: {"task_index": int(prompts[row // G])} for row in rows},
                                            seeds={row: self.seed_for(u, row) for row in rows})
            for j in range(B):
                self.admission.admit((u - 1) * B + j, self.version)
            active = [_Episode((u - 1) * B + row // G, row, row, obs_ids(resets[row][0])) for row in rows]
            done: dict[int, Trajectory] = {}
            while active:
                if self._stop:
                    return
                t = time.perf_counter()
                lps: list[list[float]] = [[] for _ in active]
                outs = generate_batched(self.model, [e.context for e in active], self.params, stop, pad_id,
                                        self.gen, self.batch_size, lps)
                self.times.generate += time.perf_counter() - t
                self._tokens[u] = self._tokens.get(u, 0) + sum(len(o) for o in outs)
                results = await asyncio.gather(*(venv.astep_active({e.slot: out}) for e, out in
                                                 zip(active, outs, strict=True)))
                still = []
                for ep, out, lp, res in zip(active, outs, lps, results, strict=True):
                    traj = venv.envs[ep.slot].trajectory
                    traj.turns[-1].policy_version = self.version
                    traj.turns[-1].behaviour_logprobs = lp
                    ep.context.extend(out)
                    if res[ep.slot].done:
                        done[ep.row] = copy.copy(traj)
                    else:
                        ep.context.extend(obs_ids(res[ep.slot].obs))
                        still.append(ep)
                active = still
            with self._cond:
                self._done[u] = done
                self._cond.notify_all()


@dataclass(frozen=True)
class WorkerSpec:
    """What the worker process needs to rebuild the rollout side (picklable)."""

    config: dict[str, Any]  # TrainConfig.model_dump(mode="json")
    prompts: dict[int, list[int]]  # update -> its task indices
    first_update: int
    last_update: int
    env_hook: Callable[[ToolVectorEnv], None] | None = None  # applied to the worker's envs (benchmarks)


def _process_main(spec: WorkerSpec, store: SharedWeights, out: Any, stop: Any) -> None:
    """The worker process: rebuild envs and policy from the config, run `AsyncRollout`, send each finished
    update's batch (with the admission events and generation time so far) to the learner."""
    parent = os.getppid()
    try:
        cfg = TrainConfig.model_validate(spec.config)
        r = cfg.rollout
        torch.set_num_threads(cfg.threads or 1)
        tok = load_tokenizer(cfg.model)
        venv = make_envs(cfg, tok, "train", r.prompts_per_step * r.samples_per_prompt)
        if spec.env_hook is not None:
            spec.env_hook(venv)
        model = load_policy(cfg.model, tok, cfg.seed)
        for p in model.parameters():
            p.requires_grad_(False)
        admission = Admission(r.prompts_per_step, r.max_staleness)
        worker = AsyncRollout(
            venv, model, tok, SamplingParams(r.temperature, r.top_p, r.max_new_tokens_per_turn), store=store,
            admission=admission, prompts_for=spec.prompts.__getitem__,
            seed_for=lambda u, row: seed_base(cfg.seed, u) + row,
            gen_seed_for=lambda u: sampler_seed(cfg.seed, u), group_size=r.samples_per_prompt,
            first_update=spec.first_update, last_update=spec.last_update, batch_size=r.batch_size,
            gen=torch.Generator(), partial_rollouts=r.partial_rollouts, schedule=r.async_schedule)
        worker.start()
        sent = 0
        try:
            for u in range(spec.first_update, spec.last_update + 1):
                while True:
                    if stop.is_set() or os.getppid() != parent:  # stopped, or the trainer was killed
                        return
                    try:
                        batch = worker.next_batch(u, timeout=0.5)
                        break
                    except TimeoutError:
                        continue
                events = admission.events[sent:]
                sent += len(events)
                out.put(("batch", u, batch.trajectories, batch.gen_tokens, worker.times.generate, events))
        finally:
            worker.stop()
    except BaseException:
        out.put(("error", traceback.format_exc()))


class ProcessRollout:
    """Learner-side handle of the worker process; the same start / next_batch / stop / times / admission
    as `AsyncRollout`."""

    def __init__(self, spec: WorkerSpec, store: SharedWeights, admission: Admission, ctx: Any) -> None:
        self.spec, self.store, self.admission, self.ctx = spec, store, admission, ctx
        self.times = WorkerTimes()
        self._out = ctx.Queue()
        self._stop = ctx.Event()
        self._proc: Any = None
        self._ready: dict[int, AsyncBatch] = {}
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._proc = self.ctx.Process(target=_process_main, args=(self.spec, self.store, self._out, self._stop),
                                      daemon=True, name="rlf-rollout")
        self._proc.start()

    def next_batch(self, update: int, timeout: float = 3600.0) -> AsyncBatch:
        deadline = time.monotonic() + timeout
        while update not in self._ready:
            if time.monotonic() > deadline:
                raise TimeoutError(f"update {update}'s rollouts not done after {timeout:.0f} s")
            try:
                msg = self._out.get(timeout=0.5)
            except queue.Empty:
                if self._proc is None or not self._proc.is_alive():
                    code = None if self._proc is None else self._proc.exitcode
                    raise RuntimeError(f"the async rollout worker process died (exit code {code})") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"the async rollout worker failed:\n{msg[1]}")
            _, u, trajs, tokens, gen_seconds, events = msg
            self._ready[u] = AsyncBatch(u, trajs, tokens)
            self.times.generate = gen_seconds
            self.admission.events.extend(events)
        self.times.wall = time.perf_counter() - self._t0
        return self._ready.pop(update)

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            while True:  # drain, so the child's queue feeder can exit
                self._out.get_nowait()
        except (queue.Empty, OSError, ValueError):
            pass
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
