"""Hostile policies: a malformed action never raises out of `step` nor desynchronises a batch, and parsing
is linear in the action's length for every format."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlf_envs import runtime
from rlf_envs.env import ToolEnv, ToolVectorEnv
from rlf_envs.formats import Qwen3Format, SearchR1Format
from rlf_envs.tools import tool
from rlf_envs.types import Action, ActionKind
from tests.envs.env.test_tool_env import TASKS, call, echo, make_tokenizer

DEEP = '<tool_call>\n{"name": "echo", "arguments": {"text": "x", "n": ' + "[" * 1000 + "]" * 1000 + "}}\n</tool_call>"
DEEP_STR = '<tool_call>\n{"name": "echo", "arguments": "' + "[" * 100_000 + '"}\n</tool_call>'
BIG_INT = '<tool_call>\n{"name": "echo", "arguments": {"text": "x", "n": ' + "7" * 5000 + "}}\n</tool_call>"
GOOD = call("echo", text="hello")
ANSWER = "<answer>alpha</answer><|im_end|>"


class ExplodingFormat(Qwen3Format):
    """A user's format with a bug: parse raises on a marker."""

    def parse(self, text: str) -> Action:
        if "BOOM" in text:
            raise KeyError("bug in a user format")
        return super().parse(text)


def _vector(tokenizer: Any = None, n: int = 7) -> ToolVectorEnv:
    return ToolVectorEnv(
        [lambda: ToolEnv(tools=[echo], tasks=TASKS, tokenizer=tokenizer, format=ExplodingFormat(), max_turns=3,
                         max_total_tokens=1_000_000)] * n
    )


@pytest.mark.parametrize("token_mode", [False, True])
def test_mixed_good_and_malformed_actions_in_one_vector_batch(token_mode: bool) -> None:
    tok = make_tokenizer() if token_mode else None
    venv = _vector(tok)
    actions = [GOOD, DEEP, BIG_INT, DEEP_STR, "BOOM " + GOOD, ANSWER, GOOD]
    if tok is not None:
        actions = [tok.encode(a, add_special_tokens=False).ids for a in actions]  # type: ignore[misc]

    async def go() -> dict[int, Any]:
        await venv.areset_envs({i: {"task_index": 0} for i in range(venv.num_envs)})
        return await venv.astep_active(dict(enumerate(actions)))

    res = runtime.run(go())
    kinds = [r.info["action_kind"] for r in res.values()]
    assert kinds == ["tool_calls", "invalid", "invalid", "invalid", "invalid", "answer", "tool_calls"]
    for i in (1, 2, 3, 4):
        assert res[i].info["invalid"] and not res[i].done
        err = venv.envs[i].trajectory.turns[0].action.error or ""
        assert err, "an invalid turn says what was wrong"
    assert "nested too deeply" in (venv.envs[1].trajectory.turns[0].action.error or "")
    assert "4300 digits" in (venv.envs[2].trajectory.turns[0].action.error or "")
    assert "could not be parsed (KeyError)" in (venv.envs[4].trajectory.turns[0].action.error or "")
    for i in (0, 6):
        assert "hello" in venv.envs[i].trajectory.turns[0].results[0].content
    assert res[5].terminated and res[5].reward == 1.0
    # every env recorded exactly this one turn, and (token mode) its ids and mask line up
    for e in venv.envs:
        traj = e.trajectory
        assert len(traj.turns) == 1
        if token_mode:
            assert traj.token_ids is not None and traj.loss_mask is not None
            assert len(traj.token_ids) == len(traj.loss_mask)
            assert traj.turns[0].action_span is not None
    # the invalid envs go on normally
    nxt = runtime.run(venv.astep_active({i: (tok.encode(GOOD).ids if tok else GOOD) for i in (1, 2, 3, 4)}))
    assert all(r.info["action_kind"] == "tool_calls" for r in nxt.values())


def test_sync_vector_step_with_malformed_actions() -> None:
    venv = _vector(n=3)
    venv.reset(seed=0)
    obs, rew, term, trunc, info = venv.step([DEEP, "BOOM", BIG_INT])
    assert list(info["invalid"]) == [True, True, True]
    assert all("invalid" in o for o in obs)
    single = ToolEnv(tools=[echo], tasks=TASKS)
    single.reset(seed=0)
    _, _, _, _, info1 = single.step(DEEP)
    assert info1["invalid"]


def test_a_failure_that_escapes_rewinds_every_env_of_the_batch() -> None:
    """A cancelled batch (or a bug) must not leave some envs with a half-recorded turn."""

    @tool
    async def hang(seconds: float) -> str:
        """Sleep."""
        await asyncio.sleep(seconds)
        return "done"

    tok = make_tokenizer()
    venv = ToolVectorEnv([lambda: ToolEnv(tools=[hang, echo], tasks=TASKS, tokenizer=tok, max_turns=3)] * 3)
    slow = tok.encode(call("hang", seconds=30)).ids

    async def go() -> None:
        first = await venv.areset_envs({i: {"task_index": 0} for i in range(3)})
        before = [list(e.trajectory.token_ids or []) for e in venv.envs]
        assert all(len(b) == len(first[i][0]) for i, b in enumerate(before))
        task = asyncio.ensure_future(venv.astep_active({0: tok.encode(GOOD).ids, 1: slow, 2: tok.encode(ANSWER).ids}))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 10  # the cancellation reaches rlf's loop thread asynchronously
        while any(e.trajectory.turns for e in venv.envs) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for e, b in zip(venv.envs, before, strict=True):
            traj = e.trajectory
            assert traj.turns == [] and traj.token_ids == b and len(traj.loss_mask or []) == len(b)
            assert not e.done
        again = await venv.astep_active({i: tok.encode(GOOD).ids for i in range(3)})
        assert all(r.info["action_kind"] == "tool_calls" for r in again.values())

    asyncio.run(go())


_ENVS: dict[str, ToolEnv] = {}


def _env(fmt: str) -> ToolEnv:
    if fmt not in _ENVS:
        _ENVS[fmt] = ToolEnv(tools=[echo], tasks=TASKS, format=fmt, max_turns=1000, max_total_tokens=10**9)
    env = _ENVS[fmt]
    if env.done:
        env.reset(seed=0)
    return env


_TAGS = ["<tool_call>", "</tool_call>", "<answer>", "</answer>", "<search>", "</search>", "<think>", "</think>",
         "<|im_end|>", '{"name": "echo", "arguments": ', "{", "}", "[", "]", '"', "\\", "9" * 50, "\ud800", "\x00",
         "[" * 1200, "9" * 4400]
hostile_text = st.lists(st.one_of(st.sampled_from(_TAGS), st.text(max_size=20)), max_size=40).map("".join)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=hostile_text, fmt=st.sampled_from(["qwen3", "search_r1"]))
def test_random_and_adversarial_actions_never_raise_out_of_step(text: str, fmt: str) -> None:
    env = _env(fmt)
    obs, reward, terminated, truncated, info = env.step(text)
    assert isinstance(obs, str) and info["action_kind"] in {k.value for k in ActionKind}
    assert terminated or truncated or obs  # a running episode always answers something


# -- linear parsing -------------------------------------------------------------------------------------

ADVERSARIAL: dict[str, tuple[Callable[[], Any], str]] = {
    "qwen3 repeated <tool_call>": (Qwen3Format, "<tool_call>"),
    "qwen3 repeated <answer>": (Qwen3Format, "<answer>"),
    "qwen3 no_call repeated <think>": (lambda: Qwen3Format(answer_mode="no_call"), "<think>"),
    "qwen3 <tool_call>{ repeated": (Qwen3Format, '<tool_call>{"a": '),
    "search_r1 repeated <search>": (SearchR1Format, "<search>"),
    "search_r1 repeated <answer>": (SearchR1Format, "<answer>"),
    "search_r1 closed answer + open searches": (SearchR1Format, "<search>x</answer>"),
}


def _per_byte(fmt: Any, unit: str, size: int, repeats: int) -> float:
    text = unit * (size // len(unit))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fmt.parse(text)
        best = min(best, time.perf_counter() - t0)
    return best / len(text)


@pytest.mark.parametrize("case", list(ADVERSARIAL))
def test_parsing_is_linear_in_the_action_length(case: str) -> None:
    """A 1 MB adversarial action costs about as much per byte as a 1 KB one (quadratic parsing: ~1000x).
    A 64 KB step first, so that quadratic code fails in seconds instead of parsing 1 MB for minutes."""
    make, unit = ADVERSARIAL[case]
    fmt = make()
    small = _per_byte(fmt, unit, 1 << 10, repeats=50)
    for size in (64 << 10, 1 << 20):
        ratio = _per_byte(fmt, unit, size, repeats=3) / small
        assert ratio < 20, f"{case}: {size} bytes cost {ratio:.0f}x per byte what 1 KB costs (not linear)"


def test_tag_scanning_matches_the_regex_semantics() -> None:
    import re

    from rlf_envs.formats.tags import first_inner, inners, strip_blocks, tagged

    rx = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
    samples = [
        "<search>a</search><answer>b</answer>",
        "<answer>x <search>q</search> y",
        "<search>a <answer>b</search> c</answer>",
        "<search><search>a</search></search>",
        "</search><search></search><answer>",
        "<answer>1</answer><answer>2</answer><search>",
    ]
    for s in samples:
        assert list(tagged(s, "search", "answer")) == [(m.group(1), m.group(2)) for m in rx.finditer(s)], s
        assert inners(s, "search") == re.findall(r"<search>(.*?)</search>", s, flags=re.DOTALL)
        m = re.search(r"<answer>(.*?)</answer>", s, flags=re.DOTALL)
        assert first_inner(s, "answer") == (m.group(1) if m else None)
        assert strip_blocks(s, "search") == re.sub(r"<search>.*?</search>", "", s, flags=re.DOTALL)


def test_tool_output_with_a_lone_surrogate_reaches_a_token_mode_env() -> None:
    @tool
    async def weird() -> str:
        """Returns text JSON-decoded from a lone surrogate escape."""
        return json.loads('"a\\ud800b"')

    tok = make_tokenizer()
    env = ToolEnv(tools=[weird], tasks=TASKS, tokenizer=tok)
    env.reset(seed=0)
    obs, *_, info = env.step(tok.encode(call("weird")).ids)
    assert info["tool_errors"] == 0 and "a?b" in tok.decode(obs.tolist())
