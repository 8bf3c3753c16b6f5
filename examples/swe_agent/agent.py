"""A ReAct repair agent for rlf/SWE-v0 written as a plain OpenAI-SDK loop: no rlf env is stepped.

The agent gets the task's issue text, calls tools (bash, read_file, write_file, edit, submit) through the `openai`
SDK's native tool calls, runs them in its own sandbox session (`rlf_envs.envs.swe.SweSession`), and returns the
hidden tests' reward when it submits (or runs out of turns). Trained unmodified through rlf's policy endpoint:

    python -m rlf_train --config my.yaml --set rollout.agent=examples/swe_agent/agent.py:agent
    # with env: {id: rlf/SWE-v0}, and a model that can write tool calls (e.g. Qwen3)

The same function runs against any OpenAI-compatible server (`client` = openai.AsyncOpenAI(base_url=...)).
"""

import json

from rlf_envs.envs.swe.env import SweSession

SYSTEM = ("You are a software engineer fixing a bug in a Python repository. Explore with the tools, fix the "
          "library code, run the failing tests, then call submit().")
MAX_TURNS = 30


async def agent(task, client, max_turns: int = MAX_TURNS, model: str = "policy") -> float:
    ws = SweSession(task)
    try:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.question}]
        for _ in range(max_turns):
            reply = await client.chat.completions.create(model=model, messages=messages, tools=ws.openai_tools(),
                                                         max_tokens=1024)
            msg = reply.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                break  # a final answer without tools: grade what is there
            if any(c.function.name == "submit" for c in msg.tool_calls):
                break
            for call in msg.tool_calls:
                try:
                    args = json.loads(call.function.arguments or "{}")
                except json.JSONDecodeError:
                    out = "Error: the arguments are not JSON"
                else:
                    out = await ws.call(call.function.name, args)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": out})
        verdict = await ws.submit()
        if verdict.infra_failed:
            raise RuntimeError(f"infrastructure failure, not a reward: {verdict.error}")
        return verdict.value
    finally:
        await ws.aclose()
