"""rlf envs served in OpenEnv's protocol (the real `openenv-core` package: `Environment`, `create_app`, its
WebSocket `EnvClient`/`GenericEnvClient`), on a loopback server started here and stopped in `finally`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("openenv.core.env_server", reason="needs openenv-core (tox -e adapters-rl)")
uvicorn = pytest.importorskip("uvicorn")
tokenizers = pytest.importorskip("tokenizers")

from asgi_support import serve  # noqa: E402
from openenv.core.env_server import Environment  # noqa: E402
from openenv.core.generic_client import GenericEnvClient  # noqa: E402
from repo_paths import REPO  # noqa: E402

from rlf_envs.adapters.openenv import (  # noqa: E402
    RlfAction,
    RlfEnvClient,
    RlfEnvironment,
    create_rlf_app,
    environment_factory,
)
from rlf_envs.registration import make_tool_env  # noqa: E402

ASSETS = REPO / "rlf_train" / "src" / "rlf_train" / "assets"
TOKENIZER = ASSETS / "tiny_tokenizer.json"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


@pytest.fixture(scope="module")
def text_server() -> Iterator[str]:
    with serve(create_rlf_app("rlf/Calculator-v0", max_concurrent_envs=8, max_turns=3)) as url:
        yield url


def test_environment_is_openenvs_base_class() -> None:
    env = RlfEnvironment(make_tool_env("rlf/Calculator-v0"))
    assert isinstance(env, Environment) and env.SUPPORTS_CONCURRENT_SESSIONS
    obs = env.reset(task_index=0)
    assert obs.text == env.env.trajectory.prompt and obs.messages[-1]["role"] == "user" and obs.token_ids is None
    obs = env.step(RlfAction(text="<answer>353195</answer>"))
    assert obs.done and obs.reward == 1.0 and env.state.end_reason == "answer" and env.state.step_count == 1


def test_sessions_reuse_envs_and_build_them_one_at_a_time() -> None:
    """OpenEnv builds a session's env in its executor threads and closes it when the session ends: the factory
    hands a closed session's rlf env to the next session, and many sessions starting at once all get one."""
    factory = environment_factory("rlf/Calculator-v0")
    first = factory()
    first.close()
    assert factory().env is first.env
    with ThreadPoolExecutor(16) as pool:
        envs = list(pool.map(lambda _: factory(), range(32)))
    assert len({id(e.env) for e in envs}) == 32


def test_typed_client_plays_an_episode_over_websocket(text_server: str) -> None:
    with RlfEnvClient(base_url=text_server).sync() as client:
        r = client.reset(task_index=0)
        assert not r.done and "What is 874 * 404 + 99?" in r.observation.text
        assert r.observation.messages[0]["role"] == "system" and r.observation.task_id == "calc-0-0"
        r = client.step(RlfAction(text=CALL))
        assert not r.done and r.reward == 0.0 and r.observation.info["tool_calls"] == 1
        assert r.observation.messages == [{"role": "user", "content": "<tool_response>\n42\n</tool_response>"}]
        r = client.step(RlfAction(text="<answer>353195</answer>"))
        assert r.done and r.reward == 1.0 and r.observation.info["end_reason"] == "answer"
        state = client.state()
        assert state.turns == 2 and state.score == 1.0 and state.done and state.token_ids is None


def test_generic_client_and_concurrent_sessions(text_server: str) -> None:
    """OpenEnv's GenericEnvClient (plain dicts); 4 sessions at once each keep their own episode."""

    async def play(k: int) -> tuple[float, str]:
        async with GenericEnvClient(base_url=text_server) as client:
            r = await client.reset(task_index=k)
            gold = (await client.state())["task_id"]
            r = await client.step({"text": f"<answer>{k}</answer>"})
            return float(r.reward), gold

    async def main() -> list[tuple[float, str]]:
        return list(await asyncio.gather(*(play(k) for k in range(4))))

    results = asyncio.run(main())
    assert [tid for _, tid in results] == [f"calc-0-{k}" for k in range(4)]
    assert all(reward == 0.0 for reward, _ in results)


def test_token_mode_server_is_token_exact() -> None:
    tok = tokenizers.Tokenizer.from_file(str(TOKENIZER))
    with serve(create_rlf_app("rlf/Calculator-v0", tokenizer=tok, max_concurrent_envs=2)) as url, \
            RlfEnvClient(base_url=url).sync() as client:
        r = client.reset(task_index=0)
        prompt = list(r.observation.token_ids)
        assert tok.decode(prompt, skip_special_tokens=False) == r.observation.text
        action = tok.encode(CALL + "<|im_end|>", add_special_tokens=False).ids
        r = client.step(RlfAction(token_ids=action))
        obs = list(r.observation.token_ids)
        assert "<tool_response>\n42\n</tool_response>" in tok.decode(obs, skip_special_tokens=False)
        final = tok.encode("<answer>353195</answer><|im_end|>", add_special_tokens=False).ids
        r = client.step(RlfAction(token_ids=final))
        assert r.done and r.reward == 1.0 and r.observation.token_ids == []
        state = client.state()
        assert state.token_ids == prompt + action + obs + final  # exactly the ids exchanged, never re-tokenised
        assert state.loss_mask == [0] * len(prompt) + [1] * len(action) + [0] * len(obs) + [1] * len(final)
        client.reset(task_index=0)
        with pytest.raises(Exception, match="send token_ids"):
            client.step(RlfAction(text="<answer>1</answer>"))


def test_bad_requests_are_errors_not_crashes(text_server: str) -> None:
    with RlfEnvClient(base_url=text_server).sync() as client:
        with pytest.raises(Exception, match="task_index"):
            client.reset(level=3)
        client.reset(task_index=0)
        with pytest.raises(Exception, match="exactly one"):
            client.step(RlfAction())
        with pytest.raises(Exception, match="token-mode server"):
            client.step(RlfAction(token_ids=[1, 2]))
        r = client.step(RlfAction(text="<answer>353195</answer>"))  # the session still works
        assert r.done and r.reward == 1.0
    with pytest.raises(ValueError, match="rlf/Nope-v0"):
        create_rlf_app("rlf/Nope-v0")
