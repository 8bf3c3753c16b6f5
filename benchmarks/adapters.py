"""Adapter overhead: episodes/s through each trainer adapter vs the bare rlf vector env, same run, same policy.

    python benchmarks/adapters.py [--env rlf/Search-v0] [--episodes 64] [--rounds 5] [--json out/adapters.json]

Every case plays the same scripted token-mode policy (search the question's entity, then answer; generation is
instant, so what is measured is the env plus the adapter's own work) on `--episodes` episodes at once.
`bare vector env` is the baseline: a hand-written loop over `ToolVectorEnv.areset_envs` / `astep_active`.
Cases run interleaved, `--rounds` times each; the table gives the median episodes/s and its ratio to the
baseline's median. A case whose trainer package is not installed is reported as skipped.

Adding an adapter: write `def my_case(bench: Bench) -> int` (run `bench.episodes` episodes through the adapter,
return how many it solved; raise `Skip(reason)` if it cannot run with these arguments; keep what you build
across rounds in `bench.state`, stop servers through `CLEANUP`) and decorate it with `@case("name",
needs="package")`. `--env` is rlf/Search-v0 or rlf/Calculator-v0 (`SCRIPTS`: one tool call, then the answer).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "rlf_envs" / "src")]

import numpy as np  # noqa: E402
import tokenizers  # noqa: E402

from rlf_envs import runtime  # noqa: E402
from rlf_envs.env.episodes import Generation  # noqa: E402
from rlf_envs.env.vector import ToolVectorEnv  # noqa: E402
from rlf_envs.registration import make_tool_env  # noqa: E402

TOKENIZER = ROOT / "rlf_train" / "src" / "rlf_train" / "assets" / "tiny_tokenizer.json"


class ScriptedPolicy:
    """Search the question's last word, then answer the gold answer; keyed by the episode's prompt ids so it
    costs the same through every path (no decoding)."""

    def __init__(self, tok: Any, prompts: dict[tuple[int, ...], tuple[list[int], list[int]]]) -> None:
        self.tok = tok
        self.prompts = prompts
        self.lengths = sorted({len(p) for p in prompts})

    def action(self, context: list[int]) -> list[int]:
        first = self.prompts.get(tuple(context))
        if first is not None:
            return first[0]
        for n in self.lengths:
            hit = self.prompts.get(tuple(context[:n]))
            if hit is not None:
                return hit[1]
        raise KeyError("context of no known prompt")

    async def generate(self, context: list[int], max_tokens: int, stop: list[str]) -> Generation:
        ids = self.action(context)[:max_tokens]
        return Generation(ids, [0.0] * len(ids), "stop")


@dataclass
class Bench:
    env_id: str
    env_kwargs: dict[str, Any]
    episodes: int
    tok: Any
    policy: ScriptedPolicy
    tasks: list[Any]
    state: dict[str, Any] = field(default_factory=dict)  # per-case objects kept across rounds (envs, adapters)


CASES: dict[str, tuple[Callable[[Bench], int], str | None]] = {}


def case(name: str, needs: str | None = None) -> Callable[[Callable[[Bench], int]], Callable[[Bench], int]]:
    def register(fn: Callable[[Bench], int]) -> Callable[[Bench], int]:
        CASES[name] = (fn, needs)
        return fn

    return register


@case("bare vector env")
def bare(bench: Bench) -> int:
    venv = bench.state.get("bare")
    if venv is None:
        venv = bench.state["bare"] = ToolVectorEnv(
            [lambda: make_tool_env(bench.env_id, tokenizer=bench.tok, **bench.env_kwargs)
             for _ in range(bench.episodes)])

    async def run() -> int:
        resets = await venv.areset_envs({i: {"task": t} for i, t in enumerate(bench.tasks)})
        contexts = {i: obs.astype(np.int64).tolist() for i, (obs, _) in resets.items()}
        active = list(contexts)
        while active:
            actions = {i: bench.policy.action(contexts[i]) for i in active}
            results = await venv.astep_active(actions)
            still = []
            for i in active:
                contexts[i] += actions[i]
                if not results[i].done:
                    contexts[i] += results[i].obs.astype(np.int64).tolist()
                    still.append(i)
            active = still
        return sum(e.trajectory.reward == 1.0 for e in venv.envs)

    return runtime.run(run())


@case("rlf_envs.env.episodes (core)")
def core(bench: Bench) -> int:
    from rlf_envs.env.episodes import run_token_episodes_sync

    envs = bench.state.get("core")
    if envs is None:
        envs = bench.state["core"] = [make_tool_env(bench.env_id, tokenizer=bench.tok, **bench.env_kwargs)
                                      for _ in range(bench.episodes)]
    eps = run_token_episodes_sync(envs, bench.policy.generate, options=[{"task": t} for t in bench.tasks])
    return sum(ep.outcome == 1.0 for ep in eps)


@case("TRL rollout_func (RlfRollout)", needs="trl")
def trl_rollout(bench: Bench) -> int:
    """RlfRollout called as GRPOTrainer calls it, `rollout_func(prompts, trainer)`; TRL's trainer (model
    forward/backward) is not in the loop, only what the adapter does per batch."""
    from rlf_envs.adapters.trl import RlfRollout

    rollout = bench.state.get("trl")
    if rollout is None:
        rollout = bench.state["trl"] = RlfRollout(bench.env_id, bench.env_kwargs, generate=bench.policy.generate,
                                                  tokenizer=bench.tok)
    trainer = SimpleNamespace(args=SimpleNamespace(max_completion_length=None), processing_class=bench.tok)
    out = rollout([t.question for t in bench.tasks], trainer)
    return sum(r == 1.0 for r in out["rlf_reward"])


@case("TRL environment_factory (TRL's tool loop)", needs="trl")
def trl_environment_factory(bench: Bench) -> int:
    """The class `environment_factory` builds, driven as TRL's tool loop drives it: per rollout `reset(row)`, the
    scripted tool call as a method call (one rollout after another: TRL calls sync tools in a loop), then
    `rlf_env_reward` on the answer. TRL's chat templating, tokenising and parsing are not in the loop."""
    import warnings

    from rlf_envs.adapters.trl import environment_factory, rlf_env_reward

    st = bench.state.get("trl_env")
    if st is None:
        env_cls = environment_factory(bench.env_id, bench.env_kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the degradation warning, once
            envs = [env_cls() for _ in bench.tasks]
        probe = make_tool_env(bench.env_id, **bench.env_kwargs)
        plans = []
        for t in bench.tasks:
            first, second = SCRIPTS[bench.env_id](t)
            (call,) = probe.format.parse(first).calls
            plans.append((t.id, call.name, dict(call.arguments), second))
        probe.close()
        st = bench.state["trl_env"] = (envs, plans)
    envs, plans = st
    for env, (task_id, tool, args, _) in zip(envs, plans, strict=True):
        env.reset(rlf_task_id=task_id)
        getattr(env, tool)(**args)
    rewards = rlf_env_reward([[{"role": "assistant", "content": p[3]}] for p in plans], envs)
    return sum(r == 1.0 for r in rewards)


def _calculator_script(t: Any) -> tuple[str, str]:
    call = {"name": "calculator", "arguments": {"expression": t.question[len("What is "):-1]}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>", f"<answer>{t.gold_answers[0]}</answer><|im_end|>"


#: env id -> the scripted episode (first action, second action) for a task: one tool call, then the right answer
SCRIPTS: dict[str, Callable[[Any], tuple[str, str]]] = {
    "rlf/Search-v0": lambda t: (f"<search> {t.question.rstrip('?').split()[-1]} </search>",
                                f"<answer> {t.gold_answers[0]} </answer>"),
    "rlf/Calculator-v0": _calculator_script,
}


@case("verifiers (Env.run_episode, loopback chat server)", needs="verifiers")
def verifiers_episodes(bench: Bench) -> int:
    """verifiers' Python entry (load_environment + Env.run_episode inside Env.serving) with a scripted
    OpenAI-compatible server on loopback that makes the same tool call and answer (Calculator only): every
    model turn is two HTTP round trips (verifiers' interception, then the server), which the other paths
    do not have."""
    if bench.env_id != "rlf/Calculator-v0":
        raise Skip("the loopback chat server plays rlf/Calculator-v0 only (--env rlf/Calculator-v0)")
    import verifiers.v1 as vf
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    st = bench.state.get("verifiers")
    if st is None:
        sys.path.insert(0, str(ROOT))
        from tests.support.servers.fake_openai import FakeChatServer, RunningServer

        os.environ.setdefault("PRIME_API_KEY", "unused-on-loopback")
        fake = FakeChatServer(mode="native")
        server = RunningServer(fake)
        cfg = resolve_env_config({"taskset": {"id": "rlf_verifiers", "env_id": bench.env_id,
                                              "env_kwargs": bench.env_kwargs},
                                  "agent": {"runtime": {"type": "subprocess"}}})
        env = load_environment(cfg)
        ids = {t.id for t in bench.tasks}
        tasks = [t for t in env.taskset if t.data.id in ids]
        st = bench.state["verifiers"] = (env, tasks, server,
                                         vf.ModelContext(model="fake", client=vf.EvalClientConfig(base_url=fake.url)))
        CLEANUP.append(server.stop)
    env, tasks, _, ctx = st

    async def run() -> list[Any]:
        async with env.serving():
            return list(await asyncio.gather(*(env.run_episode(t, ctx) for t in tasks)))

    return sum(ep.traces[0].rewards["rlf"].score == 1.0 for ep in asyncio.run(run()))


class Skip(Exception):
    """A case that cannot run with these arguments."""


CLEANUP: list[Callable[[], None]] = []


def setup(env_id: str, env_kwargs: dict[str, Any], episodes: int) -> Bench:
    if env_id not in SCRIPTS:
        raise SystemExit(f"--env {env_id}: no scripted policy here; one of {sorted(SCRIPTS)}")
    tok = tokenizers.Tokenizer.from_file(str(TOKENIZER))
    probe = make_tool_env(env_id, tokenizer=tok, **env_kwargs)
    seen: set[str] = set()
    tasks = []
    for t in probe.tasks:  # distinct questions: the TRL adapter finds tasks by their question
        if t.question not in seen:
            seen.add(t.question)
            tasks.append(t)
        if len(tasks) == episodes:
            break
    prompts = {}
    for t in tasks:
        obs, _ = probe.reset(options={"task": t})
        first, second = SCRIPTS[env_id](t)
        prompts[tuple(obs.astype(np.int64).tolist())] = (tok.encode(first, add_special_tokens=False).ids,
                                                         tok.encode(second, add_special_tokens=False).ids)
    probe.close()
    return Bench(env_id, env_kwargs, len(tasks), tok, ScriptedPolicy(tok, prompts), tasks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default="rlf/Search-v0")
    p.add_argument("--env-kwargs", type=json.loads, default=None,
                   help='JSON for gymnasium.make (default for rlf/Search-v0: {"topk": 1, "max_turns": 3})')
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if a.env_kwargs is None:
        a.env_kwargs = {"topk": 1, "max_turns": 3} if a.env == "rlf/Search-v0" else {}
    bench = setup(a.env, a.env_kwargs, a.episodes)
    runnable = {n: fn for n, (fn, needs) in CASES.items() if needs is None or importlib.util.find_spec(needs)}
    skipped = [n for n in CASES if n not in runnable]
    reasons = {n: f"{CASES[n][1]} is not installed" for n in skipped}
    rates: dict[str, list[float]] = {n: [] for n in runnable}
    solved: dict[str, int] = {}
    for name, fn in list(runnable.items()):  # warm-up: builds envs and indexes, fills tokenizer caches
        try:
            solved[name] = fn(bench)
        except Skip as e:
            skipped.append(name)
            reasons[name] = str(e)
            del runnable[name], rates[name]
    order = list(runnable.items())
    for r in range(a.rounds):
        for name, fn in order[r % len(order):] + order[: r % len(order)]:  # rotated: no case always goes first
            gc.collect()  # one case's garbage is not collected on the next case's clock
            t0 = time.perf_counter()
            solved[name] = fn(bench)
            rates[name].append(bench.episodes / (time.perf_counter() - t0))
    base = statistics.median(rates["bare vector env"])
    load = os.getloadavg()
    print(f"{a.env} {a.env_kwargs}: {bench.episodes} episodes at once, scripted policy, median of {a.rounds} "
          f"rounds (load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})")
    print(f"{'path':52s} {'episodes/s':>11s} {'vs bare':>8s} {'solved':>7s}")
    rows = {}
    for name, rs in rates.items():
        med = statistics.median(rs)
        rows[name] = {"episodes_per_s": med, "ratio_vs_bare": med / base, "rounds": rs, "solved": solved[name]}
        print(f"{name:52s} {med:11.1f} {med / base:8.2f} {solved[name]:4d}/{bench.episodes}")
    for name in skipped:
        print(f"{name:52s} skipped: {reasons[name]}")
    if len({s for s in solved.values()}) != 1:
        raise SystemExit(f"the paths solved different numbers of episodes: {solved}")
    if a.json:
        from tool_calls import write_report

        write_report(a.json, {"env": a.env, "env_kwargs": a.env_kwargs, "episodes": bench.episodes,
                              "rounds": a.rounds, "load_average": load, "cases": rows, "skipped": skipped})


if __name__ == "__main__":
    try:
        main()
    finally:
        for stop in CLEANUP:
            stop()
