"""ToolEnv and ToolVectorEnv: Gymnasium conformance, episodes, budgets, token mode, autoreset."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import warnings
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import tokenizers
from gymnasium.utils.env_checker import check_env
from gymnasium.vector import AutoresetMode

import rlf_envs  # noqa: F401 - registers the ids
from rlf_envs.env import ToolEnv, ToolVectorEnv
from rlf_envs.envs.calculator import calculate
from rlf_envs.tools import tool
from rlf_envs.tools.base import ToolError
from rlf_envs.types import ActionKind, EndReason, Task


def call(name: str, **args: Any) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call><|im_end|>"


ANSWER = "<answer>{}</answer><|im_end|>"


@tool
async def echo(text: str) -> str:
    """Echo text."""
    return text


@tool
async def sleepy(seconds: float) -> str:
    """Sleep then answer."""
    await asyncio.sleep(seconds)
    return "awake"


@tool
def broken() -> str:
    """Always fails."""
    raise ToolError("the database is down")


TASKS = [Task(id=f"t{i}", question=f"Say {w}", ground_truth=[w]) for i, w in enumerate(["alpha", "beta", "gamma"])]


def make_tokenizer() -> tokenizers.Tokenizer:
    """A real byte-level BPE tokenizer trained here, offline, with ChatML specials."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["<tool_call> {\"name\": \"echo\", \"arguments\": {\"text\": \"hello\"}} </tool_call>",
              "<tool_response> user assistant system answer Say alpha beta gamma", "Tools You may call functions"]
    tok.train_from_iterator(corpus * 20, trainer)
    return tok


# ------------------------------------------------------------------------------------------ gymnasium conformance
@pytest.mark.parametrize("env_id", ["rlf/Calculator-v0", "rlf/Tools-v0"])
def test_check_env_registered_ids(env_id: str) -> None:
    kwargs = {"tools": [echo], "tasks": TASKS} if env_id == "rlf/Tools-v0" else {}
    env = gym.make(env_id, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no avoidable warnings
        check_env(env.unwrapped)
    env.close()


def test_check_env_token_mode() -> None:
    env = gym.make("rlf/Tools-v0", tools=[echo], tasks=TASKS, tokenizer=make_tokenizer())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)
    obs, _ = env.reset(seed=1)
    assert obs.dtype == np.int64 and obs in env.observation_space


def test_spaces_contain_any_unicode() -> None:
    env = ToolEnv(tools=[echo], tasks=TASKS)
    obs, _ = env.reset(seed=0)
    assert obs in env.observation_space
    obs, *_ = env.step(call("echo", text="ünïcødé ✓ 中文"))
    assert "ünïcødé ✓ 中文" in obs and obs in env.observation_space
    assert env.action_space.contains("any ✓ text") and not env.action_space.contains(b"bytes")


def test_seeded_reset_is_deterministic() -> None:
    env = ToolEnv(tools=[echo], tasks=TASKS)
    picks = [env.reset(seed=s)[1]["task_id"] for s in (7, 8, 7)]
    assert picks[0] == picks[2]
    assert env.reset(options={"task_index": 2})[1]["task_id"] == "t2"
    custom = Task("mine", "Say delta", ["delta"])
    assert env.reset(options={"task": custom})[1]["task_id"] == "mine"
    with pytest.raises(IndexError, match="out of range: this env has 3 tasks"):
        env.reset(options={"task_index": 3})


# ------------------------------------------------------------------------------------------ episodes
def test_episode_with_tool_call_error_invalid_and_answer() -> None:
    env = ToolEnv(tools=[echo, broken], tasks=TASKS, max_turns=6)
    env.reset(options={"task_index": 1})
    obs, r, term, trunc, info = env.step(call("echo", text="beta?"))
    assert "<tool_response>\nbeta?\n</tool_response>" in obs and (r, term, trunc) == (0.0, False, False)
    assert info["tool_calls"] == 1 and info["tool_errors"] == 0

    obs, *_, info = env.step(call("broken"))
    assert "Error: the database is down" in obs and info["tool_errors"] == 1

    obs, *_, info = env.step(call("nope"))
    assert "unknown tool 'nope'" in obs and info["tool_errors"] == 1

    obs, r, term, trunc, info = env.step("I refuse to use the format")
    assert info["invalid"] and "Your last turn was invalid" in obs and not term

    obs, r, term, trunc, info = env.step(ANSWER.format("beta"))
    assert term and not trunc and r == 1.0 and obs == ""
    traj = info["trajectory"]
    assert traj.answer == "beta" and traj.end is EndReason.ANSWER and traj.reward == 1.0
    assert [t.action.kind for t in traj.turns] == [ActionKind.TOOL_CALLS] * 3 + [ActionKind.INVALID, ActionKind.ANSWER]
    assert traj.num_tool_calls == 3 and traj.num_tool_errors == 2
    assert traj.text.startswith(traj.prompt) and traj.text.endswith(ANSWER.format("beta"))
    with pytest.raises(RuntimeError, match="call reset"):
        env.step(ANSWER.format("beta"))


def test_wrong_answer_scores_zero_and_max_turns_truncates() -> None:
    env = ToolEnv(tools=[echo], tasks=TASKS, max_turns=2)
    env.reset(options={"task_index": 0})
    *_, r, term, _, _ = env.step(ANSWER.format("beta"))
    assert term and r == 0.0
    env.reset(options={"task_index": 0})
    env.step(call("echo", text="x"))
    obs, r, term, trunc, info = env.step(call("echo", text="y"))
    assert trunc and not term and obs == "" and info["end_reason"] == "max_turns"


def test_token_budget_and_observation_cap() -> None:
    @tool
    async def flood(n: int) -> str:
        """n words."""
        return " ".join(["word"] * n)

    tok = make_tokenizer()
    env = ToolEnv(tools=[flood], tasks=TASKS, tokenizer=tok, max_obs_tokens=64, max_total_tokens=4096, max_turns=10)
    env.reset(seed=0)
    obs, *_, info = env.step(call("flood", n=5000))
    assert len(obs) <= 64 + 40  # capped (markers and the turn template are outside the content budget)
    assert "[truncated:" in tok.decode(obs.tolist()) and info["turn_stats"].truncated == 1

    small = ToolEnv(tools=[flood], tasks=TASKS, tokenizer=tok, max_total_tokens=len(env.trajectory.token_ids) + 20)
    small.reset(seed=0)
    obs, r, term, trunc, info = small.step(call("flood", n=50))
    assert trunc and info["end_reason"] == "token_budget" and len(obs) == 0


def test_rewards_config_and_turn_rewards() -> None:
    class Rewarder:
        def turn_reward(self, turn: Any) -> float:
            return 0.1 if turn.stats.calls and not turn.stats.errors else (-0.2 if turn.stats.invalid else 0.0)

    env = ToolEnv(tools=[echo], tasks=TASKS, turn_rewarder=Rewarder())
    env.reset(options={"task_index": 2})
    _, r1, *_ = env.step(call("echo", text="gamma"))
    _, r2, *_ = env.step("garbage")
    _, r3, term, _, info = env.step(ANSWER.format("Gamma!"))  # normalised exact match
    assert (r1, r2) == (0.1, -0.2) and term and r3 == 1.0
    assert info["trajectory"].per_turn_rewards == [0.1, -0.2, 0.0]


def test_a_search_that_retrieved_the_answer_earns_its_process_reward() -> None:
    """TurnRewarder's answer_in_result_bonus: the env passes the task, so a turn whose OK result holds a gold answer
    (normalised, whole words) is paid once; a near miss, an error result, a task-free call are not."""
    from rlf_envs.rewards import TurnRewarder

    rewarder = TurnRewarder(answer_in_result_bonus=0.2, valid_call_bonus=0.01)
    env = ToolEnv(tools=[echo, broken], tasks=TASKS, turn_rewarder=rewarder)
    env.reset(options={"task_index": 1})  # gold: beta
    _, r1, *_ = env.step(call("echo", text="It is BETA."))
    _, r2, *_ = env.step(call("echo", text="betamax, alphabet"))
    _, r3, *_ = env.step(call("broken"))
    assert (r1, r2, r3) == (pytest.approx(0.21), 0.01, 0.0)
    turn = env.trajectory.turns[0]
    assert rewarder.turn_reward(turn) == pytest.approx(0.01)  # without the task: no answer to look for
    assert rewarder.turn_reward(turn, Task("x", "q", ground_truth={"target": ["beta"]})) == pytest.approx(0.21)
    assert rewarder.turn_reward(turn, Task("x", "q", ground_truth="It is")) == pytest.approx(0.21)
    assert rewarder.turn_reward(turn, Task("x", "q", ground_truth=None)) == pytest.approx(0.01)


# ------------------------------------------------------------------------------------------ token mode
def test_token_mode_exact_ids_and_loss_mask() -> None:
    tok = make_tokenizer()
    env = ToolEnv(tools=[echo], tasks=TASKS, tokenizer=tok, max_turns=5)
    obs, _ = env.reset(options={"task_index": 0})
    context = obs.tolist()
    policy_turns = [call("echo", text="alpha ✓"), "not a valid turn", ANSWER.format("alpha")]
    policy_ids: list[list[int]] = []
    for text in policy_turns:
        ids = tok.encode(text, add_special_tokens=False).ids
        policy_ids.append(ids)
        obs, r, term, trunc, info = env.step(np.asarray(ids))
        context += ids + obs.tolist()
    traj = info["trajectory"]
    assert term and r == 1.0
    assert traj.token_ids == context  # the env appended exactly what it returned, nothing re-tokenised
    assert tok.decode(traj.token_ids, skip_special_tokens=False) == traj.text
    mask = np.asarray(traj.loss_mask)
    assert mask.sum() == sum(len(i) for i in policy_ids)
    for turn, ids in zip(traj.turns, policy_ids, strict=True):
        s, e = turn.action_span
        assert traj.token_ids[s:e] == ids and mask[s:e].all()
        if turn.observation_span:
            os_, oe = turn.observation_span
            assert not mask[os_:oe].any()
    assert not mask[: len(tok.encode(traj.prompt, add_special_tokens=False).ids)].any()


def test_token_mode_never_retokenises_policy_ids() -> None:
    """Non-canonical ids (a merge the tokenizer would not produce) are kept exactly."""
    tok = make_tokenizer()
    env = ToolEnv(tools=[echo], tasks=TASKS, tokenizer=tok)
    env.reset(options={"task_index": 0})
    text = ANSWER.format("alpha")
    canonical = tok.encode(text, add_special_tokens=False).ids
    # spell "alpha" one byte-level token per character: decodes to the same text, different ids
    chars = [tok.token_to_id(c) for c in "alpha"]
    prefix = tok.encode("<answer>", add_special_tokens=False).ids
    suffix = tok.encode("</answer><|im_end|>", add_special_tokens=False).ids
    odd = prefix + chars + suffix
    assert odd != canonical and tok.decode(odd, skip_special_tokens=False) == text
    *_, r, term, _, info = env.step(odd)
    assert term and r == 1.0
    assert info["trajectory"].token_ids[-len(odd):] == odd


def test_tokenizer_adapter_caches_and_batches_without_changing_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlf_envs.env import tokens
    from rlf_envs.env.tokens import TokenizerAdapter

    tok = make_tokenizer()
    a = TokenizerAdapter.shared(tok)
    assert TokenizerAdapter.shared(tok) is a and TokenizerAdapter.shared(make_tokenizer()) is not a
    texts = ["Say alpha", "<tool_response> beta ✓", "", "Say alpha", "x" * 5000, "gamma\n\n"]
    want = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    assert [a.encode(t) for t in texts] == want
    assert a.encode_batch(texts) == want
    assert TokenizerAdapter(tok).encode_batch(texts) == want  # fresh cache: all through one batched call
    got = a.encode("Say alpha")
    got.append(-1)  # callers may extend what they get: the cache must not change
    assert a.encode("Say alpha") == want[0]
    assert "x" * 5000 not in a._cache  # long texts are not kept
    padded = make_tokenizer()
    padded.enable_padding(pad_id=0, pad_token="<|im_start|>")  # as some tokenizer.json files ship
    assert TokenizerAdapter(padded).encode_batch(texts) == want  # no pad ids in a batch
    monkeypatch.setattr(tokens, "ENCODE_CACHE_SIZE", 3)
    for i in range(10):
        assert a.encode(f"Say {i}") == tok.encode(f"Say {i}", add_special_tokens=False).ids
    assert len(a._cache) <= 3


def test_rlf_envs_imports_no_torch() -> None:
    code = ("import sys, rlf_envs, rlf_envs.rewards, rlf_envs.tasks, rlf_envs.formats, rlf_envs.tools; "
            "import gymnasium as gym; gym.make('rlf/Calculator-v0'); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


# ------------------------------------------------------------------------------------------ vector env
def test_make_vec_gives_tool_vector_env() -> None:
    venv = gym.make_vec("rlf/Calculator-v0", num_envs=3)
    assert isinstance(venv.unwrapped, ToolVectorEnv) and venv.num_envs == 3
    obs, info = venv.reset(seed=0)
    assert len(obs) == 3 and all(isinstance(o, str) for o in obs)
    q = [o.rsplit("What is ", 1)[1].split("?")[0] for o in obs]
    obs, rew, term, trunc, info = venv.step([ANSWER.format(calculate(x)) for x in q])
    assert rew.tolist() == [1.0, 1.0, 1.0] and term.all()
    venv.close()


def _episode_actions() -> list[list[str]]:
    # env 0 answers at step 0; env 1 calls a tool then answers; env 2 keeps calling (truncates at max_turns=3)
    return [
        [ANSWER.format("alpha"), call("echo", text="x"), call("echo", text="x")],
        [call("echo", text="x"), ANSWER.format("beta"), call("echo", text="x")],
        [ANSWER.format("alpha"), call("echo", text="x"), call("echo", text="x")],
        [call("echo", text="x"), call("echo", text="x"), call("echo", text="x")],
    ]


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_autoreset_matches_gymnasium_sync_vector_env(mode: AutoresetMode) -> None:
    kw = dict(tools=[echo], tasks=TASKS, max_turns=3)
    ours = ToolVectorEnv(num_envs=3, autoreset_mode=mode, **kw)
    ref = gym.vector.SyncVectorEnv([lambda: ToolEnv(**kw) for _ in range(3)], autoreset_mode=mode)
    o1, _ = ours.reset(seed=5)
    o2, _ = ref.reset(seed=5)
    assert tuple(o1) == tuple(o2)
    for step_actions in _episode_actions():
        a1 = ours.step(step_actions)
        a2 = ref.step(step_actions)
        assert tuple(a1[0]) == tuple(a2[0])
        for x, y in zip(a1[1:4], a2[1:4], strict=True):
            np.testing.assert_array_equal(x, y)
        i1, i2 = a1[4], a2[4]
        assert sorted(i1) == sorted(i2)  # same info keys and `_key` masks as gymnasium's own batching
        for key in ("turn", "_turn", "tool_calls", "_tool_calls", "invalid", "action_kind", "_trajectory"):
            if key in i2:
                np.testing.assert_array_equal(i1[key], i2[key])
                assert i1[key].dtype == i2[key].dtype


def test_autoreset_disabled_requires_explicit_reset() -> None:
    venv = ToolVectorEnv(num_envs=2, autoreset_mode="Disabled", tools=[echo], tasks=TASKS)
    venv.reset(seed=0)
    venv.step([ANSWER.format("x"), call("echo", text="hi")])
    with pytest.raises(RuntimeError, match=r"envs \[0\] finished"):
        venv.step([ANSWER.format("x"), ANSWER.format("x")])
    obs, _ = venv.reset(options={"reset_mask": np.array([True, False])})
    assert "<tool_response>\nhi" in obs[1]  # untouched env keeps its last observation
    venv.step([ANSWER.format("x"), ANSWER.format("x")])


def test_async_api_steps_only_active_envs_and_slow_env_does_not_stall() -> None:
    venv = ToolVectorEnv(num_envs=4, tools=[echo, sleepy], tasks=TASKS, caller={"timeout_s": 3.0})

    async def scenario() -> None:
        await venv.areset_envs({i: {"task_index": i % 3} for i in range(4)})
        assert venv.active == [0, 1, 2, 3]
        t0 = time.perf_counter()
        res = await venv.astep_active({
            0: call("sleepy", seconds=30),
            1: call("echo", text="fast"),
            2: ANSWER.format("gamma"),
        })
        elapsed = time.perf_counter() - t0
        assert elapsed < 20, f"a slow tool (30 s, deadline 3 s) stalled the batch for {elapsed:.2f}s"
        assert "timed out after 3s" in res[0].obs
        assert "fast" in res[1].obs and res[2].terminated and res[2].reward == 1.0
        assert venv.active == [0, 1, 3]

    asyncio.run(scenario())  # a foreign event loop: calls hop onto rlf's loop


@pytest.mark.parametrize("token_mode", [True, False], ids=["tokens", "text"])
def test_batched_vector_step_equals_stepping_each_env_alone(token_mode: bool) -> None:
    """areset_envs/astep_active run resets and steps phase by phase for the whole batch (one gather for tool
    calls, one tokenizer call): every return value and the whole trajectory must equal what each env's own
    areset/astep gives."""
    tok = make_tokenizer() if token_mode else None

    class Custom(ToolEnv):  # overrides astep: a batch holding it is stepped env by env
        async def astep(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
            return await super().astep(action)

    script = [  # per env: its turns
        [call("echo", text="alpha"), ANSWER.format("alpha")],
        [call("broken"), "no tags at all", ANSWER.format("wrong")],
        [call("echo", text="x y " * 600), call("echo", text="y")],  # hits the total-token budget
        [ANSWER.format("gamma")],
        [call("echo", text="a"), call("echo", text="b"), call("echo", text="c")],  # max_turns
        ['<tool_call>\n{"name": "echo", "arguments": {"text": 1}}\n</tool_call><|im_end|>', ANSWER.format("beta")],
    ]
    kw: dict[str, Any] = dict(tools=[echo, broken], tasks=TASKS, tokenizer=tok, max_turns=3, max_total_tokens=1200,
                          max_obs_tokens=1000)

    def enc(text: str) -> Any:
        return tok.encode(text, add_special_tokens=False).ids if tok is not None else text

    def run(batched: bool, custom_at: int | None) -> list[list[Any]]:
        venv = ToolVectorEnv([(lambda k=k: (Custom if k == custom_at else ToolEnv)(**kw)) for k in range(len(script))])

        async def go() -> list[list[Any]]:
            opts = {k: {"task_index": k % 3} for k in range(len(script))}
            if batched:
                first = await venv.areset_envs(opts, seeds={k: 10 + k for k in opts})
            else:
                first = {k: await venv.envs[k].areset(seed=10 + k, options=o) for k, o in opts.items()}
            log: list[list[Any]] = [[] for _ in script]
            for k, (obs, info) in first.items():
                log[k].append((obs.tolist() if isinstance(obs, np.ndarray) else obs, info))
            for turn in range(3):
                acts = {k: enc(t[turn]) for k, t in enumerate(script) if turn < len(t) and not venv.envs[k].done}
                if batched:
                    res = await venv.astep_active(acts)
                    out = {k: (r.obs, r.reward, r.terminated, r.truncated, r.info) for k, r in res.items()}
                else:
                    out = {k: await venv.envs[k].astep(a) for k, a in acts.items()}
                for k, (obs, rew, term, trunc, info) in out.items():
                    obs = obs.tolist() if isinstance(obs, np.ndarray) else obs
                    info = {key: v for key, v in info.items() if key not in ("trajectory", "turn_stats", "score")}
                    log[k].append((obs, rew, term, trunc, info))
            for k, e in enumerate(venv.envs):
                t = e.trajectory
                t_turns = [(x.observation, x.reward, x.action_span, x.observation_span, x.stats.calls,
                            x.stats.errors, [r.content for r in x.results]) for x in t.turns]
                log[k].append((t.token_ids, t.loss_mask, t.reward, t.end, t.answer, t_turns))
            return log

        return asyncio.run(go())

    alone = run(False, None)
    assert run(True, None) == alone
    assert run(True, 3) == alone
    assert [row[-1][3] for row in alone] == [EndReason.ANSWER, EndReason.ANSWER, EndReason.TOKEN_BUDGET,
                                              EndReason.ANSWER, EndReason.MAX_TURNS, EndReason.ANSWER]


def test_vector_env_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="num_envs"):
        ToolVectorEnv(tools=[echo], tasks=TASKS)
    venv = ToolVectorEnv(num_envs=2, tools=[echo], tasks=TASKS)
    venv.reset()
    with pytest.raises(ValueError, match="expected 2 actions"):
        venv.step(["x"])
    with pytest.raises(ValueError, match="needs at least one task"):
        ToolEnv(tools=[echo], tasks=[])
    env = ToolEnv(tools=[echo], tasks=TASKS)
    env.reset()
    with pytest.raises(TypeError, match="takes str actions"):
        env.step(3)


def test_vector_step_pauses_gc_only_during_the_batch() -> None:
    import gc

    from rlf_envs import runtime

    seen: list[bool] = []

    @tool
    async def probe() -> str:
        """Report whether the GC is enabled."""
        seen.append(gc.isenabled())
        return "ok"

    venv = ToolVectorEnv(num_envs=2, tools=[probe], tasks=TASKS)
    venv.reset(seed=0)
    assert gc.isenabled()
    venv.step([call("probe")] * 2)
    assert seen == [False, False] and gc.isenabled()  # held during the batch, back on after
    gc.disable()
    try:
        venv.step([call("probe")] * 2)
        assert not gc.isenabled()  # a GC the user turned off stays off
    finally:
        gc.enable()
    with runtime.paused_gc(), runtime.paused_gc():  # re-entrant
        assert not gc.isenabled()
    assert gc.isenabled()
    seen.clear()
    ToolVectorEnv(num_envs=1, tools=[probe], tasks=TASKS, pause_gc=False).reset(seed=0)
