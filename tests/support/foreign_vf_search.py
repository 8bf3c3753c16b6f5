"""The quickstart's search task written as a verifiers (v1) environment, in verifiers' own API and nothing of rlf's:
a `Taskset` (train/test splits of the quickstart world's questions), a `Toolset` (an MCP tool server verifiers
launches itself: `search` over the world's corpus, BM25), a `Task` scored by `@vf.reward` functions (and a
`@vf.metric`), and a `Harness` whose ReAct loop runs in-process (verifiers' contract: every model call goes through
the interception endpoint it is handed; the tools through the MCP URLs). `vf-eval foreign_vf_search` runs it against
any OpenAI-compatible server; rlf trains it with `rollout.environment: verifiers:foreign_vf_search`
(configs/foreign_vf_search.yaml). Its prompt, tool name and result text are the quickstart env's, so the
quickstart's SFT policy knows them (docs/guides/own-agent.md, "What the policy knows").

The tool server is started by verifiers as `python -m foreign_vf_search`: this module must be importable in that
process (PYTHONPATH=tests/support)."""

from __future__ import annotations

import json
import re
import string
from functools import cache
from typing import Any

import verifiers.v1 as vf
from pydantic import Field
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def _world() -> Any:
    from rlf_envs.data.search.generate import world_dir  # the quickstart world's files (generated once, cached)

    return world_dir("quickstart")


def normalize(s: str) -> str:
    s = "".join(c for c in s.lower() if c not in string.punctuation)
    return " ".join(w for w in s.split() if w not in ("a", "an", "the"))


class SearchData(vf.TaskData):
    answers: list[str]


class SearchTask(vf.Task[SearchData]):
    @vf.reward(weight=1.0)
    async def exact_match(self, trace: vf.Trace) -> float:
        """1 when the last reply's <answer> is one of the gold answers (Search-R1's normalisation)."""
        m = ANSWER.search(trace.last_reply or "")
        return float(m is not None and normalize(m.group(1)) in {normalize(a) for a in self.data.answers})

    @vf.reward(weight=0.0)
    async def answered(self, trace: vf.Trace) -> float:
        """Whether the last reply gave an <answer> at all (weight 0: reported, not trained on)."""
        return float(ANSWER.search(trace.last_reply or "") is not None)

    @vf.metric
    async def searches(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class SearchToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # the tool is `search`, bare: the name the quickstart's policy was trained with

    @vf.tool
    def search(self, query: str) -> str:
        """Search the encyclopedia; returns the best document."""
        index, docs = _index()
        import bm25s

        hits, _ = index.retrieve(bm25s.tokenize([query or "?"], stopwords="en", show_progress=False), k=1,
                                 show_progress=False)
        title, _, text = docs[int(hits[0][0])].partition("\n")
        return f"Doc 1(Title: {title}) {text}"


@cache
def _index() -> tuple[Any, list[str]]:
    import bm25s

    with open(_world() / "corpus.jsonl") as f:
        docs = [json.loads(line)["contents"] for line in f]
    index = bm25s.BM25()
    index.index(bm25s.tokenize(docs, stopwords="en", show_progress=False), show_progress=False)
    return index, docs


class SearchConfig(vf.TasksetConfig):
    split: str = "train"
    """train (9,000 questions) or test (200 people who never appear in a train question)."""
    num_tasks: int | None = None
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class SearchTaskset(vf.Taskset[SearchTask, SearchConfig]):
    def load(self) -> list[SearchTask]:
        if self.config.split not in ("train", "test"):
            raise ValueError(f"split must be train or test, got {self.config.split!r}")
        rows = [json.loads(line) for line in (_world() / f"{self.config.split}.jsonl").read_text().splitlines()]
        rows = rows[: self.config.num_tasks] if self.config.num_tasks else rows
        return [SearchTask(SearchData(id=r["id"], name=r["id"], prompt=f"Question: {r['question']}\n",
                                      answers=list(r["answers"])), self.config.task) for r in rows]

    @classmethod
    def toolsets(cls, config: SearchConfig) -> list[vf.Toolset]:
        return [SearchToolset(config.tools)]


class SearchHarnessConfig(vf.HarnessConfig):
    id: str = "foreign_vf_search"
    max_turns: int = Field(3, ge=1)
    max_tokens: int = Field(12, ge=1)


class SearchHarness(vf.Harness[SearchHarnessConfig]):
    """A ReAct loop in-process: the model (through `endpoint`) and the MCP tools (through `mcp_urls`)."""

    SUPPORTS_MCP = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: vf.TaskData, tool_interception_url: str | None = None
                     ) -> vf.ProgramResult:
        from contextlib import AsyncExitStack

        import openai

        _, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        async with AsyncExitStack() as stack:
            tools, dispatch, servers = await connect_mcp(
                {"mcpServers": {name: {"url": url} for name, url in mcp_urls.items()}}, stack)
            # the chat program qualifies tool names (`<server>_<tool>`); this harness offers them bare
            bare = {dispatch[t["function"]["name"]][1]: t["function"]["name"] for t in tools}
            for t in tools:
                t["function"]["name"] = dispatch[t["function"]["name"]][1]
            # retries: a connection to the interception server can time out while it grows its pool under load
            async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=2, timeout=120.0) as client:
                for _ in range(self.config.max_turns):
                    reply = await client.chat.completions.create(model=ctx.model, messages=messages, tools=tools,
                                                                 max_tokens=self.config.max_tokens)
                    msg = reply.choices[0].message
                    messages.append(msg.model_dump(exclude_none=True))
                    if not msg.tool_calls:
                        break
                    for call in msg.tool_calls:
                        try:
                            args = json.loads(call.function.arguments or "{}")
                            name = bare.get(call.function.name)
                            content: Any = (await call_mcp(servers, dispatch, name, args) if name is not None
                                            else f"unknown tool {call.function.name!r}")
                        except (ValueError, TypeError) as e:
                            content = f"bad arguments: {e}"
                        messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["SearchHarness", "SearchTaskset"]

if __name__ == "__main__":  # verifiers starts the tool server so
    SearchToolset.run()
