"""rlf envs as NeMo-Gym resources servers (the real `nemo-gym` package, Python >= 3.12: tox -e adapters-rl-nemo).

NeMo-Gym's own `gymnasium_agent` (GymnasiumAgent, its real app) drives our `RlfGymnasiumServer` over HTTP on
loopback, with NeMo-Gym's ServerClient and session cookies; the policy behind the agent's `/v1/responses` is a
scripted model server in this file (answers in NeMo-Gym's Responses types). Every server is started on a free
127.0.0.1 port with a readiness deadline and stopped in `finally`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("resources_servers.gymnasium", reason="needs nemo-gym (Python >= 3.12; tox -e adapters-rl-nemo)")
uvicorn = pytest.importorskip("uvicorn")

import aiohttp  # noqa: E402
from asgi_support import free_port, serve  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from nemo_gym import server_utils  # noqa: E402
from nemo_gym.base_resources_server import BaseResourcesServerConfig  # noqa: E402
from nemo_gym.config_types import ModelServerRef, ResourcesServerRef  # noqa: E402
from nemo_gym.openai_utils import NeMoGymResponse  # noqa: E402
from nemo_gym.server_utils import (  # noqa: E402
    BaseServerConfig,
    GlobalAIOHTTPAsyncClientConfig,
    ServerClient,
    set_global_aiohttp_client,
)
from omegaconf import OmegaConf  # noqa: E402
from resources_servers.gymnasium import GymnasiumServer  # noqa: E402
from responses_api_agents.gymnasium_agent.app import GymnasiumAgent, GymnasiumAgentConfig  # noqa: E402

from rlf_envs.adapters.nemo_gym import RlfGymnasiumServer, RlfGymnasiumServerConfig, dataset_rows  # noqa: E402

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


def response(text: str = "", calls: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """A Responses-API response (what a NeMo-Gym model server returns) with one assistant message."""
    output: list[dict[str, Any]] = []
    if text:
        output.append({"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": text, "annotations": []}]})
    for k, c in enumerate(calls or []):
        output.append({"type": "function_call", "call_id": f"call_{k}", "name": c["name"], "arguments": c["arguments"]})
    return NeMoGymResponse.model_validate({"id": "resp_1", "created_at": 0, "model": "scripted", "object": "response",
                                           "output": output, "parallel_tool_calls": True, "tool_choice": "auto",
                                           "tools": []}).model_dump()


def scripted_model(turns: list[dict[str, Any]]) -> FastAPI:
    """A model server whose k-th answer in a conversation is turns[k] (k = assistant messages in the input)."""
    app = FastAPI()
    seen: list[list[dict[str, Any]]] = []

    @app.post("/v1/responses")
    async def responses(request: Request) -> dict[str, Any]:
        body = await request.json()
        seen.append(body["input"])
        k = sum(1 for m in body["input"] if m.get("role") == "assistant" or m.get("type") == "function_call")
        return turns[min(k, len(turns) - 1)]

    app.state.seen = seen
    return app


def with_aiohttp_client(app: FastAPI) -> FastAPI:
    """NeMo-Gym's process-wide aiohttp client, opened on the serving loop (ng_run does this from its config)."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: FastAPI):  # type: ignore[no-untyped-def]
        session = set_global_aiohttp_client(GlobalAIOHTTPAsyncClientConfig())
        try:
            async with inner(a) as state:
                yield state
        finally:  # closed on the loop that opened it (NeMo-Gym's atexit closer would use a new loop)
            await session.close()
            server_utils._GLOBAL_AIOHTTP_CLIENT = None

    app.router.lifespan_context = lifespan
    return app


def server_client(ports: dict[str, tuple[str, int]]) -> ServerClient:
    cfg = {name: {kind: {name: {"host": "127.0.0.1", "port": port}}} for name, (kind, port) in ports.items()}
    return ServerClient(head_server_config=BaseServerConfig(host="127.0.0.1", port=1),
                        global_config_dict=OmegaConf.create(cfg))


@contextlib.contextmanager
def stack(turns: list[dict[str, Any]], **env: Any) -> Iterator[tuple[str, FastAPI, RlfGymnasiumServer]]:
    """Our rlf server, a scripted model server and NeMo-Gym's gymnasium_agent, wired by name."""
    p_env, p_model, p_agent = free_port(), free_port(), free_port()
    client = server_client({"rlf": ("resources_servers", p_env), "policy": ("responses_api_models", p_model),
                            "agent": ("responses_api_agents", p_agent)})
    rlf = RlfGymnasiumServer(config=RlfGymnasiumServerConfig(host="127.0.0.1", port=p_env, entrypoint="app.py",
                                                             name="rlf", env_id="rlf/Calculator-v0", env_kwargs=env),
                             server_client=client)
    agent = GymnasiumAgent(config=GymnasiumAgentConfig(
        host="127.0.0.1", port=p_agent, entrypoint="app.py", name="agent", max_steps=6,
        resources_server=ResourcesServerRef(type="resources_servers", name="rlf"),
        model_server=ModelServerRef(type="responses_api_models", name="policy")), server_client=client)
    model = scripted_model(turns)
    with serve(rlf.setup_webserver(), p_env), serve(model, p_model), \
            serve(with_aiohttp_client(agent.setup_webserver()), p_agent) as agent_url:
        yield agent_url, model, rlf


def run_agent(agent_url: str, row: dict[str, Any]) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s, \
                s.post(f"{agent_url}/run", json=row) as r:
            assert r.status == 200, await r.text()
            return dict(await r.json())

    return asyncio.run(go())


def test_gymnasium_agent_runs_an_rlf_episode() -> None:
    row = dataset_rows("rlf/Calculator-v0", 1)[0]
    assert row["task_index"] == 0 and row["responses_create_params"]["input"][0]["role"] == "system"
    turns = [response(CALL), response("<answer>353195</answer>")]
    with stack(turns, turn_rewarder={"valid_call_bonus": 0.5}) as (agent_url, model, rlf):
        assert isinstance(rlf, GymnasiumServer) and isinstance(rlf.config, BaseResourcesServerConfig)
        out = run_agent(agent_url, row)
        assert out["terminated"] is True and out["truncated"] is False
        assert out["reward"] == 1.5  # per-turn bonus 0.5 + the verifier's 1.0, summed by the agent
        assert out["info"]["per_turn_rewards"] == [0.5, 0.0] and out["info"]["end_reason"] == "answer"
        # the model's second call saw the tool result as the user turn rlf renders (its template wraps it)
        second = model.state.seen[1]
        assert (second[-1]["role"], second[-1]["content"]) == ("user", "<tool_response>\n42\n</tool_response>")
        assert not rlf._envs  # the finished session's env went back to the pool


def test_function_call_items_become_rlf_tool_calls() -> None:
    """A model server with a tool parser returns function_call items: rendered back into the qwen3 format."""
    turns = [response("", [{"name": "calculator", "arguments": '{"expression": "6 * 7"}'}]),
             response("<answer>353195</answer>")]
    with stack(turns) as (agent_url, model, rlf):
        out = run_agent(agent_url, {**dataset_rows("rlf/Calculator-v0", 1)[0]})
        assert out["reward"] == 1.0
        assert model.state.seen[1][-1]["content"] == "<tool_response>\n42\n</tool_response>"


def test_budget_truncation_and_ground_truth_rows() -> None:
    turns = [response("no action")]  # never answers: rlf's max_turns truncates
    with stack(turns, max_turns=2) as (agent_url, model, rlf):
        out = run_agent(agent_url, {**dataset_rows("rlf/Calculator-v0", 1)[0]})
        assert out["truncated"] is True and out["terminated"] is False and out["reward"] == 0.0
        assert out["info"]["end_reason"] == "max_turns" and len(model.state.seen) == 2
        row = {"responses_create_params": {"input": [{"role": "user", "content": "3 * 4?"}]}, "ground_truth": "12",
               "question": "3 * 4?"}
    with stack([response("<answer>12</answer>")]) as (agent_url, model, rlf):
        assert run_agent(agent_url, row)["reward"] == 1.0


def test_bad_config_and_session_errors() -> None:
    client = server_client({})
    cfg = {"host": "127.0.0.1", "port": 1, "entrypoint": "app.py", "name": "rlf"}
    with pytest.raises(ValueError, match="text mode"):
        RlfGymnasiumServer(config=RlfGymnasiumServerConfig(**cfg, env_id="rlf/Calculator-v0",
                                                           env_kwargs={"tokenizer": "x"}), server_client=client)
    with pytest.raises(ValueError, match="rlf/Nope-v0"):
        RlfGymnasiumServer(config=RlfGymnasiumServerConfig(**cfg, env_id="rlf/Nope-v0"), server_client=client)
    rlf = RlfGymnasiumServer(config=RlfGymnasiumServerConfig(**cfg, env_id="rlf/Calculator-v0"), server_client=client)
    with pytest.raises(ValueError, match="POST /reset first"):
        asyncio.run(rlf.step(NeMoGymResponse.model_validate(response("<answer>1</answer>")), {}, "no-such-session"))
