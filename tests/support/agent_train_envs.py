"""Agents and an env for the trainer's agent-source tests (loaded by `rollout.agent` / `env.imports`).

`rlf_test/AgentQA-v0`: tasks only (the agent's code makes the episodes), Qwen3 format, exact-match verifier.
`two_calls`: asks twice; on odd tasks its second call drops the system message (a history break: two
segments), and its reward is its own (1.0 when the first reply's text has an even length), so GRPO groups
have mixed rewards with a random policy.
"""

from __future__ import annotations

from typing import Any

import gymnasium

from rlf_envs.env import ToolEnv
from rlf_envs.types import Task

AGENT_QA_ID = "rlf_test/AgentQA-v0"
SYSTEM = {"role": "system", "content": "Be brief."}


def make_agent_qa(split: str = "train", tokenizer: Any = None, max_turns: int = 1, max_total_tokens: int = 256,
                  max_obs_tokens: int = 64) -> ToolEnv:
    n = 6 if split == "train" else 4
    tasks = [{"id": f"{split}-{i}", "question": f"Name item {i}.", "answers": [f"item{i}"]} for i in range(n)]
    return ToolEnv(tasks=tasks, format="qwen3", tokenizer=tokenizer, max_turns=max_turns,
                   max_total_tokens=max_total_tokens, max_obs_tokens=max_obs_tokens)


if AGENT_QA_ID not in gymnasium.registry:
    gymnasium.register(AGENT_QA_ID, entry_point=make_agent_qa)


async def two_calls(task: Task, client: Any) -> float:
    from rlf_train.rollout.agent_runner import AgentResult

    messages = [SYSTEM, {"role": "user", "content": task.question}]
    r = await client.chat.completions.create(model=client.model, messages=messages)
    first = r.choices[0].message.content or ""
    index = int(task.id.split("-")[1])
    follow = {"role": "user", "content": "Again."}
    if index % 2:  # the context manager drops the system message: a new segment
        messages = [messages[1], {"role": "assistant", "content": first}, follow]
    else:
        messages = [*messages, r.choices[0].message.model_dump(exclude_none=True), follow]
    await client.chat.completions.create(model=client.model, messages=messages)
    return AgentResult(reward=1.0 if len(first) % 2 == 0 else 0.0).reward or 0.0
