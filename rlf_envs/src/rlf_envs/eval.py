"""`python -m rlf_envs.eval --env rlf/Search-v0 --base-url URL --model NAME -n 200 --concurrency 64`:
an OpenAI-compatible chat endpoint (vLLM, SGLang, a hosted API) as the policy on an rlf env.

All episodes run concurrently on one event loop (`--concurrency` at a time, one env each), every request has
a deadline (`--request-timeout`) and a bounded number of retries (`--max-retries`, the `openai` client's
backoff on connection errors, timeouts, 429 and 5xx), every episode has a deadline (`--episode-timeout`).
An episode whose policy fails for good is recorded with `end_reason: "policy_error"` and reward 0, and the
run goes on; when every episode failed so, nothing was evaluated and the command exits 1 (see `EXIT_STATUS`).
Output in `--out` (default `runs/eval-<model>`): `trajectories/step_0.jsonl` (the same records as
training writes, source "api_eval"; `python -m rlf_envs.view DIR` shows them) and `summary.json`
(success, reward, tool calls, errors, tokens, latency).

How an env's text protocol meets a chat API (`ChatProtocol`):

- Prompt: a format with chat messages and native tool calls (qwen3/hermes) sends the task's messages and the
  env's tools as the API's `tools=`; the server's chat template renders them (for Qwen3 models exactly as
  the env renders its prompt in text mode). Other formats (search_r1) send the env's rendered prompt, with
  chat markup removed, as one user message: the protocol is described in the text.
- Reply -> env action: the reply's text content, plus, for native-tool formats, each `tool_calls` entry
  written as `<tool_call>{"name": ..., "arguments": ...}</tool_call>` so the env's own parser turns it into
  calls (arguments that are not JSON stay a string, so the env answers with its corrective observation, as
  it would for a model writing a bad call in text). Stop strings a server strips from the reply
  (`</search>`, `</answer>`) are put back.
- Env observation -> next messages: after native tool calls, one `tool` message per result (with the
  call's id); otherwise the assistant's text and a user message holding the env's observation text without
  chat markup (tool responses, `<information>` blocks, corrections).

Needs `pip install -e './rlf_envs[openai]'`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from pydantic import BaseModel

from rlf_envs.env.tool_env import ToolEnv
from rlf_envs.errors import RlfError
from rlf_envs.formats.qwen3 import IM_END, Qwen3Format
from rlf_envs.records import TrajectoryRecord, atomic_write_text, write_records
from rlf_envs.types import ActionKind, Trajectory, Turn

_MARKUP = re.compile(r"<\|im_start\|>[a-z]+\n?|<\|im_end\|>\n?|<think>\n*</think>\n*\Z")


def strip_chat_markup(text: str) -> str:
    """Text without ChatML turn markers (the chat API adds its own) and without an empty trailing think block."""
    return _MARKUP.sub("", text).strip()


@dataclass(slots=True)
class APICall:
    """One tool call from the API's `tool_calls` field; `arguments` is the raw string the model produced."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class Reply:
    content: str
    tool_calls: list[APICall] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0


class ChatProtocol:
    """Turns an env's prompt/observations into chat messages and a chat reply into the env's action text
    (see the module docstring)."""

    def __init__(self, env: ToolEnv) -> None:
        self.env = env
        self.native_tools = isinstance(env.format, Qwen3Format)
        self.stop = [s for s in env.format.stop_strings if not s.startswith("<|")]

    def tools(self) -> list[dict[str, Any]] | None:
        return [s.to_openai() for s in self.env.toolbox.specs] if self.native_tools else None

    def initial_messages(self, traj: Trajectory) -> list[dict[str, Any]]:
        fmt = self.env.format
        if isinstance(fmt, Qwen3Format):
            return [dict(m) for m in fmt.messages(traj.task, self.env.system_prompt)]
        return [{"role": "user", "content": strip_chat_markup(traj.prompt)}]

    def action_text(self, reply: Reply) -> str:
        text = reply.content
        if reply.finish_reason == "stop":  # an OpenAI server cuts the stop string off the reply
            for s in self.stop:
                opener = s.replace("</", "<", 1)
                if s.startswith("</") and text.rfind(opener) > text.rfind(s):
                    text += s
                    break
        if self.native_tools and reply.tool_calls:
            blocks = []
            for c in reply.tool_calls:
                try:
                    args: Any = json.loads(c.arguments) if c.arguments.strip() else {}
                except json.JSONDecodeError:
                    args = c.arguments  # the env's parser reports it as "arguments is not JSON"
                blocks.append("<tool_call>\n" + json.dumps({"name": c.name, "arguments": args}, ensure_ascii=False)
                              + "\n</tool_call>")
            text = (text.rstrip() + "\n" if text.strip() else "") + "\n".join(blocks)
        return text

    def next_messages(self, reply: Reply, turn: Turn) -> list[dict[str, Any]]:
        """What the conversation gets after a turn the env answered (not the last one)."""
        content = reply.content[: -len(IM_END)] if reply.content.endswith(IM_END) else reply.content
        if (self.native_tools and reply.tool_calls and turn.action.kind is ActionKind.TOOL_CALLS
                and len(turn.results) == len(reply.tool_calls)):
            calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                     for c in reply.tool_calls]
            msgs: list[dict[str, Any]] = [{"role": "assistant", "content": content or None, "tool_calls": calls}]
            msgs += [{"role": "tool", "tool_call_id": c.id, "content": r.content}
                     for c, r in zip(reply.tool_calls, turn.results, strict=True)]
            return msgs
        text = self.action_text(reply)
        return [{"role": "assistant", "content": text},
                {"role": "user", "content": strip_chat_markup(turn.observation)}]


class ChatPolicy:
    """An OpenAI-compatible chat endpoint through the official `openai` client (deadline + bounded retries)."""

    def __init__(self, base_url: str, model: str, api_key: str, request_timeout_s: float, max_retries: int,
                 temperature: float, max_tokens: int, extra_body: dict[str, Any] | None = None) -> None:
        try:
            from openai import AsyncOpenAI
        except ImportError as e:
            from rlf_envs.extras import pip_install

            raise RuntimeError(f"rlf_envs.eval needs the openai client: {pip_install('openai')}") from e
        self.client = AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=request_timeout_s,
                                  max_retries=max_retries)
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.extra_body = extra_body or {}

    async def reply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    stop: Sequence[str]) -> Reply:
        kwargs: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": self.temperature,
                                  "max_tokens": self.max_tokens}
        if tools:
            kwargs["tools"] = tools
        if stop:
            kwargs["stop"] = list(stop)
        if self.extra_body:
            kwargs["extra_body"] = self.extra_body
        t0 = time.perf_counter()
        resp = await self.client.chat.completions.create(**kwargs)
        latency = time.perf_counter() - t0
        if not resp.choices:
            raise PolicyError("the endpoint answered with no choices")
        choice = resp.choices[0]
        msg = choice.message
        calls = [APICall(id=c.id or f"call_{i}", name=c.function.name or "", arguments=c.function.arguments or "")
                 for i, c in enumerate(msg.tool_calls or []) if getattr(c, "function", None) is not None]
        usage = resp.usage
        return Reply(content=msg.content or "", tool_calls=calls, finish_reason=choice.finish_reason,
                     prompt_tokens=usage.prompt_tokens if usage else 0,
                     completion_tokens=usage.completion_tokens if usage else 0, latency_s=latency)

    async def aclose(self) -> None:
        await self.client.close()


class PolicyError(RlfError, RuntimeError):
    """The policy endpoint failed in a way retries did not fix."""


class EvalSummary(BaseModel):
    """summary.json of an API eval."""

    env: str
    model: str
    base_url: str
    episodes: int
    success_rate: float
    reward_mean: float
    reward_std: float
    tool_calls_mean: float
    tool_errors: int
    invalid_turns: int
    policy_errors: int
    policy_error_examples: list[str]
    end_reasons: dict[str, int]
    turns_mean: float
    requests: int
    prompt_tokens: int
    completion_tokens: int
    request_latency_p50_s: float
    request_latency_p95_s: float
    episode_seconds_mean: float
    wall_seconds: float


@dataclass(slots=True)
class EvalArgs:
    env: str
    base_url: str
    model: str
    n: int = 200
    concurrency: int = 64
    api_key: str = "EMPTY"
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    temperature: float = 0.0
    max_tokens: int = 512
    request_timeout_s: float = 60.0
    max_retries: int = 2
    episode_timeout_s: float = 600.0
    out: Path | None = None
    seed: int = 0
    progress: bool = True
    overwrite: bool = False


@dataclass(slots=True)
class EpisodeResult:
    record: TrajectoryRecord
    latencies: list[float]
    seconds: float


class ProgressLine:
    """A one-line progress bar on a TTY, plain periodic lines otherwise (logs, CI)."""

    def __init__(self, total: int, stream: TextIO, enabled: bool = True) -> None:
        self.total, self.stream, self.enabled = total, stream, enabled
        self.tty = enabled and stream.isatty()
        self.t0 = time.perf_counter()
        self.done = self.success = self.errors = 0
        self._last_line = -1.0

    def update(self, success: bool, error: bool) -> None:
        self.done += 1
        self.success += success
        self.errors += error
        if not self.enabled:
            return
        now = time.perf_counter() - self.t0
        text = (f"{self.done}/{self.total} episodes  success {self.success / self.done:.3f}  "
                f"policy errors {self.errors}  {now:.0f}s")
        if self.tty:
            width = 24
            fill = int(width * self.done / max(self.total, 1))
            self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {text}")
            if self.done == self.total:
                self.stream.write("\n")
        elif self.done == self.total or now - self._last_line >= 10 or self.done % max(1, self.total // 10) == 0:
            self.stream.write(text + "\n")
            self._last_line = now
        self.stream.flush()


async def run_episode(env: ToolEnv, proto: ChatProtocol, policy: ChatPolicy, task_index: int, seed: int,
                      episode_timeout_s: float, index: int) -> EpisodeResult:
    """One episode; never raises for a policy failure (the record says what went wrong)."""
    await env.areset(seed=seed, options={"task_index": task_index})
    traj = env.trajectory
    messages = proto.initial_messages(traj)
    usage: Counter[str] = Counter()
    latencies: list[float] = []
    error: str | None = None
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(episode_timeout_s):
            while True:
                reply = await policy.reply(messages, proto.tools(), proto.stop)
                latencies.append(reply.latency_s)
                usage.update(prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens,
                             requests=1)
                _, _, terminated, truncated, _ = await env.astep(proto.action_text(reply))
                if terminated or truncated:
                    break
                messages.extend(proto.next_messages(reply, traj.turns[-1]))
    except TimeoutError:
        error = f"episode deadline of {episode_timeout_s:g} s passed"
    except Exception as e:  # openai.APIError and friends after the client's bounded retries
        error = f"{type(e).__name__}: {str(e)[:300]}"
    seconds = time.perf_counter() - t0
    if error is not None:
        traj.reward = 0.0
    rec = TrajectoryRecord.from_trajectory(traj, source="api_eval", step=0, index=index, error=error,
                                           usage={**{k: float(v) for k, v in usage.items()},
                                                  "latency_s": sum(latencies)})
    return EpisodeResult(rec, latencies, seconds)


def _quantile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarize(args: EvalArgs, results: Sequence[EpisodeResult], wall_s: float) -> EvalSummary:
    recs = [r.record for r in results]
    n = max(len(recs), 1)
    rewards = [r.reward for r in recs]
    mean = sum(rewards) / n
    lat = [x for r in results for x in r.latencies]
    return EvalSummary(
        env=args.env, model=args.model, base_url=args.base_url, episodes=len(recs),
        success_rate=sum(r.success for r in recs) / n, reward_mean=mean,
        reward_std=math.sqrt(sum((x - mean) ** 2 for x in rewards) / n),
        tool_calls_mean=sum(r.num_tool_calls for r in recs) / n, tool_errors=sum(r.num_tool_errors for r in recs),
        invalid_turns=sum(t.kind == "invalid" for r in recs for t in r.turns),
        policy_errors=sum(r.error is not None for r in recs),
        policy_error_examples=sorted({r.error for r in recs if r.error is not None})[:5],
        end_reasons=dict(Counter(r.end_reason for r in recs)), turns_mean=sum(len(r.turns) for r in recs) / n,
        requests=int(sum(r.usage.get("requests", 0) for r in recs)),
        prompt_tokens=int(sum(r.usage.get("prompt_tokens", 0) for r in recs)),
        completion_tokens=int(sum(r.usage.get("completion_tokens", 0) for r in recs)),
        request_latency_p50_s=_quantile(lat, 0.5), request_latency_p95_s=_quantile(lat, 0.95),
        episode_seconds_mean=sum(r.seconds for r in results) / n, wall_seconds=wall_s,
    )


def make_env(env_id: str, env_kwargs: dict[str, Any]) -> ToolEnv:
    """The env, or a one-line ValueError naming what is wrong (an unknown id, a misspelt --env-kwargs key with
    the nearest accepted one, a value the env refuses)."""
    from rlf_envs.registration import check_env_kwargs, make_tool_env, register_envs

    register_envs()
    check_env_kwargs(env_id, env_kwargs, where="--env-kwargs")
    env: ToolEnv = make_tool_env(env_id, **env_kwargs)
    if env.token_mode:
        raise ValueError("rlf_envs.eval drives envs in text mode: do not pass a tokenizer in --env-kwargs")
    return env


async def evaluate(args: EvalArgs, stream: TextIO = sys.stderr) -> tuple[EvalSummary, list[TrajectoryRecord]]:
    """Run `args.n` episodes (tasks in the env's order, cycling) with `args.concurrency` at a time."""
    if args.n < 1 or args.concurrency < 1:
        raise ValueError("-n and --concurrency must be >= 1")
    envs = [make_env(args.env, args.env_kwargs) for _ in range(min(args.concurrency, args.n))]
    n_tasks = len(envs[0].tasks)
    policy = ChatPolicy(args.base_url, args.model, args.api_key, args.request_timeout_s, args.max_retries,
                        args.temperature, args.max_tokens)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(args.n):
        queue.put_nowait(i)
    results: list[EpisodeResult | None] = [None] * args.n
    progress = ProgressLine(args.n, stream, args.progress)

    async def worker(env: ToolEnv) -> None:
        proto = ChatProtocol(env)
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            res = await run_episode(env, proto, policy, i % n_tasks, args.seed + i, args.episode_timeout_s, i)
            results[i] = res
            progress.update(res.record.success, res.record.error is not None)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(e) for e in envs))
    finally:
        await policy.aclose()
    done = [r for r in results if r is not None]
    return summarize(args, done, time.perf_counter() - t0), [r.record for r in done]


def default_out(model: str) -> Path:
    return Path("runs") / ("eval-" + (re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("_") or "model"))


def run_eval(args: EvalArgs, stream: TextIO = sys.stderr) -> EvalSummary:
    """Evaluate and write `out/trajectories/step_0.jsonl` and `out/summary.json` (both atomically)."""
    from rlf_envs import runtime
    from rlf_envs.records import step_path

    out = args.out or default_out(args.model)
    if (out / "summary.json").exists() and not args.overwrite:  # before any episode: nothing is lost or wasted
        raise ValueError(f"{out} already holds an eval (summary.json): give another --out, or --overwrite to replace "
                         "it")
    summary, records = runtime.run(evaluate(args, stream))
    write_records(step_path(out, 0), records)
    atomic_write_text(out / "summary.json", summary.model_dump_json(indent=2))
    return summary


EXIT_STATUS = """exit status:
  0  at least one episode ran to an end of its own (an answer, the turn limit, ...); its success may still be 0,
     and the episodes that failed as below are counted in summary.json's policy_errors
  1  every episode failed on infrastructure, so nothing was evaluated: each one's requests to the endpoint
     failed after --max-retries (connection refused, DNS, timeouts, 4xx/5xx answers, a wrong --model) or it
     passed --episode-timeout. The files are written all the same; one line on stderr says why
  2  bad arguments, found before any request: an unknown --env, an --env-kwargs key the env does not take
     (with the nearest one it does), a value it refuses, a missing extra"""


def infrastructure_failure(summary: EvalSummary) -> str | None:
    """Why nothing was evaluated (every episode a policy error), or None."""
    if summary.episodes == 0 or summary.policy_errors < summary.episodes:
        return None
    example = summary.policy_error_examples[0] if summary.policy_error_examples else "no reply"
    return (f"all {summary.episodes} episodes failed on the policy endpoint {summary.base_url} (model "
            f"{summary.model!r}), so nothing was evaluated; e.g. {' '.join(example.split())[:200]}")


def _json_arg(text: str) -> dict[str, Any]:
    try:
        val = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(val, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"format\": \"qwen3\"}'")
    return val


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlf_envs.eval",
                                description="Evaluate an OpenAI-compatible chat endpoint as the policy on an rlf env.",
                                epilog=EXIT_STATUS, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", required=True, help="a registered env id, e.g. rlf/Search-v0")
    p.add_argument("--base-url", required=True, help="the endpoint's /v1 URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="model name the endpoint serves")
    p.add_argument("-n", type=int, default=200, help="episodes (tasks in the env's order, cycling)")
    p.add_argument("--concurrency", type=int, default=64, help="episodes in flight at once")
    p.add_argument("--api-key", default=None, help="API key (default: $OPENAI_API_KEY, else 'EMPTY')")
    p.add_argument("--env-kwargs", type=_json_arg, default={},
                   help='JSON for gymnasium.make, e.g. \'{"split": "test"}\'')
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=512, help="max tokens per reply")
    p.add_argument("--request-timeout", type=float, default=60.0, help="deadline of one request attempt (s)")
    p.add_argument("--max-retries", type=int, default=2, help="retries per request (connection errors, 429, 5xx)")
    p.add_argument("--episode-timeout", type=float, default=600.0, help="deadline of one whole episode (s)")
    p.add_argument("--out", type=Path, help="output dir (default runs/eval-<model>)")
    p.add_argument("--overwrite", action="store_true", help="replace an eval already in --out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    import os

    args = EvalArgs(env=a.env, base_url=a.base_url, model=a.model, n=a.n, concurrency=a.concurrency,
                    api_key=a.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY", env_kwargs=a.env_kwargs,
                    temperature=a.temperature, max_tokens=a.max_tokens, request_timeout_s=a.request_timeout,
                    max_retries=max(0, a.max_retries), episode_timeout_s=a.episode_timeout, out=a.out, seed=a.seed,
                    progress=not a.no_progress, overwrite=a.overwrite)
    try:
        summary = run_eval(args)
    except (ValueError, RuntimeError, ImportError) as e:  # ImportError: a missing extra (MissingDependency)
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    out = args.out or default_out(args.model)
    print(summary.model_dump_json(indent=2))
    print(f"wrote {out / 'summary.json'} and {out / 'trajectories' / 'step_0.jsonl'}", file=sys.stderr)
    why = infrastructure_failure(summary)
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
