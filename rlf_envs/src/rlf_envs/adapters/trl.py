"""rlf envs in TRL's `GRPOTrainer` (`pip install -e './rlf_envs[trl]'`).

Two ways in, both taking any registered rlf env id and its kwargs:

- `RlfRollout` (token exact, recommended): TRL's `rollout_func`. Each call runs one multi-turn episode per
  prompt of TRL's batch (`rlf_envs.env.episodes.run_token_episodes`: all episodes in lock-step, every
  tool call of a turn concurrent) and returns `prompt_ids`, `completion_ids` (actions and observations, the
  env's exact ids), `logprobs` (0 on observation tokens) and `env_mask` (the env's loss mask; TRL multiplies
  its completion mask by it, so the loss covers the policy's tokens only), plus `rlf_reward` and episode
  stats that TRL passes to reward functions: use `rlf_reward` as the reward function. Generation: by default
  the model TRL trains, in this process (transformers' `generate` with the env's stop strings; CPU works);
  or your own `generate=` / `generate_batch=` (e.g. an async client of a vLLM server). TRL's built-in vLLM
  generation (`use_vllm=True`) takes no per-call stop strings, so it is refused with a message, not used.
- `environment_factory(env_id, ...)`: a class for TRL's own tool loop (`GRPOTrainer(environment_factory=...)`):
  the env's tools become its methods (rlf's tool caller runs them: deadlines, validation, output caps, MCP),
  and `rlf_env_reward` scores each completion with the env's verifier. TRL renders and tokenises the tool
  turns itself with the model's chat template, so this path is not rlf's token-exact trajectory, it needs a
  chat template with tool calling (Qwen3-style), and the env's format is not used for observations.

What TRL cannot carry: one scalar reward per completion, so rlf's per-turn rewards are added into it (a
warning says so once when they are non-zero).
"""

from __future__ import annotations

import inspect
import keyword
import logging
import warnings
from collections.abc import Sequence
from typing import Any

from rlf_envs import runtime
from rlf_envs.adapters import require_trainer
from rlf_envs.env.episodes import GenerateBatchFn, GenerateFn, Generation, TokenEpisode, run_token_episodes_sync
from rlf_envs.env.tool_env import ToolEnv
from rlf_envs.registration import make_tool_env
from rlf_envs.types import Task, ToolSpec

log = logging.getLogger(__name__)

#: the extra fields `RlfRollout` returns beside TRL's required keys (TRL hands them to reward functions)
REWARD_FIELD = "rlf_reward"
STAT_FIELDS = ("rlf_outcome", "rlf_turns", "rlf_tool_calls", "rlf_tool_errors", "rlf_end_reason")


def rlf_reward(completions: Sequence[Any], rlf_reward: Sequence[float], **kwargs: Any) -> list[float]:
    """TRL reward function: the reward rlf's env gave each episode (the verifier's score plus per-turn
    rewards), as returned by `RlfRollout` in the `rlf_reward` field."""
    if len(rlf_reward) != len(completions):
        raise ValueError(f"rlf_reward has {len(rlf_reward)} values for {len(completions)} completions: is "
                         "RlfRollout the trainer's rollout_func?")
    return [float(r) for r in rlf_reward]


def _prompt_key(prompt: Any) -> str:
    """The text a TRL prompt is looked up by: the prompt itself, or a conversation's last user message."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        content = prompt[-1].get("content")
        if isinstance(content, str):
            return content
    raise TypeError(f"a TRL prompt must be a string or a list of chat messages, got {type(prompt).__name__}")


class _TaskIndex:
    """The env's tasks by the prompt text TRL will hand back (see `RlfRollout.dataset`)."""

    def __init__(self, env_id: str, env_kwargs: dict[str, Any]) -> None:
        probe = make_tool_env(env_id, **env_kwargs)
        try:
            self.tasks: list[Task] = list(probe.tasks)
            self.conversational: list[list[dict[str, str]]] | None = None
            messages = getattr(probe.format, "messages", None)
            if callable(messages):
                self.conversational = [[dict(m) for m in messages(t, probe.system_prompt)] for t in self.tasks]
        finally:
            probe.close()
        self.by_key: dict[str, Task] = {}
        clashes = 0
        for k, t in enumerate(self.tasks):
            for key in {t.question, *([self.conversational[k][-1]["content"]] if self.conversational else [])}:
                old = self.by_key.setdefault(key, t)
                clashes += old is not t and old.ground_truth != t.ground_truth
        if clashes:
            warnings.warn(f"{env_id}: {clashes} tasks share a question with another task that has a different "
                          "ground truth; TRL's prompts carry only the text, so the first such task is used",
                          stacklevel=3)

    def task(self, prompt: Any) -> Task:
        key = _prompt_key(prompt)
        t = self.by_key.get(key)
        if t is None:
            raise KeyError(f"this prompt is not a question of the env's tasks: {key[:120]!r}; build TRL's "
                           "train_dataset with RlfRollout.dataset() (or pass the env its tasks= in env_kwargs)")
        return t


class RlfRollout:
    """TRL `rollout_func` running rlf episodes (see the module docstring).

    Args:
        env_id: any registered rlf env id, e.g. "rlf/Search-v0".
        env_kwargs: keyword arguments for `gymnasium.make` (not `tokenizer`: TRL's processing class is used).
        generate / generate_batch: the policy (see `rlf_envs.env.episodes`); default: the model TRL
            trains, in this process.
        max_tokens_per_turn: the most tokens one policy turn may generate. The whole completion (actions and
            observations) is capped at TRL's `max_completion_length`.
        tokenizer: the tokenizer the env encodes with (default: the trainer's processing class). It must be
            the one the policy generates with.
    """

    def __init__(self, env_id: str, env_kwargs: dict[str, Any] | None = None, *,
                 generate: GenerateFn | None = None, generate_batch: GenerateBatchFn | None = None,
                 max_tokens_per_turn: int = 256, tokenizer: Any = None) -> None:
        if generate is not None and generate_batch is not None:
            raise TypeError("give at most one of generate= or generate_batch=")
        self.env_id = env_id
        self.env_kwargs = dict(env_kwargs or {})
        if "tokenizer" in self.env_kwargs:
            raise ValueError("env_kwargs must not hold a tokenizer: RlfRollout uses tokenizer= (default: the "
                             "trainer's processing class)")
        self.generate = generate
        self.generate_batch = generate_batch
        self.max_tokens_per_turn = max_tokens_per_turn
        self.tokenizer = tokenizer
        self._index = _TaskIndex(env_id, self.env_kwargs)
        self._envs: list[ToolEnv] = []
        self._warned_per_turn = False
        self.last_episodes: list[TokenEpisode] = []  # the latest call's episodes (for logs and tests)

    @property
    def tasks(self) -> list[Task]:
        return self._index.tasks

    def dataset(self, n: int | None = None, conversational: bool = False) -> Any:
        """A `datasets.Dataset` of the env's tasks for TRL's `train_dataset`: column `prompt` (the question,
        or with `conversational=True` the env format's chat messages, e.g. Qwen3's question plus answer
        instruction) and `rlf_task_id`. The env renders its own prompt from the task either way."""
        require_trainer("trl")
        import datasets  # a dependency of trl
        tasks = self.tasks[:n] if n is not None else self.tasks
        if conversational:
            if self._index.conversational is None:
                raise ValueError(f"{self.env_id}'s format has no chat messages; use conversational=False")
            prompts: list[Any] = self._index.conversational[: len(tasks)]
        else:
            prompts = [t.question for t in tasks]
        return datasets.Dataset.from_dict({"prompt": prompts, "rlf_task_id": [t.id for t in tasks]})

    def _pool(self, n: int, tokenizer: Any) -> list[ToolEnv]:
        while len(self._envs) < n:
            self._envs.append(make_tool_env(self.env_id, tokenizer=tokenizer, **self.env_kwargs))
        return self._envs[:n]

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any] | None]:
        if not prompts:
            raise ValueError("TRL called the rollout function with no prompts")
        tasks = [self._index.task(p) for p in prompts]
        tokenizer = self.tokenizer if self.tokenizer is not None else trainer.processing_class
        gen, gen_batch = self.generate, self.generate_batch
        if gen is None and gen_batch is None:
            gen_batch = transformers_generate_batch(trainer, tokenizer)
        envs = self._pool(len(tasks), tokenizer)
        episodes = run_token_episodes_sync(
            envs, gen, generate_batch=gen_batch, options=[{"task": t} for t in tasks],
            max_tokens_per_turn=self.max_tokens_per_turn,
            max_completion_tokens=getattr(trainer.args, "max_completion_length", None))
        self.last_episodes = episodes
        if not self._warned_per_turn and any(any(ep.per_turn_rewards) for ep in episodes):
            self._warned_per_turn = True
            warnings.warn("TRL takes one reward per completion: rlf's per-turn rewards are added into it "
                          "(rlf_reward = verifier score + sum of per-turn rewards)", stacklevel=2)
        return {
            "prompt_ids": [ep.prompt_ids for ep in episodes],
            "completion_ids": [ep.completion_ids for ep in episodes],
            "logprobs": [ep.logprobs for ep in episodes] if all(ep.logprobs is not None for ep in episodes) else None,
            "env_mask": [ep.env_mask for ep in episodes],
            REWARD_FIELD: [ep.reward for ep in episodes],
            "rlf_outcome": [ep.outcome for ep in episodes],
            "rlf_turns": [ep.turns for ep in episodes],
            "rlf_tool_calls": [ep.tool_calls for ep in episodes],
            "rlf_tool_errors": [ep.tool_errors for ep in episodes],
            "rlf_end_reason": [ep.end_reason for ep in episodes],
        }

    def close(self) -> None:
        for e in self._envs:
            e.close()
        self._envs.clear()


def transformers_generate_batch(trainer: Any, tokenizer: Any) -> GenerateBatchFn:
    """A `generate_batch` that samples from the model TRL trains, in this process (transformers' `generate`,
    left-padded batch, the trainer's temperature/top_p/top_k, stopping at the env's stop strings or EOS)."""
    if getattr(trainer, "use_vllm", False):
        raise NotImplementedError(
            "RlfRollout with use_vllm=True: TRL's vLLM generation takes no per-call stop strings, which rlf's "
            "multi-turn episodes need; pass RlfRollout(generate=...) with your own vLLM client (any async "
            "function returning rlf_envs.env.episodes.Generation), or train with use_vllm=False")
    import torch

    args = trainer.args
    temperature = float(getattr(args, "temperature", 1.0))
    top_p = float(getattr(args, "top_p", 1.0))
    top_k = int(getattr(args, "top_k", 0) or 0)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos

    async def generate_batch(contexts: list[list[int]], max_tokens: list[int], stop: list[str]) -> list[Generation]:
        model = trainer.accelerator.unwrap_model(trainer.model)
        device = next(model.parameters()).device
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), pad, dtype=torch.long)
        attn = torch.zeros((len(contexts), width), dtype=torch.long)
        for i, c in enumerate(contexts):
            ids[i, width - len(c):] = torch.tensor(c, dtype=torch.long)
            attn[i, width - len(c):] = 1
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max(max_tokens),
                    do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                    top_p=top_p if temperature > 0 else None, top_k=top_k if temperature > 0 else None,
                    stop_strings=list(stop) or None, tokenizer=tokenizer, eos_token_id=eos, pad_token_id=pad,
                    output_scores=True, return_dict_in_generate=True)
        finally:
            model.train(was_training)
        new = out.sequences[:, width:].tolist()
        scores = torch.stack(out.scores, dim=1).float().log_softmax(-1) if out.scores else None  # [B, T, V]
        gens = []
        for i, row in enumerate(new):
            n = _stop_at(row[: max_tokens[i]], stop, eos, tokenizer)
            toks = row[:n]
            lps = ([float(scores[i, k, t]) for k, t in enumerate(toks)] if scores is not None else None)
            finish = "stop" if n < len(row[: max_tokens[i]]) or (toks and _ends(toks, stop, eos, tokenizer)) \
                else "length"
            gens.append(Generation(toks, lps, finish))
        return gens

    return generate_batch


def _ends(toks: list[int], stop: Sequence[str], eos: int | None, tokenizer: Any) -> bool:
    if eos is not None and toks[-1] == eos:
        return True
    tail = tokenizer.decode(toks[-8:], skip_special_tokens=False)
    return any(s and s in tail for s in stop)


def _stop_at(row: list[int], stop: Sequence[str], eos: int | None, tokenizer: Any) -> int:
    """How many tokens of a generated row form the action: up to and including the first EOS or the token
    that completes a stop string (transformers pads a row that stopped early)."""
    for k in range(len(row)):
        if _ends(row[: k + 1], stop, eos, tokenizer):
            return k + 1
    return len(row)


# -- TRL's own tool loop: `GRPOTrainer(environment_factory=...)` --------------------------------------------------

#: what TRL's tool loop loses against `RlfRollout` (warned once per class when an instance is built)
TOOL_LOOP_DEGRADES = (
    "TRL's tool loop (environment_factory) is not rlf's token-exact trajectory: TRL renders tool calls and results "
    "with the model's chat template and tokenises them itself, the env's format and observation rendering are not "
    "used, a turn's tool calls run one after another (TRL calls sync tools in a loop), the env's max_turns and "
    "per-turn rewards do not apply (TRL's max_tool_calling_iterations caps the loop), and the verifier scores the "
    "last assistant message alone. Use RlfRollout (rollout_func) for exact token masks and parallel tools."
)

_JSON_TO_PY: dict[str, type] = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list,
                                "object": dict}


def _tool_method(spec: ToolSpec) -> Any:
    """A method named after the rlf tool, with a signature, type hints and a Google-style docstring built from its
    JSON schema (TRL reads them with transformers' `get_json_schema` to show the tool to the model); calling it runs
    the tool through the env's rlf tool caller (validation, deadline, retries, output cap, MCP)."""
    name = spec.name
    if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_") or name in ("reset", "get_reward"):
        raise ValueError(f"rlf tool {name!r} cannot be a method of TRL's environment class (TRL exposes public "
                         "methods as tools by name): rename the tool, or use RlfRollout (rollout_func)")
    props: dict[str, Any] = dict(spec.parameters.get("properties") or {})
    required = set(spec.parameters.get("required") or ())
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    hints: dict[str, Any] = {}
    doc_args = []
    for pname in sorted(props, key=lambda n: n not in required):  # required first, as Python needs
        pdef = props[pname] if isinstance(props[pname], dict) else {}
        if not pname.isidentifier() or keyword.iskeyword(pname):
            raise ValueError(f"rlf tool {name!r}: argument {pname!r} is not a Python identifier, so TRL's tool "
                             "loop cannot call it; use RlfRollout (rollout_func)")
        jtype = pdef.get("type")
        py = _JSON_TO_PY.get(jtype, str) if isinstance(jtype, str) else str
        hints[pname] = py
        default = inspect.Parameter.empty if pname in required else pdef.get("default")
        params.append(inspect.Parameter(pname, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=py))
        desc = " ".join(str(pdef.get("description") or pname).split())
        doc_args.append(f"    {pname}: {desc}")
    hints["return"] = str

    def method(self: RlfToolEnvironment, **arguments: Any) -> str:
        return self._call_tool(name, arguments)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = " ".join((spec.description or f"Call the {name} tool.").split()) + (
        "\n\nArgs:\n" + "\n".join(doc_args) if doc_args else "")
    method.__annotations__ = hints
    method.__signature__ = inspect.Signature(params, return_annotation=str)  # type: ignore[attr-defined]
    return method


class RlfToolEnvironment:
    """Base of the classes `environment_factory` builds: one rlf env (text mode) per instance; TRL calls `reset`
    with the dataset row, the env's tools as methods, and `rlf_env_reward` scores the final answer."""

    env_id: str = ""
    env_kwargs: dict[str, Any] = {}
    _index: _TaskIndex
    _by_id: dict[str, Task] = {}
    _warned = False

    def __init__(self) -> None:
        cls = type(self)
        if not cls.env_id:
            raise TypeError("build the class with rlf_envs.adapters.trl.environment_factory(env_id, ...)")
        if not cls._warned:
            cls._warned = True
            warnings.warn(TOOL_LOOP_DEGRADES, stacklevel=2)
        self._env = make_tool_env(cls.env_id, **cls.env_kwargs)
        self.task: Task | None = None
        self.tool_calls = 0
        self.tool_errors = 0
        self.reward: float | None = None
        self.answer: str | None = None  # the text the verifier scored

    @classmethod
    def dataset(cls, n: int | None = None) -> Any:
        """A `datasets.Dataset` for TRL's `train_dataset`: `prompt` (one user message: the task's question; TRL
        adds the tool schemas with the chat template) and `rlf_task_id` (what `reset` finds the task by)."""
        require_trainer("trl")
        import datasets
        tasks = cls._index.tasks[:n] if n is not None else cls._index.tasks
        return datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": t.question}] for t in tasks],
                                           "rlf_task_id": [t.id for t in tasks]})

    def reset(self, **row: Any) -> None:
        """Start an episode on the row's task (`rlf_task_id`, else its prompt's question). Returns None: the
        prompt is the row's."""
        tid = row.get("rlf_task_id")
        if tid is not None:
            task = type(self)._by_id.get(str(tid))
            if task is None:
                raise KeyError(f"{self.env_id} has no task with id {tid!r}; build the dataset with "
                               f"{type(self).__name__}.dataset()")
        elif "prompt" in row:
            task = type(self)._index.task(row["prompt"])
        else:
            raise KeyError("the dataset row has neither rlf_task_id nor prompt")
        self._env.reset(options={"task": task})
        self.task, self.tool_calls, self.tool_errors, self.reward, self.answer = task, 0, 0, None, None

    def _call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        if self.task is None:
            raise RuntimeError("a tool was called before reset()")
        result = runtime.run(self._env.toolbox.call(name, arguments))
        self.tool_calls += 1
        self.tool_errors += not result.ok
        if not result.ok:  # TRL counts a raised exception as a failed call and shows its text to the model
            raise RuntimeError(result.content)
        return result.content

    # every public method is a tool to TRL: the rest is private
    def _score(self, answer: str) -> float:
        """The env's verifier on the final answer (the env's format parses it: e.g. `<answer>...</answer>`)."""
        if self.task is None:
            raise RuntimeError("the answer was scored before reset()")
        if self.reward is None:
            self.answer = answer
            _, reward, _, _, _ = self._env.step(answer)
            self.reward = float(reward)
        return self.reward

    def _close(self) -> None:
        self._env.close()


def environment_factory(env_id: str, env_kwargs: dict[str, Any] | None = None) -> type[RlfToolEnvironment]:
    """A class for `GRPOTrainer(environment_factory=...)` (TRL >= 1.16): each of the env's tools is a method of it,
    so TRL's tool loop calls rlf's tools; score with `reward_funcs=rlf_env_reward`. Not token exact: see
    `TOOL_LOOP_DEGRADES` (warned when the first instance is built)."""
    kwargs = dict(env_kwargs or {})
    if "tokenizer" in kwargs:
        raise ValueError("env_kwargs must not hold a tokenizer: in TRL's tool loop TRL tokenises, the env runs "
                         "in text mode")
    index = _TaskIndex(env_id, kwargs)
    probe = make_tool_env(env_id, **kwargs)
    try:
        specs = list(probe.toolbox.specs)
    finally:
        probe.close()
    if not specs:
        raise ValueError(f"{env_id} has no tools: TRL's tool loop needs at least one")
    attrs: dict[str, Any] = {"env_id": env_id, "env_kwargs": kwargs, "_index": index,
                             "_by_id": {t.id: t for t in index.tasks}, "_warned": False}
    for spec in specs:
        attrs[spec.name] = _tool_method(spec)
    name = "Rlf" + "".join(c for c in env_id.split("/")[-1].title() if c.isalnum()) + "Environment"
    return type(name, (RlfToolEnvironment,), attrs)


def _final_answer(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    for msg in reversed(list(completion)):
        if isinstance(msg, dict) and msg.get("role", "assistant") == "assistant":
            content = msg.get("content")
            if isinstance(content, list):
                content = "".join(b.get("text", "") for b in content if isinstance(b, dict))
            return str(content or "")
    return ""


def rlf_env_reward(completions: Sequence[Any], environments: Sequence[Any] | None = None, **kwargs: Any) -> list[float]:
    """TRL reward function for `environment_factory`: each rollout's env verifies its last assistant message."""
    if environments is None or len(environments) != len(completions):
        raise ValueError("rlf_env_reward needs TRL's environments (GRPOTrainer(environment_factory="
                         "rlf_envs.adapters.trl.environment_factory(...)))")
    out = []
    for completion, env in zip(completions, environments, strict=True):
        if not isinstance(env, RlfToolEnvironment):
            raise TypeError(f"rlf_env_reward got a {type(env).__name__}, not an environment_factory() instance")
        out.append(env._score(_final_answer(completion)))
    return out
