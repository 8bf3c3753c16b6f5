"""The quickstart's search task as a plain OpenAI-SDK agent: no rlf env, its own search function.

Trained unmodified through rlf's policy endpoint (`rollout.agent`, docs/guides/own-agent.md), on the
quickstart's config with the agent swapped in (`tox -e agent-example` runs exactly this; it needs the trainer's
`agents` extra, `pip install -e ./rlf_envs -e './rlf_train[agents]'`):
    python -m rlf_train --config configs/quickstart.yaml --set rollout.agent=examples/search_agent/agent.py:agent
It asks with the env's own prompt (`Question: ...`), tool name (`search`) and result text (`Doc 1(Title: ...)`):
the quickstart's policy is warm-started from scratch on the env's demos and knows nothing else.
The same code runs against any OpenAI-compatible server (a vLLM server with a Search-R1-style model).
"""

import json
import re
from functools import cache

import bm25s

from rlf_envs.data.search.generate import world_dir  # where the quickstart world's corpus is generated

TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Search the encyclopedia; returns the best document.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]


@cache
def _index() -> tuple[bm25s.BM25, list[str]]:
    with open(world_dir("quickstart") / "corpus.jsonl") as f:
        docs = [json.loads(line)["contents"] for line in f]
    index = bm25s.BM25()
    index.index(bm25s.tokenize(docs, stopwords="en", show_progress=False), show_progress=False)
    return index, docs


def search(query: str) -> str:
    index, docs = _index()
    hits, _ = index.retrieve(bm25s.tokenize([query], stopwords="en", show_progress=False), k=1, show_progress=False)
    title, _, text = docs[int(hits[0][0])].partition("\n")
    return f"Doc 1(Title: {title}) {text}"


async def agent(task, client) -> str | None:
    messages = [{"role": "user", "content": f"Question: {task.question}\n"}]
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=12)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            answer = re.search(r"<answer>(.*?)</answer>", msg.content or "", re.S)
            return answer.group(1).strip() if answer else None
        for call in msg.tool_calls:
            query = json.loads(call.function.arguments).get("query", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": search(query)})
    return None
