"""Adapter overhead for SkyRL-Gym, verl, OpenEnv and NeMo-Gym: `benchmarks/adapters.py` (same scripted policy,
same table: episodes/s vs the bare rlf vector env, same run) with these four cases added.

    python benchmarks/adapters_rl.py --env rlf/Calculator-v0 --episodes 64 --rounds 5 [--json out/adapters_rl.json]

What each case measures beyond the env:
- verl: `RlfAgentLoop.run()` per episode, all concurrent (as verl's AgentLoopWorker runs them), with a server
  manager that answers the scripted ids as verl's `TokenOutput`; the loop's own work and the shared token driver.
- SkyRL-Gym: `skyrl_gym.make` envs driven by `init`/`step` with the policy's text from 32 threads (SkyRL runs
  `env.step` in a thread pool); text mode, so the env parses text instead of decoding ids.
- OpenEnv: a loopback OpenEnv server (`create_rlf_app`, token mode) and one `RlfEnvClient` WebSocket session per
  episode, opened and closed every round: HTTP/WebSocket round trips and JSON on every step.
- NeMo-Gym (Python >= 3.12 only): a loopback `RlfGymnasiumServer`, and per episode the `/reset` + `/step` HTTP
  calls (with session cookies) that NeMo-Gym's gymnasium_agent makes, Responses-API bodies included.
"""

from __future__ import annotations

import asyncio
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import adapters as base  # benchmarks/adapters.py: the harness, the baseline and the scripted policy
from adapters import ROOT, SCRIPTS, Bench, case

sys.path.insert(0, str(ROOT / "tests"))  # verl's wheel ships a top-level `tests` package: import by file
from asgi_support import serve


def _keep_serving(bench: Bench, key: str, app: Any) -> str:
    """Start `app` once for the whole benchmark; stopped at exit through adapters.CLEANUP."""
    if key not in bench.state:
        cm = serve(app)
        bench.state[key] = cm.__enter__()
        base.CLEANUP.append(lambda: cm.__exit__(None, None, None))
    return str(bench.state[key])


@case("verl agent loop (RlfAgentLoop.run)", needs="verl")
def verl_case(bench: Bench) -> int:
    from omegaconf import OmegaConf
    from transformers import PreTrainedTokenizerFast
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.workers.rollout.replica import TokenOutput

    from rlf_envs.adapters.verl import RlfAgentLoop

    st = bench.state.get("verl")
    if st is None:
        hf = PreTrainedTokenizerFast(tokenizer_object=bench.tok)

        class Server:
            async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                               **kw: Any) -> Any:
                ids = bench.policy.action(prompt_ids)[: sampling_params["max_tokens"]]
                return TokenOutput(token_ids=ids, log_probs=[0.0] * len(ids))

        cfg = DictConfigWrap(OmegaConf.create({"actor_rollout_ref": {"rollout": {
            "prompt_length": 4096, "response_length": 2048}}, "data": {}}))
        st = bench.state["verl"] = (hf, Server(), cfg, DictConfigWrap(OmegaConf.create({})))
    hf, server, cfg, data_cfg = st

    async def run() -> list[Any]:
        loops = [RlfAgentLoop(trainer_config=cfg, server_manager=server, tokenizer=hf, processor=None,
                              dataset_cls=None, data_config=data_cfg,
                              env_id=bench.env_id, env_kwargs=bench.env_kwargs) for _ in bench.tasks]
        return list(await asyncio.gather(*(lp.run({"logprobs": True}, raw_prompt=[], extra_info={"task": t})
                                           for lp, t in zip(loops, bench.tasks, strict=True))))

    return sum(out.extra_fields["rlf_outcome"] == 1.0 for out in asyncio.run(run()))


@case("SkyRL-Gym (make/init/step, 32 threads, text)", needs="skyrl_gym")
def skyrl_case(bench: Bench) -> int:
    import skyrl_gym

    from rlf_envs.adapters.skyrl import register_skyrl

    envs = bench.state.get("skyrl")
    if envs is None:
        register_skyrl()
        envs = bench.state["skyrl"] = [
            skyrl_gym.make("rlf", env_config={"env_id": bench.env_id, "env_kwargs": bench.env_kwargs},
                           extras={"task_index": 0}) for _ in bench.tasks]

    def play(k: int) -> float:
        env, task = envs[k], bench.tasks[k]
        env.extras = {"task": task}
        env.init([])
        reward = 0.0
        for text in SCRIPTS[bench.env_id](task):
            out = env.step(text)
            reward += out["reward"]
            if out["done"]:
                break
        return reward

    with ThreadPoolExecutor(32) as pool:
        return sum(r == 1.0 for r in pool.map(play, range(len(envs))))


@case("OpenEnv (loopback server, WebSocket sessions)", needs="openenv")
def openenv_case(bench: Bench) -> int:
    from rlf_envs.adapters.openenv import RlfAction, RlfEnvClient, create_rlf_app

    url = _keep_serving(bench, "openenv", create_rlf_app(bench.env_id, tokenizer=bench.tok,
                                                         max_concurrent_envs=bench.episodes, **bench.env_kwargs))

    async def play(task: Any) -> float:
        async with RlfEnvClient(base_url=url) as client:
            r = await client.reset(task=_task_dict(task))
            context = list(r.observation.token_ids)
            while not r.done:
                ids = bench.policy.action(context)
                r = await client.step(RlfAction(token_ids=ids))
                context += ids + list(r.observation.token_ids or [])
            return float(r.reward or 0.0)

    async def run() -> list[float]:
        return list(await asyncio.gather(*(play(t) for t in bench.tasks)))

    return sum(r == 1.0 for r in asyncio.run(run()))


def _task_dict(task: Any) -> dict[str, Any]:
    return {"id": task.id, "question": task.question, "ground_truth": task.ground_truth,
            "messages": [m.to_dict() for m in task.messages], "meta": dict(task.meta)}


@case("NeMo-Gym (loopback GymnasiumServer, /reset + /step)", needs="resources_servers")
def nemo_case(bench: Bench) -> int:
    import aiohttp
    from nemo_gym.server_utils import BaseServerConfig, ServerClient
    from omegaconf import OmegaConf

    from rlf_envs.adapters.nemo_gym import RlfGymnasiumServer, RlfGymnasiumServerConfig

    if "nemo" not in bench.state:
        cfg = RlfGymnasiumServerConfig(host="127.0.0.1", port=1, entrypoint="app.py", name="rlf",
                                       env_id=bench.env_id, env_kwargs=bench.env_kwargs)
        client = ServerClient(head_server_config=BaseServerConfig(host="127.0.0.1", port=1),
                              global_config_dict=OmegaConf.create({}))
        bench.state["nemo_app"] = RlfGymnasiumServer(config=cfg, server_client=client).setup_webserver()
    url = _keep_serving(bench, "nemo", bench.state["nemo_app"])

    def body(text: str | None = None) -> dict[str, Any]:
        b: dict[str, Any] = {"responses_create_params": {"input": "x"}}
        if text is not None:
            b["response"] = {"id": "r", "created_at": 0, "model": "m", "object": "response",
                             "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "output": [
                                 {"id": "m", "type": "message", "role": "assistant", "status": "completed",
                                  "content": [{"type": "output_text", "text": text, "annotations": []}]}]}
        return b

    async def play(task: Any) -> float:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:  # NeMo-Gym session cookie
            async with s.post(f"{url}/reset", json={**body(), "task": _task_dict(task)}) as r:
                r.raise_for_status()
            reward = 0.0
            for text in SCRIPTS[bench.env_id](task):
                async with s.post(f"{url}/step", json={**body(text), "task": _task_dict(task)}) as r:
                    step = await r.json()
                reward += step["reward"]
                if step["terminated"] or step["truncated"]:
                    break
            return reward

    async def run() -> list[float]:
        return list(await asyncio.gather(*(play(t) for t in bench.tasks)))

    return sum(r == 1.0 for r in asyncio.run(run()))


if __name__ == "__main__":
    try:
        base.main()
    finally:
        for stop in base.CLEANUP:
            stop()
