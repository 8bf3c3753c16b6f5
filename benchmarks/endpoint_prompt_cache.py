"""What the endpoint's prompt cache saves (issue 42): the cost of a new session's first request in the handler's
matching step (`Session.prepare`: render the conversation, tokenise it), with the system + tools block
tokenised once per key (`PromptCache`) vs the whole prompt tokenised every time (the baseline, the same code
with no cache), interleaved in the same run.

    python benchmarks/endpoint_prompt_cache.py [--sessions 2000] [--rounds 5] [--tokenizer tiny|qwen3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rlf_envs.env.tokens import TokenizerAdapter
from rlf_envs.formats import Qwen3Format
from rlf_envs.formats.chat import ChatCodec, ChatMessage
from rlf_train.config import ModelConfig, TinyModelConfig
from rlf_train.policy.tokenizer import load_tokenizer
from rlf_train.rollout.endpoint.sessions import EndpointLimits, PromptCache, Session, tools_key

TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the encyclopedia for a "
          "query; returns the top passages.", "parameters": {"type": "object", "properties": {
              "query": {"type": "string", "description": "what to look up"}}, "required": ["query"]}}}]
SYSTEM = "You are a careful researcher. Search before you answer; answer in <answer></answer> tags."


def per_call_us(codec: ChatCodec, encode: Any, cache: PromptCache | None, n: int, start: int) -> float:
    limits = EndpointLimits(max_total_tokens=1 << 16, max_new_tokens=8, timeout_s=600)
    tkey = tools_key(TOOLS)
    t0 = time.perf_counter()
    for k in range(start, start + n):
        s = Session(f"b{k}", codec, encode, limits, prompts=cache)
        msgs = (ChatMessage("system", SYSTEM), ChatMessage("user", f"What is the capital of country number {k}?"))
        s.prepare(msgs, TOOLS, tkey, None)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokenizer", choices=["tiny", "qwen3"], default="tiny")
    args = ap.parse_args()
    if args.tokenizer == "qwen3":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from agent_support import qwen3_tokenizer

        tok = qwen3_tokenizer()
    else:
        tok = load_tokenizer(ModelConfig(tiny=TinyModelConfig(tokenizer_file="quickstart_tokenizer.json")))
    codec = ChatCodec(Qwen3Format())
    encode = TokenizerAdapter.shared(tok).encode
    cache = PromptCache(codec, encode)
    per_call_us(codec, encode, cache, 50, 0)  # warm-up (and the cache's one miss)
    per_call_us(codec, encode, None, 50, 0)
    base, cached = [], []
    for r in range(args.rounds):  # interleaved, so a load change hits both
        base.append(per_call_us(codec, encode, None, args.sessions, r * args.sessions))
        cached.append(per_call_us(codec, encode, cache, args.sessions, r * args.sessions))
    b, c = statistics.median(base), statistics.median(cached)
    print(f"new session's first request, render + tokenise ({args.tokenizer} tokenizer; {os.cpu_count()} cpus, "
          f"load {os.getloadavg()[0]:.1f}; median of {args.rounds} rounds x {args.sessions} sessions)")
    print(f"{'whole prompt (baseline)':<28} {b:8.1f} us/call")
    print(f"{'system+tools cached':<28} {c:8.1f} us/call   {b / c:5.2f}x faster, {b - c:6.1f} us saved per call")


if __name__ == "__main__":
    main()
