"""What the endpoint, the agent worker and the LoRA reload promise, pinned so that broken variants fail
(issue 42, items 12, 14, 15):

- a stream ends with the chunk that carries `finish_reason`, then (when asked) the usage chunk with empty
  choices, then `[DONE]`; every other chunk carries `usage: null` when usage was asked for (OpenAI's shape);
- each generation is labelled with exactly the weights version that sampled it, while versions move on
  between batches;
- the token-exact extension uses the generated ids, also when they are not the canonical encoding of their text
  (a re-tokenising variant changes the ids without changing their length);
- every request waiting for the batcher is served within its batch window, late arrivals (during a batch) and
  overflow past `max_batch` included;
- the vLLM reload (`VllmRollout.sync`) sends the merged policy (LoRA scale alpha / rank, non-default alpha)
  under the plain transformers names, once per version, and resets the prefix cache after it: checked with a
  recording stand-in at the boundary rlf calls (`llm.collective_rpc`, `llm.reset_prefix_cache`), no vLLM needed.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import aiohttp
import pytest
import torch
from agent_support import SEARCH_TOOL, ScriptedEngine, running_endpoint, tool_result

from rlf_envs.env.episodes import Generation
from rlf_envs.env.tokens import TokenizerAdapter
from rlf_envs.formats import Qwen3Format
from rlf_envs.formats.chat import ChatCodec
from rlf_train.rollout.endpoint.engine import EngineFront
from rlf_train.rollout.endpoint.server import PolicyServer
from rlf_train.rollout.endpoint.sessions import EndpointLimits, Session

QUESTION = [{"role": "user", "content": "What is the capital of Zorbania?"}]


def tiny_tokenizer() -> Any:
    from rlf_train.config import ModelConfig
    from rlf_train.policy.tokenizer import load_tokenizer

    return load_tokenizer(ModelConfig())


async def sse(url: str, body: dict[str, Any]) -> list[Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http, \
            http.post(url, json=body) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        text = await r.text()
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


@pytest.mark.parametrize("include_usage", [True, False])
def test_a_stream_ends_with_the_finish_reason_chunk_then_usage(include_usage: bool) -> None:
    with running_endpoint(tiny_tokenizer()) as ep:
        s = ep.open()
        url = f"{ep.base_url(s)}/chat/completions"
        body: dict[str, Any] = {"messages": QUESTION, "tools": [SEARCH_TOOL], "stream": True}
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        events = asyncio.run(sse(url, body))
        plain_ep_session = ep.open()
        plain = asyncio.run(_json(f"{ep.base_url(plain_ep_session)}/chat/completions",
                                  {"messages": QUESTION, "tools": [SEARCH_TOOL]}))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    with_choices = [c for c in chunks if c["choices"]]
    finish = [c["choices"][0]["finish_reason"] for c in with_choices]
    assert finish[-1] == "tool_calls" and all(f is None for f in finish[:-1])  # the last one carries it
    assert with_choices[-1]["choices"][0]["delta"] == {}
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]  # usage comes last
        assert chunks[-2] is with_choices[-1]
        assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    else:
        assert chunks[-1] is with_choices[-1] and all("usage" not in c for c in chunks)
    assert plain["choices"][0]["finish_reason"] == "tool_calls"


async def _json(url: str, body: dict[str, Any]) -> Any:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http, \
            http.post(url, json=body) as r:
        return await r.json()


def test_every_generation_is_labelled_with_the_version_that_sampled_it() -> None:
    """Versions move on between batches (as the async agent worker's weight swaps do); each reply says which
    weights generated it, and its turn's label must be that version."""
    tok = tiny_tokenizer()
    adapter = TokenizerAdapter.shared(tok)
    codec = ChatCodec(Qwen3Format())
    published = {"v": 0}
    loaded = {"v": -1}

    async def engine(contexts: list[list[int]], max_tokens: list[int], stop: Any) -> list[Generation]:
        await asyncio.sleep(0.002)  # published moves on while the batch runs
        ids = adapter.encode(f"<answer>v{loaded['v']}</answer><|im_end|>")
        return [Generation(ids, [0.0] * len(ids), "stop") for _ in contexts]

    def refresh() -> int:  # the worker's: the newest published weights, loaded between batches
        loaded["v"] = published["v"]
        return loaded["v"]

    async def main() -> list[Session]:
        front = EngineFront(engine, codec.stop_strings, window_s=0.001)
        front.refresh = refresh
        server = PolicyServer(front, adapter.decode)
        await server.start()
        sessions = []
        try:
            async def bump() -> None:
                while True:
                    await asyncio.sleep(0.001)
                    published["v"] += 1

            bumper = asyncio.ensure_future(bump())

            async def agent(k: int) -> None:
                s = Session(f"s{k}", codec, adapter.encode, EndpointLimits(4096, 16, 60), None)
                server.sessions.add(s)
                sessions.append(s)
                msgs: list[dict[str, Any]] = [*QUESTION]
                async with aiohttp.ClientSession() as http:
                    for i in range(3):
                        await asyncio.sleep(random.random() * 0.01)
                        async with http.post(f"{server.base_url(s)}/chat/completions",
                                             json={"messages": msgs}) as r:
                            assert r.status == 200
                            msgs += [(await r.json())["choices"][0]["message"],
                                     {"role": "user", "content": f"And again ({i})?"}]

            await asyncio.gather(*(agent(k) for k in range(12)))
            bumper.cancel()
        finally:
            await server.close()
        return sessions

    sessions = asyncio.run(main())
    labels = [(g.version, g.reply.answer) for s in sessions for seg in s.segments for g in seg.turns]
    # versions moved on during the run: each of an agent's 3 turns waits for the one before, so there are at least 3
    # engine batches (more when the agents' requests spread out), each loading a newer version first
    assert len(labels) == 36 and len({v for v, _ in labels}) >= 3
    assert all(a == f"v{v}" for v, a in labels), [x for x in labels if x[1] != f"v{x[0]}"][:5]


def test_extension_keeps_non_canonical_generated_ids() -> None:
    """The engine returns ids that decode to the reply but are not how the tokenizer encodes it (one id per
    character): the next prompt must hold exactly those ids, never the text re-encoded."""
    tok = tiny_tokenizer()
    with running_endpoint(tok) as ep:
        adapter = ep.engine.adapter
        char_ids = ScriptedEngine(tok)  # (records calls)

        async def engine(contexts: list[list[int]], max_tokens: list[int], stop: Any) -> list[Generation]:
            out = []
            for c, m in zip(contexts, max_tokens, strict=True):
                text = ep.engine.script(adapter.decode(c))
                ids = [i for ch in text.split("<|im_end|>")[0] for i in adapter.encode(ch)] + \
                    adapter.encode("<|im_end|>")
                char_ids.calls.append((list(c), m, ids))
                out.append(Generation(ids, [-0.5] * len(ids), "stop"))
            return out

        ep.server.engine.generate_batch = engine
        s = ep.open()
        msgs: list[dict[str, Any]] = [*QUESTION]
        first = asyncio.run(_json(f"{ep.base_url(s)}/chat/completions", {"messages": msgs, "tools": [SEARCH_TOOL]}))
        m = first["choices"][0]["message"]
        msgs += [m, tool_result(m["tool_calls"][0]["id"])]
        asyncio.run(_json(f"{ep.base_url(s)}/chat/completions", {"messages": msgs, "tools": [SEARCH_TOOL]}))
    (ctx1, _, out1), (ctx2, _, out2) = char_ids.calls
    assert adapter.encode(adapter.decode(out1)) != out1  # not canonical: a re-encoding would change them
    assert ctx2[:len(ctx1) + len(out1)] == ctx1 + out1  # the next prompt holds the generated ids as they were
    seg = s.segments[0]
    assert len(s.segments) == 1 and seg.ids == ctx2 + out2
    assert [t for t, k in zip(seg.ids, seg.mask, strict=True) if k] == out1 + out2


def test_every_waiting_request_is_served_within_its_batch_window() -> None:
    """A batch runs for `BATCH_S`; requests arriving meanwhile (and past `max_batch`) go in the next batch, each
    served within its window, not dropped."""
    BATCH_S, WINDOW_S, MAX_WAIT_S = 0.3, 0.005, 0.05
    sizes: list[int] = []

    async def engine(contexts: list[list[int]], max_tokens: list[int], stop: Any) -> list[Generation]:
        sizes.append(len(contexts))
        await asyncio.sleep(BATCH_S)
        return [Generation([c[0]], [0.0], "stop") for c in contexts]

    async def main() -> list[float]:
        front = EngineFront(engine, [], window_s=WINDOW_S, max_wait_s=MAX_WAIT_S, max_batch=4)
        front.expected = lambda: 100  # never a full round: batches close on the window / max wait
        await front.start()
        try:
            async def req(k: int, delay: float) -> float:
                await asyncio.sleep(delay)
                t0 = time.monotonic()
                # the bound a served request keeps: its batch (maybe after the one running, and after one
                # overflow batch) plus the gathering waits, with a loaded machine's slack; a dropped one never
                # returns and fails here
                gen, _ = await asyncio.wait_for(front.generate([k], 1), timeout=3 * BATCH_S + 3 * MAX_WAIT_S + 20)
                assert list(gen.ids) == [k]
                return time.monotonic() - t0

            first = [req(k, 0.0) for k in range(6)]  # 4 in batch 1, 2 overflow into batch 2
            late = [req(10 + k, BATCH_S / 2) for k in range(3)]  # arrive while batch 1 runs
            return list(await asyncio.gather(*first, *late))
        finally:
            await front.close()

    waits = asyncio.run(main())
    assert len(waits) == 9 and sum(sizes) == 9 and max(sizes) <= 4
    assert len(sizes) >= 3  # 4, then the overflow and the late ones (up to 4 per batch)


def test_the_async_agent_worker_labels_with_the_weights_it_loaded() -> None:
    """`AgentWorker._refresh` (run on the engine's thread before each batch) returns the version of the weights it
    loaded into the engine's model: when the learner publishes again right after the load, the label stays the
    loaded version (a label that is newer, even within the staleness bound, is wrong)."""
    from rlf_train.rollout.agent_source import AgentWorker
    from rlf_train.rollout.weights import WeightStore

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

    learner, engine_model = Model(), Model()
    store = WeightStore()
    worker = object.__new__(AgentWorker)
    worker.store, worker.model, worker.version = store, engine_model, -1

    def publish(v: int) -> None:
        with torch.no_grad():
            learner.w.fill_(float(v))
        store.publish(v, learner)

    publish(0)
    assert worker._refresh() == 0 and engine_model.w.item() == 0.0
    publish(1)
    real_newer_than = store.newer_than

    def newer_than_then_publish(version: int) -> Any:  # the learner publishes 2 while version 1 is being loaded
        got = real_newer_than(version)
        publish(2)
        return got

    store.newer_than = newer_than_then_publish  # type: ignore[method-assign]
    assert worker._refresh() == 1 and engine_model.w.item() == 1.0  # loaded 1, labelled 1 (not 2)
    store.newer_than = real_newer_than  # type: ignore[method-assign]
    assert worker._refresh() == 2 and engine_model.w.item() == 2.0
    assert worker._refresh() == 2  # nothing newer: the weights it holds
