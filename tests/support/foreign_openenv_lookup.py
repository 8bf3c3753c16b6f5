"""A multi-turn OpenEnv environment with tools, in OpenEnv's own API and nothing of rlf's: an `MCPEnvironment` whose
FastMCP tools are `search(query)` (a tiny encyclopedia) and `answer(text)`; `reset(seed)` picks the question, the
`answer` call ends the episode with reward 1 when right. Served as OpenEnv's docs say (`create_app`, uvicorn):
`python -m uvicorn foreign_openenv_lookup:app` (rlf does that for `rollout.environment:
openenv:foreign_openenv_lookup:app`)."""

from __future__ import annotations

import random
from typing import Any
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Observation, State

PEOPLE = {f"Person{i:02d}": ["dog", "cat", "fish", "owl", "frog"][i % 5] for i in range(40)}


class LookupObservation(Observation):
    prompt: str = ""


class LookupEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("lookup")
        env = self

        @mcp.tool()
        def search(query: str) -> str:
            """Look a person up by name; returns what the encyclopedia says."""
            name = next((n for n in PEOPLE if n.lower() in query.lower()), None)
            return f"{name}: pet {PEOPLE[name]}." if name else "No such person."

        @mcp.tool()
        def answer(text: str) -> str:
            """Give the final answer."""
            env.given = text
            return "answer recorded"

        super().__init__(mcp)
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.person, self.given = "", None

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> LookupObservation:
        self.person = random.Random(seed).choice(sorted(PEOPLE))
        self.given = None
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return LookupObservation(prompt=f"What is the pet of {self.person}? Use the tools, then call answer.")

    def _score(self, action: Any, obs: Observation) -> Observation:
        self._state.step_count += 1
        if isinstance(action, CallToolAction) and action.tool_name == "answer":
            obs.done = True
            obs.reward = float(str(action.arguments.get("text", "")).strip().lower() == PEOPLE[self.person])
        elif isinstance(action, CallToolAction):
            obs.reward = 0.0
        return obs

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._score(action, super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._score(action, await super().step_async(action, timeout_s=timeout_s, **kwargs))

    def _step_impl(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return LookupObservation(prompt="use the tools: search, then answer", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(LookupEnvironment, CallToolAction, CallToolObservation, env_name="lookup", max_concurrent_envs=64)
