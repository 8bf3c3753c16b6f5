"""rlf envs through SkyRL-Gym's own API (the real `skyrl-gym` package): `skyrl_gym.make`, `init`, `step`,
`BaseTextEnvStepOutput`; the messages render back to rlf's exact text with Qwen3's chat template."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

skyrl_gym = pytest.importorskip("skyrl_gym", reason="needs skyrl-gym (tox -e adapters-rl)")
transformers = pytest.importorskip("transformers", reason="needs transformers (tox -e adapters-rl)")

from repo_paths import REPO, SUPPORT  # noqa: E402
from skyrl_gym.envs.base_text_env import BaseTextEnv  # noqa: E402

from rlf_envs.adapters.skyrl import RlfSkyRLEnv, register_skyrl  # noqa: E402

TEMPLATE = SUPPORT / "assets" / "qwen3_chat_template.jinja"
ASSETS = REPO / "rlf_train" / "src" / "rlf_train" / "assets"
TOKENIZER = ASSETS / "tiny_tokenizer.json"
CALC = {"env_id": "rlf/Calculator-v0"}


def call(expr: str) -> str:
    args = json.dumps({"expression": expr})
    return f'<tool_call>\n{{"name": "calculator", "arguments": {args}}}\n</tool_call>'


@pytest.fixture(scope="module")
def qwen_template():  # type: ignore[no-untyped-def]
    """A transformers tokenizer carrying Qwen3's published chat template (shipped test asset), built offline."""
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER), eos_token="<|im_end|>")
    tok.chat_template = TEMPLATE.read_text()
    return tok


@pytest.fixture(scope="module", autouse=True)
def registered() -> None:
    assert register_skyrl() == "rlf"
    assert register_skyrl() == "rlf"  # idempotent


def make(extras: dict | None = None, **cfg):  # type: ignore[no-untyped-def]
    return skyrl_gym.make("rlf", env_config={**CALC, **cfg}, extras={"task_index": 0, **(extras or {})})


def test_make_gives_a_base_text_env_and_the_episode_follows_skyrls_contract(qwen_template) -> None:  # type: ignore[no-untyped-def]
    env = make(extras={"max_turns": 3})
    assert isinstance(env, BaseTextEnv) and env.spec.id == "rlf"
    prompt, info = env.init([])
    gold = env.env.trajectory.task.gold_answers[0]
    assert info["task_id"] == env.env.trajectory.task.id
    # SkyRL tokenises the prompt with the model's chat template: Qwen3's renders rlf's exact prompt text
    rendered = qwen_template.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    assert rendered == env.env.trajectory.prompt
    out = env.step(call("2 + 3"))
    assert set(out) >= {"observations", "reward", "done", "metadata"}
    assert out["done"] is False and out["reward"] == 0.0
    assert out["observations"] == [{"role": "user", "content": "<tool_response>\n5\n</tool_response>"}]
    assert out["metadata"]["tool_calls"] == 1 and out["metadata"]["action_kind"] == "tool_calls"
    out = env.step(f"<answer>{gold}</answer>")
    assert out["done"] is True and out["observations"] == [] and out["reward"] == 1.0
    assert out["metadata"]["end_reason"] == "answer" and out["metadata"]["score"] == 1.0
    assert env.get_metrics() == {"turns": 2, "tool_calls": 1, "tool_errors": 0, "return": 1.0, "score": 1.0,
                                 "answered": 1.0}
    # SkyRL (use_conversation_multi_turn) templates each observation's messages with the generation prompt and
    # appends them after the assistant's closing token: that is rlf's observation text
    obs_msgs = [{"role": "user", "content": "<tool_response>\n5\n</tool_response>"}]
    rendered = qwen_template.apply_chat_template(obs_msgs, add_generation_prompt=True, tokenize=False)
    assert "<|im_end|>\n" + rendered == env.env.trajectory.turns[0].observation
    env.close()


def test_raw_observations_carry_rlfs_text_verbatim(qwen_template) -> None:  # type: ignore[no-untyped-def]
    """observation='raw' (SkyRL use_conversation_multi_turn=False): prompt + actions + raw observation contents
    is rlf's text trajectory exactly, invalid turns' corrections included."""
    env = make(observation="raw")
    prompt, _ = env.init([])
    text = qwen_template.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    for action in [call("7 * 6") + "<|im_end|>", "no action here", call("1/0")]:
        out = env.step(action)
        assert not out["done"] and len(out["observations"]) == 1
        text += action + out["observations"][0]["content"]
    assert out["metadata"]["tool_errors"] == 1  # division by zero: an error observation, not a crash
    out = env.step("<answer>0</answer>")
    text += "<answer>0</answer>"
    assert out["done"] and text == env.env.trajectory.text


def test_per_turn_rewards_are_skyrl_step_rewards() -> None:
    env = make(env_kwargs={"turn_rewarder": {"valid_call_bonus": 0.25, "invalid_action_penalty": 0.5}})
    env.init([])
    gold = env.env.trajectory.task.gold_answers[0]
    rewards = [env.step(a)["reward"] for a in (call("1 + 1"), "???", f"<answer>{gold}</answer>")]
    assert rewards == [0.25, -0.5, 1.0]
    assert env.env.trajectory.per_turn_rewards == [0.25, -0.5, 0.0]


def test_a_skyrl_row_with_reward_spec_becomes_the_task() -> None:
    """SkyRL datasets carry `prompt` messages and `reward_spec.ground_truth`: the rlf env scores against it."""
    env = make(extras={"task_index": None, "reward_spec": {"method": "rule", "ground_truth": "12"}})
    env.extras.pop("task_index")
    prompt, _ = env.init([{"role": "user", "content": "What is 3 * 4?"}])
    assert prompt[-1] == {"role": "user", "content": "What is 3 * 4?"}  # the row's own messages, verbatim
    assert env.step("<answer>12</answer>")["reward"] == 1.0
    with pytest.raises(ValueError, match="prompt messages"):
        RlfSkyRLEnv(CALC, {"reward_spec": {"ground_truth": "1"}}).init([])


def test_search_env_through_skyrl() -> None:
    """rlf/Search-v0 (Search-R1's base-model tags, not ChatML): the prompt and observations are one user message
    holding rlf's text verbatim."""
    env = skyrl_gym.make("rlf", env_config={"env_id": "rlf/Search-v0"}, extras={"task_index": 0})
    prompt, _ = env.init([])
    assert prompt == [{"role": "user", "content": env.env.trajectory.prompt}]
    out = env.step("<search> capital </search>")
    assert not out["done"] and out["metadata"]["tool_calls"] == 1
    assert out["observations"] == [{"role": "user", "content": env.env.trajectory.turns[0].observation}]
    assert out["observations"][0]["content"].startswith("\n\n<information>Doc 1(Title:")
    env.close()


def test_steps_in_skyrl_executor_threads_do_not_mix_episodes() -> None:
    """SkyRL runs env.step in a thread pool: 8 episodes stepped from 4 threads stay separate."""
    envs = [make(extras={"task_index": k}) for k in range(8)]
    for e in envs:
        e.init([])

    def play(k: int) -> float:
        e = envs[k]
        e.step(call(f"{k} + 1"))
        return e.step(f"<answer>{e.env.trajectory.task.gold_answers[0]}</answer>")["reward"]

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(play, range(8))) == [1.0] * 8
    assert [e.env.trajectory.turns[0].observation.count(f"\n{k + 1}\n") for k, e in enumerate(envs)] == [1] * 8


def test_bad_config_and_actions_get_clear_errors() -> None:
    with pytest.raises(ValueError, match="env_id"):
        skyrl_gym.make("rlf", env_config={}, extras={})
    with pytest.raises(ValueError, match="text mode"):
        skyrl_gym.make("rlf", env_config={**CALC, "env_kwargs": {"tokenizer": object()}}, extras={})
    with pytest.raises(ValueError, match="observation"):
        make(observation="tokens")
    with pytest.raises(ValueError, match="rlf/Nope-v0"):
        skyrl_gym.make("rlf", env_config={"env_id": "rlf/Nope-v0"}, extras={})
    env = make()
    env.init([])
    with pytest.raises(TypeError, match="text"):
        env.step([1, 2, 3])
    assert env.step("<answer>x</answer>")["done"]
    with pytest.raises(RuntimeError, match="reset"):
        env.step("<answer>again</answer>")
