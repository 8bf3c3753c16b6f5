"""Full fine-tuning vs LoRA on one GPU: peak GPU memory and seconds per GRPO update at Qwen3-0.6B, 1.7B and 4B
shapes, bfloat16, gradient checkpointing on. One command, no network, no rlf import: only torch, transformers and
peft (the wheels a GPU image has, or a peft wheel carried along: `pip install --no-deps peft-*.whl`).

    python benchmarks/lora_gpu.py --json out/lora_gpu.json            # < 10 minutes on one H100

Each (shape, mode) runs in a fresh process (its own CUDA peak): the model is built from its config on the GPU
(random init, bf16, no download), then

- full: a frozen second copy as the KL reference, `torch.optim.AdamW` over every weight (bf16 states, no fp32
  master copy: a lower bound for mixed-precision full fine-tuning, which adds 4 bytes per parameter for masters);
- lora: peft LoRA (rank 16, alpha 32) on q/k/v/o/gate/up/down, the reference = the same model with its adapter
  switched off (`disable_adapter`, no copy), AdamW over the adapter only (fp32: peft's default for bf16 bases).

Each update is the local backend's: old and reference log-probs without grad, the policy's forward and backward
with the PPO-clip loss plus k3 KL (coefficient 0.05) on the policy tokens, grad-norm clip 1.0, optimizer step.
`torch.cuda.max_memory_allocated` after `--updates` updates is the peak; s/update is the median of all but the
first. An out-of-memory run is reported as OOM. Runs stop starting when `--budget-s` is spent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,  # a smoke test of the script
             "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def logprobs(model: Any, ids: Any, mask: Any) -> Any:
    """log p(token t+1) at the policy positions (the vocabulary projection on those positions only)."""
    import torch

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = inner.model(input_ids=ids[:, :-1]).last_hidden_state
    sel = mask.bool()
    logits = inner.get_output_embeddings()(hidden[sel]).float()
    lp = torch.zeros(mask.shape, device=ids.device)
    lp[sel] = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:][sel].unsqueeze(-1)).squeeze(-1)
    return lp


def one_run(shape: str, mode: str, batch: int, seq: int, policy_tokens: int, updates: int, device: str,
            dtype: str) -> dict[str, Any]:
    import contextlib
    import copy

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dt = getattr(torch, dtype)
    on_gpu = device.startswith("cuda")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=151936, head_dim=128 if shape != "tiny" else 16, max_position_embeddings=4096,
                      **SHAPES[shape])
    t0 = time.perf_counter()
    torch.set_default_dtype(dt)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    out: dict[str, Any] = {"shape": shape, "mode": mode, "params": sum(p.numel() for p in model.parameters()),
                           "build_s": time.perf_counter() - t0}
    if mode == "full":
        ref = copy.deepcopy(model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        policy = model

        def ref_ctx() -> Any:
            return contextlib.nullcontext(ref)
    else:
        from peft import LoraConfig, get_peft_model

        policy = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS,
                                                  task_type="CAUSAL_LM"))

        @contextlib.contextmanager
        def ref_ctx() -> Any:
            with policy.disable_adapter():
                yield policy
    params = [p for p in policy.parameters() if p.requires_grad]
    out["trainable_params"] = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-6)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)
    mask = torch.zeros(batch, seq - 1, device=device)
    mask[:, -policy_tokens:] = 1.0
    adv = torch.randn(batch, generator=g).to(device).unsqueeze(1)
    if on_gpu:
        torch.cuda.synchronize()
        out["mem_after_build_gib"] = torch.cuda.memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    times = []
    try:
        for _ in range(updates):
            t = time.perf_counter()
            with torch.no_grad():
                policy.eval()
                old = logprobs(policy, ids, mask)
                with ref_ctx() as r:
                    ref_lp = logprobs(r, ids, mask)
            policy.train()
            opt.zero_grad(set_to_none=True)
            lp = logprobs(policy, ids, mask)
            ratio = torch.exp(lp - old)
            pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
            kl = torch.exp(ref_lp - lp) - (ref_lp - lp) - 1.0
            loss = ((pg + 0.05 * kl) * mask).sum() / mask.sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            if on_gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    except torch.OutOfMemoryError as e:
        out["oom"] = str(e).splitlines()[0][:200]
    if on_gpu:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["device_name"] = torch.cuda.get_device_name()
    out["update_s"] = times
    if times:
        out["s_per_update"] = statistics.median(times[1:]) if len(times) > 1 else times[0]
    return out


def flag_args(kw: dict[str, Any]) -> list[str]:
    return [x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3-0.6b,qwen3-1.7b,qwen3-4b")
    ap.add_argument("--batch", type=int, default=8, help="sequences per update")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--policy-tokens", type=int, default=256, help="policy tokens per sequence (the loss mask)")
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget-s", type=float, default=540.0, help="start no run after this many seconds")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", nargs=2, metavar=("SHAPE", "MODE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    kw = dict(batch=a.batch, seq=a.seq, policy_tokens=a.policy_tokens, updates=a.updates, device=a.device,
              dtype=a.dtype)
    if a.child:
        print(json.dumps(one_run(a.child[0], a.child[1], **kw)))  # type: ignore[arg-type]
        return
    t_start = time.monotonic()
    runs: list[dict[str, Any]] = []
    for shape in a.shapes.split(","):
        for mode in ("lora", "full"):
            left = a.budget_s - (time.monotonic() - t_start)
            if left <= 0:
                runs.append({"shape": shape, "mode": mode, "skipped": "time budget spent"})
                continue
            argv = [sys.executable, __file__, "--child", shape, mode,
                    *flag_args(kw)]
            try:
                p = subprocess.run(argv, capture_output=True, text=True, timeout=max(left, 30))
                lines = p.stdout.strip().splitlines()
                r = json.loads(lines[-1]) if p.returncode == 0 and lines else \
                    {"shape": shape, "mode": mode, "error": p.stderr[-600:]}
            except subprocess.TimeoutExpired:
                r = {"shape": shape, "mode": mode, "error": "timed out (budget)"}
            runs.append(r)
            peak = f"{r['peak_gib']:.1f} GiB" if "peak_gib" in r else "-"
            spu = f"{r['s_per_update']:.2f} s" if "s_per_update" in r else "-"
            note = (r.get("oom") and "OOM") or r.get("error", "")[:120]
            print(f"{shape:11s} {mode:4s} params {r.get('params', 0) / 1e9:5.2f}B trainable "
                  f"{r.get('trainable_params', 0) / 1e6:9.1f}M peak {peak:>9s} {spu:>8s}/update {note}", flush=True)
            if a.json:
                a.json.parent.mkdir(parents=True, exist_ok=True)
                a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "runs": runs},
                                             indent=1))
    for shape in a.shapes.split(","):
        got = {r["mode"]: r for r in runs if r["shape"] == shape}
        if all("peak_gib" in got.get(m, {}) and "oom" not in got[m] for m in ("full", "lora")):
            print(f"{shape}: lora/full peak memory {got['lora']['peak_gib'] / got['full']['peak_gib']:.2f}x, "
                  f"s/update {got['lora']['s_per_update'] / got['full']['s_per_update']:.2f}x")


if __name__ == "__main__":
    main()
