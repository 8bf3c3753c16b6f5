"""A single-turn verifiers (v1) environment in the shape `vf-init` scaffolds (a Taskset and a Task with `@vf.reward`
functions), used to train through rlf unchanged. It runs with verifiers' shipped harnesses (`agent.harness.id: null`,
verifiers' chat program) or its own one-call harness (the default: in-process, no program to start). `fail` makes its
scorer misbehave for the failure-path tests: "raise" (a reward function raises), "nan" (it returns NaN), "odd" (it
raises on odd numbers only)."""

from __future__ import annotations

import re

import verifiers.v1 as vf


class ParityData(vf.TaskData):
    number: int


class ParityTaskConfig(vf.TaskConfig):
    fail: str = ""


class ParityTask(vf.Task[ParityData, vf.State, ParityTaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the reply says the right word (even / odd)."""
        if self.config.fail == "raise" or (self.config.fail == "odd" and self.data.number % 2):
            raise RuntimeError("the scorer's judge is unreachable")
        if self.config.fail == "nan":
            return float("nan")
        words = re.findall(r"[a-z]+", (trace.last_reply or "").lower())
        return float(("even" if self.data.number % 2 == 0 else "odd") in words)

    @vf.reward(weight=0.1)
    async def brevity(self, trace: vf.Trace) -> float:
        """Shorter replies score higher (at most 1)."""
        return 1.0 / (1.0 + len((trace.last_reply or "").split()))


class ParityConfig(vf.TasksetConfig):
    split: str = "train"
    num_tasks: int = 16
    task: ParityTaskConfig = ParityTaskConfig()


class ParityTaskset(vf.Taskset[ParityTask, ParityConfig]):
    def load(self) -> list[ParityTask]:
        start = 0 if self.config.split == "train" else 1000
        return [ParityTask(ParityData(id=f"{self.config.split}-{n}", prompt=f"Is {n} even or odd?", number=n),
                           self.config.task) for n in range(start, start + self.config.num_tasks)]


class ParityHarness(vf.Harness[vf.HarnessConfig]):
    """One chat completion through the interception endpoint, in-process."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: vf.TaskData, tool_interception_url: str | None = None
                     ) -> vf.ProgramResult:
        import openai

        _, prompt = self.resolve_prompt(data)
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": prompt}])
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["ParityHarness", "ParityTaskset"]
