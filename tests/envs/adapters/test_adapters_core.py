"""rlf_envs.env.episodes: token-mode episodes driven by a generate function (no torch, no trainer)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import tokenizers
from repo_paths import REPO

import rlf_envs
from rlf_envs.adapters import ADAPTERS, require_trainer
from rlf_envs.env.episodes import (
    ENV_ERROR,
    MAX_LENGTH,
    Generation,
    run_token_episode,
    run_token_episodes,
    run_token_episodes_sync,
)
from rlf_envs.env.tool_env import ToolEnv
from rlf_envs.extras import MissingDependency
from rlf_envs.registration import make_tool_env
from rlf_envs.types import EndReason

ASSETS = REPO / "rlf_train" / "src" / "rlf_train" / "assets"
TOKENIZER = ASSETS / "tiny_tokenizer.json"


@pytest.fixture(scope="module")
def tok() -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(TOKENIZER))


def _question(tok: tokenizers.Tokenizer, context: list[int]) -> str:
    return re.findall(r"What is ([^?]+)\?", tok.decode(context, skip_special_tokens=False))[-1]


class ScriptedCalculator:
    """A policy: call the calculator on the question, then answer what the tool said. Logprobs are
    -(position in the action)/100, so tests can tell them apart from the observations' zeros."""

    def __init__(self, tok: tokenizers.Tokenizer, wrong: bool = False) -> None:
        self.tok, self.wrong, self.calls = tok, wrong, 0
        self.contexts: list[list[int]] = []

    def action(self, context: list[int]) -> str:
        text = self.tok.decode(context, skip_special_tokens=False)
        results = re.findall(r"<tool_response>\s*(.*?)\s*</tool_response>", text, re.S)
        if results:
            value = "0" if self.wrong else results[-1]
            return f"<answer>{value}</answer><|im_end|>"
        call = {"name": "calculator", "arguments": {"expression": _question(self.tok, context)}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>"

    async def __call__(self, context: list[int], max_tokens: int, stop: list[str]) -> Generation:
        self.calls += 1
        self.contexts.append(list(context))
        await asyncio.sleep(0)
        ids = self.tok.encode(self.action(context), add_special_tokens=False).ids[:max_tokens]
        return Generation(ids, [-(k + 1) / 100 for k in range(len(ids))], "stop")


def _envs(tok: tokenizers.Tokenizer, n: int, **kw: object) -> list[ToolEnv]:
    return [make_tool_env("rlf/Calculator-v0", tokenizer=tok, **kw) for _ in range(n)]


def test_episodes_are_token_exact_with_aligned_masks_and_logprobs(tok: tokenizers.Tokenizer) -> None:
    policy = ScriptedCalculator(tok)
    envs = _envs(tok, 4)
    eps = run_token_episodes_sync(envs, policy, options=[{"task_index": k} for k in range(4)])
    assert policy.calls == 8  # two turns per episode
    for k, (ep, env) in enumerate(zip(eps, envs, strict=True)):
        traj = env.trajectory
        assert ep.prompt_ids + ep.completion_ids == traj.token_ids
        assert ep.env_mask == traj.loss_mask[len(ep.prompt_ids):]
        assert ep.task_id == env.tasks[k].id
        assert ep.turns == 2 and ep.end_reason == EndReason.ANSWER.value
        assert ep.outcome == 1.0 and ep.reward == 1.0 and ep.per_turn_rewards == [0.0, 0.0]
        assert ep.tool_calls == 1 and ep.tool_errors == 0
        # the env's answer to the tool call is in the completion with mask 0, and logprob 0
        obs = traj.turns[0].observation_span
        assert obs is not None and obs[1] > obs[0]
        lo, hi = obs[0] - len(ep.prompt_ids), obs[1] - len(ep.prompt_ids)
        assert set(ep.env_mask[lo:hi]) == {0} and set(ep.logprobs[lo:hi]) == {0.0}
        # action tokens carry the generator's logprobs, in order
        a0 = traj.turns[0].action_span
        assert a0 is not None
        n0 = a0[1] - a0[0]
        assert ep.logprobs[:n0] == [-(j + 1) / 100 for j in range(n0)]
        assert len(ep.logprobs) == len(ep.completion_ids) == len(ep.env_mask)
        assert sum(ep.env_mask) == sum(b - a for a, b in (t.action_span for t in traj.turns))


def test_wrong_answers_score_zero_and_generate_batch_is_called_once_per_turn(tok: tokenizers.Tokenizer) -> None:
    policy = ScriptedCalculator(tok, wrong=True)
    batches: list[int] = []

    async def batch(contexts: list[list[int]], max_tokens: list[int], stop: list[str]) -> list[Generation]:
        batches.append(len(contexts))
        assert stop == ["<|im_end|>"]
        return [await policy(c, m, stop) for c, m in zip(contexts, max_tokens, strict=True)]

    eps = run_token_episodes_sync(_envs(tok, 3), generate_batch=batch, options=[{"task_index": k} for k in range(3)])
    assert batches == [3, 3]
    assert [e.reward for e in eps] == [0.0, 0.0, 0.0]
    assert all(e.end_reason == "answer" for e in eps)


def test_tool_calls_of_a_turn_run_concurrently(tok: tokenizers.Tokenizer) -> None:
    """8 episodes whose tool takes 0.3 s each: one turn of tools takes about 0.3 s, not 2.4 s."""
    import time

    started: list[float] = []

    async def slow(expression: str) -> str:
        """Evaluate slowly.

        Args:
            expression: arithmetic
        """
        started.append(time.perf_counter())
        await asyncio.sleep(0.3)
        return str(eval(expression, {"__builtins__": {}}))  # the test's own expressions

    tasks = [{"id": f"t{k}", "question": f"What is {k} + 1?", "ground_truth": str(k + 1)} for k in range(8)]
    envs = [ToolEnv(tools=[slow], tasks=tasks, tokenizer=tok) for _ in range(8)]

    class Policy(ScriptedCalculator):
        def action(self, context: list[int]) -> str:
            return super().action(context).replace('"calculator"', '"slow"')

    t0 = time.perf_counter()
    eps = run_token_episodes_sync(envs, Policy(tok), options=[{"task_index": k} for k in range(8)])
    assert [e.reward for e in eps] == [1.0] * 8
    assert max(started) - min(started) < 0.25  # all 8 started before the first could finish
    assert time.perf_counter() - t0 < 2.4  # generous: serial would be >= 2.4 s


def test_per_turn_rewards_are_carried(tok: tokenizers.Tokenizer) -> None:
    class Rewarder:
        def turn_reward(self, turn: object) -> float:
            return 0.25

    env = make_tool_env("rlf/Calculator-v0", tokenizer=tok, turn_rewarder=Rewarder())
    ep = asyncio.run(run_token_episode(env, ScriptedCalculator(tok), options={"task_index": 0}))
    assert ep.per_turn_rewards == [0.25, 0.25]
    assert ep.reward == pytest.approx(1.5)


def test_max_length_caps_the_sequence_and_each_request(tok: tokenizers.Tokenizer) -> None:
    asked: list[tuple[int, int]] = []
    policy = ScriptedCalculator(tok)

    async def gen(context: list[int], max_tokens: int, stop: list[str]) -> Generation:
        asked.append((len(context), max_tokens))
        return await policy(context, max_tokens, stop)

    env = make_tool_env("rlf/Calculator-v0", tokenizer=tok)
    n_prompt = len(env.reset(options={"task_index": 0})[0])
    ep = asyncio.run(run_token_episode(env, gen, options={"task_index": 0}, max_length=n_prompt + 10,
                                       max_tokens_per_turn=64))
    assert len(ep.prompt_ids) + len(ep.completion_ids) <= n_prompt + 10
    assert asked[0] == (n_prompt, 10)
    assert ep.end_reason in (EndReason.TOKEN_BUDGET.value, EndReason.MAX_TURNS.value, MAX_LENGTH)
    # the prompt alone over max_length: no generation, the episode ends as max_length
    env2 = make_tool_env("rlf/Calculator-v0", tokenizer=tok)
    asked.clear()
    ep2 = asyncio.run(run_token_episode(env2, gen, options={"task_index": 0}, max_length=n_prompt))
    assert asked == [] and ep2.end_reason == MAX_LENGTH and ep2.completion_ids == [] and ep2.reward == 0.0


def test_max_completion_tokens_caps_what_follows_the_prompt_and_budgets_are_restored(
        tok: tokenizers.Tokenizer) -> None:
    env = make_tool_env("rlf/Calculator-v0", tokenizer=tok, max_total_tokens=4096)
    ep = asyncio.run(run_token_episode(env, ScriptedCalculator(tok), options={"task_index": 0},
                                       max_completion_tokens=30, max_tokens_per_turn=64))
    assert 0 < len(ep.completion_ids) <= 30
    assert ep.end_reason == EndReason.TOKEN_BUDGET.value  # the tool call plus its observation do not fit in 30
    assert env.max_total_tokens == 4096  # lowered for that episode only
    ep = asyncio.run(run_token_episode(env, ScriptedCalculator(tok), options={"task_index": 0}))
    assert ep.reward == 1.0


def test_no_logprobs_gives_none(tok: tokenizers.Tokenizer) -> None:
    policy = ScriptedCalculator(tok)

    async def gen(context: list[int], max_tokens: int, stop: list[str]) -> Generation:
        g = await policy(context, max_tokens, stop)
        return Generation(g.ids)

    ep = asyncio.run(run_token_episode(make_tool_env("rlf/Calculator-v0", tokenizer=tok), gen))
    assert ep.logprobs is None and ep.reward == 1.0


def test_bad_generate_output_and_arguments_are_refused(tok: tokenizers.Tokenizer) -> None:
    env = make_tool_env("rlf/Calculator-v0", tokenizer=tok)

    async def returns_list(context: list[int], max_tokens: int, stop: list[str]) -> list[int]:
        return [1, 2]

    with pytest.raises(TypeError, match="must return rlf_envs.env.episodes.Generation"):
        asyncio.run(run_token_episode(env, returns_list))  # type: ignore[arg-type]

    async def mismatched(context: list[int], max_tokens: int, stop: list[str]) -> Generation:
        return Generation([1, 2, 3], [0.0])

    with pytest.raises(ValueError, match="3 ids but 1 logprobs"):
        asyncio.run(run_token_episode(env, mismatched))

    async def too_long(context: list[int], max_tokens: int, stop: list[str]) -> Generation:
        return Generation([1] * (max_tokens + 1))

    with pytest.raises(ValueError, match="more than the"):
        asyncio.run(run_token_episode(env, too_long, max_tokens_per_turn=4))

    async def fails(context: list[int], max_tokens: int, stop: list[str]) -> Generation:
        raise ConnectionError("engine down")

    with pytest.raises(ConnectionError, match="engine down"):
        asyncio.run(run_token_episode(env, fails))
    with pytest.raises(TypeError, match="exactly one of"):
        asyncio.run(run_token_episodes([env]))
    with pytest.raises(ValueError, match="token-mode envs"):
        asyncio.run(run_token_episode(make_tool_env("rlf/Calculator-v0"), ScriptedCalculator(tok)))
    with pytest.raises(ValueError, match="2 options for 1 envs"):
        asyncio.run(run_token_episodes([env], ScriptedCalculator(tok), options=[None, None]))
    with pytest.raises(ValueError, match="not registered|doesn't exist|rlf/Nope-v0"):
        make_tool_env("rlf/Nope-v0")


def test_an_env_bug_is_raised_or_recorded(tok: tokenizers.Tokenizer) -> None:
    class Buggy(ToolEnv):
        async def astep(self, action: object):  # type: ignore[no-untyped-def,override]
            raise KeyError("bug in the env")

    def envs() -> list[ToolEnv]:
        return [Buggy(tools=[], tasks=[{"id": "a", "question": "What is 1 + 1?", "ground_truth": "2"}],
                      tokenizer=tok) for _ in range(2)]

    with pytest.raises(KeyError, match="bug in the env"):
        run_token_episodes_sync(envs(), ScriptedCalculator(tok))
    eps = run_token_episodes_sync(envs(), ScriptedCalculator(tok), catch_env_errors=True)
    assert [e.end_reason for e in eps] == [ENV_ERROR, ENV_ERROR]
    assert all(e.reward == 0.0 and "bug in the env" in (e.error or "") for e in eps)
    assert all(len(e.logprobs or []) == len(e.completion_ids) for e in eps)


def test_adapters_package_imports_no_trainer() -> None:
    import subprocess
    import sys

    code = ("import sys, rlf_envs.adapters, rlf_envs.adapters.episode, rlf_envs.env.episodes; "
            "bad = [m for m in ('torch', 'transformers', 'trl', 'verifiers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert set(ADAPTERS) >= {"trl", "verifiers"}
    assert ADAPTERS["trl"].install == rlf_envs.extras.install_hint("trl")
    assert rlf_envs.extras.install_hint("trl") == rlf_envs.extras.pip_install("trl")
    assert rlf_envs.extras.install_hint("trl").endswith("/rlf_envs[trl]'")


def test_a_missing_trainer_names_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "trl", None)  # as if not installed
    with pytest.raises(MissingDependency, match=r"pip install -e '.*/rlf_envs\[trl\]'"):
        require_trainer("trl")
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(MissingDependency, match=r"pip install --no-deps verifiers==0.4.0"):
        require_trainer("verifiers")
