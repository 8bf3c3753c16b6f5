"""rlf_envs.adapters.trl against the real TRL package: GRPOTrainer trains a tiny Qwen3 model (built from config,
rlf's shipped tokenizer) on rlf/Search-v0 on CPU, and the mask TRL computes its loss with is the env's loss mask.
Run by `tox -e adapters`."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")
torch = pytest.importorskip("torch")

import tokenizers  # noqa: E402
from repo_paths import REPO, SUPPORT  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from rlf_envs.adapters.trl import RlfRollout, rlf_reward  # noqa: E402
from rlf_envs.env.episodes import Generation  # noqa: E402

ASSETS = REPO / "rlf_train" / "src" / "rlf_train" / "assets"
ENV_KWARGS = {"topk": 1, "max_turns": 3, "max_obs_tokens": 48}
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    raw = tokenizers.Tokenizer.from_file(str(ASSETS / "tiny_tokenizer.json"))
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    hf.padding_side = "left"
    return hf


def tiny_model(tok: PreTrainedTokenizerFast, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg)


class CapturingTrainer(GRPOTrainer):
    """Records, for every loss computation, each row's completion ids and the mask TRL's loss uses (TRL's own
    expression: completion_mask * tool_mask)."""

    captured: list[tuple[list[int], list[int]]]

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        for ids, cm, m in zip(inputs["completion_ids"], inputs["completion_mask"], mask, strict=True):
            n = int(cm.sum())  # right-padded: the row's real length
            self.captured.append((ids[:n].tolist(), m[:n].tolist()))
        return super()._compute_loss(model, inputs)


def grpo_args(tmp_path: Path, **kw: Any) -> GRPOConfig:
    base: dict[str, Any] = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                                max_steps=2, max_completion_length=96, learning_rate=5e-3, logging_steps=1,
                                save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=0,
                                dataloader_num_workers=0, disable_tqdm=True)
    base.update(kw)
    return GRPOConfig(**base)


def env_masks(rollout: RlfRollout, seen: dict[tuple[int, ...], list[int]]) -> None:
    """The env's own record (trajectory.loss_mask after the prompt) of each episode of the latest call."""
    for ep in rollout.last_episodes:
        traj = ep.trajectory
        assert traj is not None and traj.token_ids is not None and traj.loss_mask is not None
        n = len(ep.prompt_ids)
        seen[tuple(traj.token_ids[n:])] = list(traj.loss_mask[n:])


def train(tok: PreTrainedTokenizerFast, tmp_path: Path, rollout: RlfRollout,
          **kw: Any) -> tuple[CapturingTrainer, dict]:
    env_seen: dict[tuple[int, ...], list[int]] = {}
    inner = rollout.__call__

    def call(prompts: list[Any], trainer: Any) -> dict[str, Any]:  # then read the env's record of each episode
        out = inner(prompts, trainer)
        env_masks(rollout, env_seen)
        return out

    trainer = CapturingTrainer(model=tiny_model(tok), reward_funcs=rlf_reward, args=grpo_args(tmp_path, **kw),
                               train_dataset=rollout.dataset(n=8), processing_class=tok, rollout_func=call)
    trainer.captured = []
    trainer.train()
    return trainer, env_seen


def check_masks(trainer: CapturingTrainer, env_seen: dict[tuple[int, ...], list[int]]) -> None:
    assert trainer.captured, "TRL computed no loss"
    for ids, mask in trainer.captured:
        assert tuple(ids) in env_seen, "TRL trained on a completion the env did not produce"
        assert mask == env_seen[tuple(ids)], "TRL's loss mask differs from the env's loss mask"


class ScriptedSearch:
    """A policy that searches for the question's entity, then answers: every other answer to a question is
    wrong, so each GRPO group has reward variance. Logprobs -0.5 per token."""

    def __init__(self, tok: PreTrainedTokenizerFast, rollout: RlfRollout) -> None:
        self.tok = tok
        self.gold = {t.question: t.gold_answers[0] for t in rollout.tasks}
        self.answers: dict[str, int] = {}

    async def __call__(self, context: list[int], max_tokens: int, stop: list[str]) -> Generation:
        await asyncio.sleep(0)
        question, after = self.tok.decode(context).rsplit("Question: ", 1)[1].split("?", 1)
        question += "?"
        if "<information>" not in after:
            action = f"<search> {question.rstrip('?').split()[-1]} </search>"
        else:
            k = self.answers[question] = self.answers.get(question, -1) + 1
            action = f"<answer> {self.gold[question] if k % 2 == 0 else 'nobody'} </answer>"
        ids = self.tok.encode(action, add_special_tokens=False)[:max_tokens]
        return Generation(ids, [-0.5] * len(ids), "stop")


def test_grpo_trains_on_search_with_tool_calls_and_env_masks(tok: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    rollout = RlfRollout("rlf/Search-v0", ENV_KWARGS, max_tokens_per_turn=24)
    policy = ScriptedSearch(tok, rollout)
    rollout.generate = policy
    trainer, env_seen = train(tok, tmp_path, rollout)
    before = tiny_model(tok).state_dict()
    changed = any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items() if k in before)
    assert changed, "GRPO did not update the model"
    check_masks(trainer, env_seen)
    # the completions hold a search, the env's retrieved document (mask 0) and an answer
    for ids, mask in trainer.captured:
        text = tok.decode(ids)
        assert "<information>" in text and "<answer>" in text
        obs = [t for t, m in zip(ids, mask, strict=True) if m == 0]
        assert "Doc 1" in tok.decode(obs) and "<search>" not in tok.decode(obs)
    # rewards come from rlf's verifier: right answers 1, wrong ones 0
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert rewards and all(0.0 < r < 1.0 for r in rewards)
    eps = rollout.last_episodes
    assert sorted(ep.outcome for ep in eps) == [0.0, 0.0, 1.0, 1.0]
    assert all(ep.tool_calls == 1 and ep.end_reason == "answer" for ep in eps)


def test_grpo_generates_in_process_with_the_trained_model(tok: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    """No generate function: the model TRL trains samples each turn (random init: invalid turns, which the
    env answers with corrective observations, masked out)."""
    rollout = RlfRollout("rlf/Search-v0", ENV_KWARGS, max_tokens_per_turn=8)
    trainer, env_seen = train(tok, tmp_path, rollout, max_steps=1)
    check_masks(trainer, env_seen)
    assert any(0 in mask for _, mask in trainer.captured), "no observation tokens were masked"
    eps = rollout.last_episodes
    assert all(ep.logprobs is not None and len(ep.logprobs) == len(ep.completion_ids) for ep in eps)
    for ep in eps:  # logprobs are real (negative) on the policy's tokens, 0 on the env's
        assert ep.logprobs is not None
        assert all(lp < 0 for lp, m in zip(ep.logprobs, ep.env_mask, strict=True) if m == 1)
        assert all(lp == 0 for lp, m in zip(ep.logprobs, ep.env_mask, strict=True) if m == 0)


def test_bad_setups_are_refused(tok: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must not hold a tokenizer"):
        RlfRollout("rlf/Search-v0", {"tokenizer": tok})
    with pytest.raises(ValueError, match="rlf/Nope-v0"):
        RlfRollout("rlf/Nope-v0")
    rollout = RlfRollout("rlf/Search-v0", ENV_KWARGS)
    with pytest.raises(KeyError, match="not a question of the env's tasks"):
        rollout(["What is the capital of Mars?"], None)
    with pytest.raises(ValueError, match="has 1 values for 2 completions"):
        rlf_reward(["a", "b"], [1.0])

    class Fake:
        use_vllm = True

    from rlf_envs.adapters.trl import transformers_generate_batch

    with pytest.raises(NotImplementedError, match="use_vllm=True"):
        transformers_generate_batch(Fake(), tok)


# -- TRL's own tool loop: GRPOTrainer(environment_factory=...) ---------------------------------------------------

from rlf_envs.adapters.trl import (  # noqa: E402
    TOOL_LOOP_DEGRADES,
    RlfToolEnvironment,
    environment_factory,
    rlf_env_reward,
)

QWEN3_TEMPLATE = SUPPORT / "assets" / "qwen3_chat_template.jinja"


@pytest.fixture(scope="module")
def chat_tok(tok: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """The tiny tokenizer with Qwen3's chat template: TRL's tool loop needs a template it can parse tool calls of."""
    raw = tokenizers.Tokenizer.from_file(str(ASSETS / "tiny_tokenizer.json"))
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    hf.padding_side = "left"
    hf.chat_template = QWEN3_TEMPLATE.read_text()
    return hf


class ScriptedToolLoop(GRPOTrainer):
    """TRL's GRPOTrainer whose generation is scripted (everything else, tool-call parsing, tool execution,
    masks, rewards and the update, is TRL's): first a Qwen3 tool call searching the question's entity, after a
    tool response an answer, right for every other completion of a question. Records each generation context."""

    gold: dict[str, str]
    entity: dict[str, str]
    contexts: list[str]

    def _generate_single_turn(self, prompt_ids: list[list[int]], *args: Any, **kwargs: Any) -> Any:
        out, lps = [], []
        for ids in prompt_ids:
            text = self.processing_class.decode(ids)
            self.contexts.append(text)
            question = next(q for q in self.gold if q in text)
            if "<tool_response>" not in text:
                entity = self.entity[question]
                action = f'<tool_call>\n{{"name": "search", "arguments": {{"query": "{entity}"}}}}\n</tool_call>'
            else:
                k = self.answers[question] = self.answers.get(question, -1) + 1
                action = f"<answer> {self.gold[question] if k % 2 == 0 else 'nobody'} </answer>"
            # ends at Qwen3's end of turn (with a further EOS, transformers' parser returns an empty message)
            toks = self.processing_class.encode(action + "<|im_end|>", add_special_tokens=False)
            out.append(toks)
            lps.append([-0.5] * len(toks))
        return out, lps


def test_environment_factory_trains_with_trls_tool_loop(chat_tok: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    env_cls = environment_factory("rlf/Search-v0", ENV_KWARGS)
    assert issubclass(env_cls, RlfToolEnvironment) and callable(env_cls.search)
    model = tiny_model(chat_tok)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match="not rlf's token-exact trajectory"):
        trainer = ScriptedToolLoop(model=model, reward_funcs=rlf_env_reward, processing_class=chat_tok,
                                   environment_factory=env_cls, train_dataset=env_cls.dataset(n=8),
                                   args=grpo_args(tmp_path, max_completion_length=160))
    trainer.gold = {t.question: t.gold_answers[0] for t in env_cls._index.tasks[:8]}
    trainer.entity = {t.question: t.meta["entity"] for t in env_cls._index.tasks[:8]}
    trainer.contexts, trainer.answers = [], {}
    trainer.train()
    # the model saw the env's tool in TRL's rendering of the prompt, and rlf's search results after its call
    assert any('"name": "search"' in c for c in trainer.contexts)
    results = [c for c in trainer.contexts if "<tool_response>" in c]
    assert results and all(f'Doc 1(Title: "{trainer.entity[q]}")' in c for c in results for q in trainer.gold if q in c)
    envs = trainer.environments
    assert envs and all(isinstance(e, env_cls) and e.tool_calls == 1 and e.tool_errors == 0 for e in envs)
    assert sorted(e.reward for e in envs) == [0.0, 0.0, 1.0, 1.0], "rewards are the env verifier's"
    logged = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert logged and all(h["tools/call_frequency"] == 1.0 and h["tools/failure_frequency"] == 0.0 for h in logged)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), "no update"


def test_environment_factory_tools_and_bad_input() -> None:
    env_cls = environment_factory("rlf/Search-v0", ENV_KWARGS)
    from transformers.utils import get_json_schema
    with pytest.warns(UserWarning) as warned:
        env = env_cls()
        env_cls()
    assert len(warned) == 1 and str(warned[0].message) == TOOL_LOOP_DEGRADES  # once per class
    schema = get_json_schema(env.search)["function"]
    assert schema["name"] == "search" and schema["parameters"]["required"] == ["query"]
    assert set(schema["parameters"]["properties"]) == {"query", "topk"}
    with pytest.raises(RuntimeError, match="before reset"):
        env.search(query="Gruvir")
    with pytest.raises(KeyError, match="no task with id"):
        env.reset(rlf_task_id="nope", prompt=[{"role": "user", "content": "x"}])
    task = env_cls._index.tasks[0]
    env.reset(prompt=[{"role": "user", "content": task.question}])  # found by its question without an id
    assert env.task is task
    with pytest.raises(RuntimeError, match="query"):  # rlf's argument validation, raised so TRL counts a failure
        env.search(topk=2)
    assert (env.tool_calls, env.tool_errors) == (1, 1)
    assert f'Doc 1(Title: "{task.meta["entity"]}")' in env.search(query=task.meta["entity"])
    gold = task.gold_answers[0]
    assert rlf_env_reward([[{"role": "assistant", "content": f"<answer> {gold} </answer>"}]], [env]) == [1.0]
    with pytest.raises(ValueError, match="environments"):
        rlf_env_reward(["x"])
    with pytest.raises(ValueError, match="tokenizer"):
        environment_factory("rlf/Search-v0", {"tokenizer": "x"})
    with pytest.raises(TypeError, match="environment_factory"):
        RlfToolEnvironment()
    env._close()
