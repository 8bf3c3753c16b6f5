"""A multi-turn tool environment written in NeMo-Gym's own API alone (a `SimpleResourcesServer`), for rlf's tests
(tests/foreign_nemo/): the task is a person's pet; the `search` tool looks it up in the server's table (counted per
rollout in the session state `seed_session` starts), and `/verify` rewards a final answer that names the pet after a
search. Rows may ask `/verify` to misbehave (`verify_mode`: raise, nan, string) and the `crash` tool ends the server,
so the tests see those failures come from a real NeMo-Gym server."""

from __future__ import annotations

import math
import os
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.server_utils import SESSION_ID_KEY
from pydantic import BaseModel, Field

PETS = ["dog", "cat", "fish", "owl", "frog"]


def pet_of(person: str) -> str | None:
    if not (person.startswith("Person") and person[6:].isdigit()):
        return None
    return PETS[int(person[6:]) % len(PETS)]


class LookupConfig(BaseResourcesServerConfig):
    pass


class LookupSeedRequest(BaseSeedSessionRequest):
    person: str


class SearchRequest(BaseModel):
    query: str


class SearchResponse(BaseModel):
    result: str


class LookupVerifyRequest(BaseVerifyRequest):
    person: str
    verify_mode: str = "ok"


class LookupVerifyResponse(BaseVerifyResponse):
    searches: int
    answered_right: bool


class LookupServer(SimpleResourcesServer):
    config: LookupConfig
    searches: dict[str, int] = Field(default_factory=dict)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/search")(self.search)
        app.post("/crash")(self.crash)
        return app

    async def seed_session(self, request: Request, body: LookupSeedRequest) -> BaseSeedSessionResponse:
        self.searches[request.session[SESSION_ID_KEY]] = 0
        return BaseSeedSessionResponse()

    async def search(self, request: Request, body: SearchRequest) -> SearchResponse:
        sid = request.session[SESSION_ID_KEY]
        self.searches[sid] = self.searches.get(sid, 0) + 1
        pet = pet_of(body.query.strip())
        return SearchResponse(result=f"{body.query.strip()}: pet {pet}." if pet else f"no one named {body.query!r}")

    async def crash(self, request: Request) -> SearchResponse:
        os._exit(1)

    async def verify(self, request: Request, body: LookupVerifyRequest) -> Any:
        searches = self.searches.pop(request.session[SESSION_ID_KEY], 0)
        if body.verify_mode == "raise":
            raise RuntimeError("the lookup verifier's table is unreachable")
        texts = [c.text for o in body.response.output if o.type == "message" for c in o.content
                 if getattr(c, "type", "") == "output_text"]
        right = bool(texts) and pet_of(body.person) in texts[-1].lower()
        reward = 1.0 if right and searches > 0 else 0.0
        if body.verify_mode == "nan":
            reward = math.nan
        if body.verify_mode == "string":  # a hand-made answer whose reward is not a number
            return JSONResponse({**body.model_dump(mode="json"), "reward": "high", "searches": searches})
        return LookupVerifyResponse(**body.model_dump(), reward=reward, searches=searches, answered_right=right)


if __name__ == "__main__":
    LookupServer.run_webserver()
