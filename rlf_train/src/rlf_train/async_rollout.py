"""Asynchronous rollouts for the local backend (`rollout.mode: async`, docs/guides/async-rl.md).

Three pieces, each usable on its own:

- `WeightStore`: the learner publishes versioned weights (a CPU copy of the state dict, version = number
  of updates done); the rollout side picks up the newest between turns. Nothing in it assumes the two
  sides share a device or a process: on a GPU box the rollout model may live on another device (the copy
  is loaded with `load_state_dict`), and a process boundary only has to carry (version, state dict).
- `Admission`: the staleness bound. Group k (the k-th GRPO group of the run, in data order) belongs to
  update u(k) = k // groups_per_update + 1, which trains starting from weights version u(k) - 1. A group
  may start only when the rollout's weights version v satisfies v >= u(k) - 1 - max_staleness; versions
  only grow while an episode runs, so no token of it is more than max_staleness versions behind the policy
  that trains on it. Nothing is ever discarded: work that would be too stale is never started.
- `AsyncRollout`: the worker. It runs on rlf's event-loop thread (where the tools live), generating with
  its own copy of the policy while the learner (the caller's thread) updates; torch ops release the GIL,
  so the two overlap on two cores. Episodes of different groups are in flight at once and each env steps
  on its own (one slow tool holds only its episode); every generation call batches all episodes that
  are ready. Partial rollouts: weights are refreshed before every generation call, so an episode in flight
  at an update continues with the new weights; each turn records the version and the behaviour log-probs
  it was sampled with (`Turn.policy_version`, `Turn.behaviour_logprobs`).

`SharedWeights` and `ProcessRollout` carry the same worker over a process boundary (`rollout.async_worker:
process`): the worker process builds its own envs and policy copy from the config, the learner publishes
into shared-memory tensors, finished batches come back over a queue. Threads share one GIL, and a tiny
policy's generation is mostly Python overhead, so on CPU the two sides contend for it; processes do not.
This is also the shape of "rollout on one device, learner on another".
"""

from __future__ import annotations

import asyncio
import copy
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlf_envs import runtime
from rlf_envs.env.episodes import obs_ids
from rlf_envs.env.vector import ToolVectorEnv
from rlf_envs.types import Trajectory
from rlf_train.rollout import SamplingParams, StopChecker, generate_batched


class WeightStore:
    """Versioned weights from the learner to the rollout side (thread-safe)."""

    def __init__(self, keep: int = 1) -> None:
        """`keep`: how many of the newest versions stay retrievable by `get` (the fixed schedule needs
        max_staleness + 1)."""
        self._cond = threading.Condition()
        self._version = -1
        self._state: dict[str, torch.Tensor] | None = None
        self._keep = keep
        self._history: dict[int, dict[str, torch.Tensor]] = {}

    def publish(self, version: int, model: torch.nn.Module) -> None:
        """Publish `model`'s weights as `version` (a CPU copy: the learner may go on updating in place)."""
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        with self._cond:
            if version <= self._version:
                raise ValueError(f"weights version {version} published after version {self._version}: "
                                 "versions must grow")
            self._version, self._state = version, state
            self._history[version] = state
            for old in [v for v in self._history if v <= version - self._keep]:
                del self._history[old]
            self._cond.notify_all()

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    def newer_than(self, version: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest (version, state dict) if newer than `version`, else None."""
        with self._cond:
            if self._version > version and self._state is not None:
                return self._version, self._state
            return None

    def get(self, version: int) -> dict[str, torch.Tensor] | None:
        """Exactly `version`'s state dict, if it is one of the `keep` newest published; else None."""
        with self._cond:
            return self._history.get(version)


@dataclass(frozen=True)
class AdmissionEvent:
    group: int  # k: the group's index in the run's data order
    update: int  # u(k): the update that trains on it
    version: int  # the rollout's weights version when it started


@dataclass
class Admission:
    """The staleness bound as admission control (see the module docstring). `events` logs every start."""

    groups_per_update: int
    max_staleness: int
    events: list[AdmissionEvent] = field(default_factory=list)

    def update_of(self, group: int) -> int:
        return group // self.groups_per_update + 1

    def allows(self, group: int, version: int) -> bool:
        return version >= self.update_of(group) - 1 - self.max_staleness

    def admit(self, group: int, version: int) -> None:
        if not self.allows(group, version):
            raise RuntimeError(f"admission: group {group} (update {self.update_of(group)}) may not start at "
                               f"weights version {version} with max_staleness {self.max_staleness}")
        self.events.append(AdmissionEvent(group, self.update_of(group), version))


@dataclass
class AsyncBatch:
    """The finished groups of one update, rows in data order (G samples of a prompt contiguous)."""

    update: int
    trajectories: list[Trajectory]
    gen_tokens: int
    episodes: Any = None  # rlf_train.rollout.Rollouts when rows are agent segments (rlf_train.agent.AgentWorker)


@dataclass
class WorkerTimes:
    """Where the rollout worker's wall time went (seconds since `start`)."""

    generate: float = 0.0  # generating (the worker's busy time)
    wall: float = 0.0


@dataclass
class _Episode:
    group: int
    row: int  # position in its update's batch
    slot: int  # env index
    context: list[int]


class AsyncRollout:
    """The rollout worker: start(), then next_batch(u) for u = first_update, first_update + 1, ...; stop()."""

    def __init__(
        self,
        venv: ToolVectorEnv,
        model: torch.nn.Module,
        tokenizer: Any,
        params: SamplingParams,
        *,
        store: WeightStore,
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
        self.venv, self.model, self.tokenizer, self.params = venv, model, tokenizer, params
        self.store, self.admission = store, admission
        self.prompts_for, self.seed_for = prompts_for, seed_for
        self.G, self.first_update, self.last_update = group_size, first_update, last_update
        self.batch_size, self.gen, self.partial = batch_size, gen, partial_rollouts
        self.gen_seed_for = gen_seed_for
        self.schedule = schedule
        self.version = -1
        self.times = WorkerTimes()
        self._cond = threading.Condition()
        self._done: dict[int, dict[int, Trajectory]] = {}  # update -> row -> finished trajectory
        self._tokens: dict[int, int] = {}
        self._error: BaseException | None = None
        self._stop = False
        self._future: Any = None

    # ------------------------------------------------------------------ learner side
    def start(self) -> None:
        self._future = asyncio.run_coroutine_threadsafe(self._main(), runtime.get_loop())

    def next_batch(self, update: int, timeout: float = 3600.0) -> AsyncBatch:
        """Wait until every group of `update` has finished; a worker error is raised here."""
        need = self.admission.groups_per_update * self.G
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._done.get(update, {})) < need:
                if self._error is not None:
                    raise RuntimeError(f"the async rollout worker failed: {self._error!r}") from self._error
                if self._future is not None and self._future.done() and self._error is None:
                    raise RuntimeError(f"the async rollout worker stopped before update {update}'s batch was done")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"update {update}'s rollouts not done after {timeout:.0f} s")
                self._cond.wait(min(left, 0.5))
            rows = self._done.pop(update)
            tokens = self._tokens.pop(update, 0)
        return AsyncBatch(update, [rows[i] for i in range(need)], tokens)

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the worker (episodes in flight are abandoned: a resumed run starts them again)."""
        self._stop = True
        fut, self._future = self._future, None
        if fut is not None:
            try:
                fut.result(timeout)
            except BaseException:
                fut.cancel()

    # ------------------------------------------------------------------ worker (rlf's loop thread)
    def _refresh_weights(self) -> None:
        got = self.store.newer_than(self.version)
        if got is not None:
            self.version, state = got
            self.model.load_state_dict(state)

    async def _main(self) -> None:
        t_start = time.perf_counter()
        try:
            await (self._work_fixed() if self.schedule == "fixed" else self._work())
        except BaseException as e:
            with self._cond:
                self._error = e
                self._cond.notify_all()
            raise
        finally:
            self.times.wall = time.perf_counter() - t_start
            with self._cond:
                self._cond.notify_all()

    async def _work(self) -> None:
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
                    u = self.admission.update_of(ep.group)
                    with self._cond:
                        self._done.setdefault(u, {})[ep.row] = traj
                        self._cond.notify_all()
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


class SharedWeights:
    """A `WeightStore` across processes: the state dicts live in shared memory (`slots` of them: version v in
    slot v % slots, so the `slots` newest versions stay retrievable by `get`), the newest version in a shared
    counter whose lock also guards the tensors. Hand it to the worker process as a `Process` argument."""

    def __init__(self, model: torch.nn.Module, ctx: Any, slots: int = 1) -> None:
        self.slots = [{k: v.detach().to("cpu", copy=True).share_memory_() for k, v in model.state_dict().items()}
                      for _ in range(slots)]
        self._slot_version = ctx.Array("q", [-1] * slots, lock=False)
        self._version = ctx.Value("q", -1)

    def publish(self, version: int, model: torch.nn.Module) -> None:
        with self._version.get_lock():
            if version <= self._version.value:
                raise ValueError(f"weights version {version} published after version {self._version.value}: "
                                 "versions must grow")
            i = version % len(self.slots)
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    self.slots[i][k].copy_(v.detach())
            self._slot_version[i] = version
            self._version.value = version

    @property
    def version(self) -> int:
        return int(self._version.value)

    def newer_than(self, version: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        with self._version.get_lock():
            v = int(self._version.value)
            if v > version:
                return v, {k: t.clone() for k, t in self.slots[v % len(self.slots)].items()}
        return None

    def get(self, version: int) -> dict[str, torch.Tensor] | None:
        with self._version.get_lock():
            i = version % len(self.slots)
            if version >= 0 and self._slot_version[i] == version:
                return {k: t.clone() for k, t in self.slots[i].items()}
        return None


@dataclass(frozen=True)
class WorkerSpec:
    """What the worker process needs to rebuild the rollout side (picklable)."""

    config: dict[str, Any]  # TrainConfig.model_dump(mode="json")
    prompts: dict[int, list[int]]  # update -> its task indices
    first_update: int
    last_update: int
    env_hook: Callable[[ToolVectorEnv], None] | None = None  # applied to the worker's envs (benchmarks)


def seed_base(seed: int, update: int) -> int:
    """The env seed of row 0 of `update`'s batch (sync and async runs alike)."""
    return (seed * 1_000_003 + update * 10_007) % (2**31)


def sampler_seed(seed: int, update: int) -> int:
    """The async worker's sampler seed when `update`'s first group starts."""
    return seed_base(seed, update) + 7_919


def _process_main(spec: WorkerSpec, store: SharedWeights, out: Any, stop: Any) -> None:
    """The worker process: rebuild envs and policy from the config, run `AsyncRollout`, send each finished
    update's batch (with the admission events and generation time so far) to the learner."""
    parent = os.getppid()
    try:
        from rlf_train.config import TrainConfig
        from rlf_train.envs import make_envs
        from rlf_train.policy.load import load_policy
        from rlf_train.policy.tokenizer import load_tokenizer

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
