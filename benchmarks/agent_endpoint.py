"""What the policy endpoint costs: per-call latency through the real `openai` SDK over loopback vs calling the
same engine directly, and completions per second with 16 / 64 / 256 concurrent agent sessions.

    python benchmarks/agent_endpoint.py [--calls 300] [--sessions 16 64 256] [--turns 3] [--json out/x.json]

Two engines, each measured directly (its `GenerateBatchFn` awaited in this process) and through the endpoint:
- `null`: returns a fixed 8-token reply at once: what is left is the endpoint's own cost (HTTP, JSON, the
  SDK's request/response models, session matching, tokenising the tail, the batcher);
- `tiny`: rlf's local sampler on the quickstart-shaped policy (0.5M parameters, random weights, 8 new
  tokens): an engine whose time matters, batched as the trainer batches it.

Latency: one session at a time, each call a fresh one-turn conversation, from the official `openai` SDK (what
agents run) and from a bare aiohttp client (the endpoint's own share); overhead = that - direct at the same
percentile. Throughput: N sessions at once, each a --turns-call conversation whose calls extend the
previous one (tool results appended), vs the direct engine given the same N contexts per round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import torch

from rlf_envs import runtime
from rlf_envs.env.episodes import Generation
from rlf_envs.env.tokens import TokenizerAdapter
from rlf_envs.formats import Qwen3Format
from rlf_envs.formats.chat import ChatCodec
from rlf_train.config import ModelConfig, TinyModelConfig
from rlf_train.policy.load import load_policy
from rlf_train.policy.tokenizer import load_tokenizer
from rlf_train.rollout.batch import SamplingParams
from rlf_train.rollout.endpoint.engine import EngineFront
from rlf_train.rollout.endpoint.server import ChatRequest, PolicyServer, to_messages
from rlf_train.rollout.endpoint.sessions import EndpointLimits, Session
from rlf_train.rollout.local import local_generate_batch

TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search.", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
NEW_TOKENS = 8


def engines(tok: Any) -> dict[str, Any]:
    adapter = TokenizerAdapter.shared(tok)
    reply = adapter.encode("<answer>Vell is it</answer><|im_end|>")[:NEW_TOKENS]

    async def null(contexts: list[list[int]], max_tokens: list[int], stop: list[str]) -> list[Generation]:
        return [Generation(reply[:m], [0.0] * len(reply[:m]), "stop") for m in max_tokens]

    cfg = ModelConfig(tiny=TinyModelConfig(hidden_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                                           intermediate_size=256, tokenizer_file="quickstart_tokenizer.json"))
    model = load_policy(cfg, tok, seed=0).eval()
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS)
    tiny = local_generate_batch(model, tok, params, ["<|im_end|>"], batch_size=256,
                                gen=torch.Generator().manual_seed(0), logprobs=True)
    return {"null": null, "tiny": tiny}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Bench:
    def __init__(self, tok: Any, engine: Any) -> None:
        self.codec = ChatCodec(Qwen3Format())
        self.adapter = TokenizerAdapter.shared(tok)
        self.engine = engine
        self.front = EngineFront(engine, self.codec.stop_strings)
        self.server = PolicyServer(self.front, self.adapter.decode)
        self.limits = EndpointLimits(max_total_tokens=4096, max_new_tokens=NEW_TOKENS, timeout_s=600)
        self.n = 0

    def session(self) -> Session:
        self.n += 1
        s = Session(f"b{self.n}", self.codec, self.adapter.encode, self.limits)
        self.server.sessions.add(s)
        return s

    def prompt(self, k: int) -> list[dict[str, Any]]:
        return [{"role": "user", "content": f"What is the capital of country number {k}?"}]

    async def direct_latency(self, calls: int) -> list[float]:
        out = []
        for k in range(calls):
            ids = self.adapter.encode(self.codec.render(to_messages(ChatRequest(messages=self.prompt(k))), TOOLS))
            t0 = time.perf_counter()
            await self.engine([ids], [NEW_TOKENS], ["<|im_end|>"])
            out.append(time.perf_counter() - t0)
        return out

    async def endpoint_latency(self, http: httpx.AsyncClient, calls: int) -> list[float]:
        out = []
        for k in range(calls):
            s = self.session()
            c = openai.AsyncOpenAI(base_url=self.server.base_url(s), api_key=s.key, http_client=http, max_retries=0)
            t0 = time.perf_counter()
            await c.chat.completions.create(model="p", messages=self.prompt(k), tools=TOOLS)
            out.append(time.perf_counter() - t0)
            self.server.sessions.remove(s)
        return out

    async def raw_latency(self, http: aiohttp.ClientSession, calls: int) -> list[float]:
        """The same calls from a bare HTTP client: the endpoint's own share, without the SDK's."""
        out = []
        for k in range(calls):
            s = self.session()
            t0 = time.perf_counter()
            async with http.post(f"{self.server.base_url(s)}/chat/completions",
                                 json={"model": "p", "messages": self.prompt(k), "tools": TOOLS}) as r:
                assert r.status == 200
                await r.json()
            out.append(time.perf_counter() - t0)
            self.server.sessions.remove(s)
        return out

    async def endpoint_rate(self, http: httpx.AsyncClient | aiohttp.ClientSession, sessions: int, turns: int
                            ) -> float:
        """`sessions` agents at once, `turns` calls each, from the openai SDK (an httpx client) or bare HTTP."""
        async def call(s: Session, messages: list[Any]) -> dict[str, Any]:
            if isinstance(http, aiohttp.ClientSession):
                async with http.post(f"{self.server.base_url(s)}/chat/completions",
                                     json={"model": "p", "messages": messages, "tools": TOOLS}) as r:
                    return dict((await r.json())["choices"][0]["message"])
            c = openai.AsyncOpenAI(base_url=self.server.base_url(s), api_key=s.key, http_client=http, max_retries=0)
            r = await c.chat.completions.create(model="p", messages=messages, tools=TOOLS)
            return r.choices[0].message.model_dump(exclude_none=True)

        async def one(k: int) -> None:
            s = self.session()
            messages: list[Any] = self.prompt(k)
            for t in range(turns):
                reply = await call(s, messages)
                messages = [*messages, {k: v for k, v in reply.items() if v is not None},
                            {"role": "user", "content": f"Result {t}: nothing found."}]
            assert len(s.segments) == 1, "every call extends the conversation: one segment"
            self.server.sessions.remove(s)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(k) for k in range(sessions)))
        return sessions * turns / (time.perf_counter() - t0)

    async def direct_rate(self, sessions: int, turns: int) -> float:
        ctx = [self.adapter.encode(self.codec.render(to_messages(ChatRequest(messages=self.prompt(k))), TOOLS))
               for k in range(sessions)]
        t0 = time.perf_counter()
        for t in range(turns):
            gens = await self.engine(ctx, [NEW_TOKENS] * sessions, ["<|im_end|>"])
            tail = self.adapter.encode(f"\n<|im_start|>user\nResult {t}: nothing found.<|im_end|>\n"
                                       "<|im_start|>assistant\n")
            ctx = [c + list(g.ids) + tail for c, g in zip(ctx, gens, strict=True)]
        return sessions * turns / (time.perf_counter() - t0)


async def measure(name: str, bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    await bench.server.start()
    # pools sized to the sessions, as the trainer's agent runner sizes its own (httpx scans its pool per request)
    n = max(args.sessions)
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=n, max_keepalive_connections=n), timeout=600)
    raw = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n))
    try:
        await bench.endpoint_latency(http, 20)  # warm-up: connections, caches
        await bench.raw_latency(raw, 20)
        await bench.direct_latency(20)
        lat_d, lat_e, lat_r = [], [], []
        for _ in range(3):  # interleaved, so a load change on the box hits all three
            lat_d += await bench.direct_latency(args.calls // 3)
            lat_e += await bench.endpoint_latency(http, args.calls // 3)
            lat_r += await bench.raw_latency(raw, args.calls // 3)
        row: dict[str, Any] = {"engine": name}
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            d, e, w = pct(lat_d, q) * 1e3, pct(lat_e, q) * 1e3, pct(lat_r, q) * 1e3
            row[f"direct_{label}_ms"], row[f"endpoint_{label}_ms"], row[f"overhead_{label}_ms"] = d, e, e - d
            row[f"raw_{label}_ms"], row[f"raw_overhead_{label}_ms"] = w, w - d
        row["rates"] = []
        for n in args.sessions:
            d, e, w = [], [], []
            for _ in range(2):  # interleaved
                d.append(await bench.direct_rate(n, args.turns))
                e.append(await bench.endpoint_rate(http, n, args.turns))
                w.append(await bench.endpoint_rate(raw, n, args.turns))
            dm, em, wm = statistics.median(d), statistics.median(e), statistics.median(w)
            row["rates"].append({"sessions": n, "direct_calls_s": dm, "endpoint_calls_s": em, "raw_calls_s": wm,
                                 "ratio": em / dm, "raw_ratio": wm / dm})
        return row
    finally:
        await raw.close()
        await http.aclose()
        await bench.server.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--sessions", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--engines", nargs="+", default=["null", "tiny"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = load_tokenizer(ModelConfig(tiny=TinyModelConfig(tokenizer_file="quickstart_tokenizer.json")))
    rows = []
    for name, engine in engines(tok).items():
        if name in args.engines:
            rows.append(runtime.run(measure(name, Bench(tok, engine), args)))
    load = os.getloadavg()[0]
    print(f"policy endpoint vs the same engine called directly ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus, load {load:.1f}; openai {openai.__version__}, {NEW_TOKENS} new tokens)")
    print(f"{'engine':<6} {'direct p50/p99 ms':>18} {'openai SDK p50/p99':>19} {'overhead p50/p99':>17} "
          f"{'bare HTTP p50/p99':>18} {'overhead p50/p99':>17}")
    for r in rows:
        print(f"{r['engine']:<6} {r['direct_p50_ms']:>8.2f} / {r['direct_p99_ms']:<7.2f} "
              f"{r['endpoint_p50_ms']:>8.2f} / {r['endpoint_p99_ms']:<8.2f} "
              f"{r['overhead_p50_ms']:>7.2f} / {r['overhead_p99_ms']:<7.2f} "
              f"{r['raw_p50_ms']:>8.2f} / {r['raw_p99_ms']:<7.2f} "
              f"{r['raw_overhead_p50_ms']:>7.2f} / {r['raw_overhead_p99_ms']:<7.2f}")
    print(f"\n{'engine':<6} {'sessions':>8} {'direct calls/s':>15} {'openai SDK calls/s':>19} {'ratio':>6} "
          f"{'bare HTTP calls/s':>18} {'ratio':>6}")
    for r in rows:
        for x in r["rates"]:
            print(f"{r['engine']:<6} {x['sessions']:>8} {x['direct_calls_s']:>15.0f} {x['endpoint_calls_s']:>19.0f} "
                  f"{x['ratio']:>6.2f} {x['raw_calls_s']:>18.0f} {x['raw_ratio']:>6.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"load": load, "python": sys.version.split()[0], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
