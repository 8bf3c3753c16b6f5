"""rlf envs as a verl agent loop, against verl's real classes (the `verl` package, installed without its GPU deps):
its registry and hydra instantiation as AgentLoopWorker does it, `AgentLoopBase`, `AgentLoopOutput` (and its
`as_dict` tensor conversion), `TokenOutput`. `run()` is driven by an in-test engine with verl's server-manager
interface (`async generate(request_id, *, prompt_ids, sampling_params) -> TokenOutput`) that samples from a tiny
torch model built from config (nothing downloaded)."""

from __future__ import annotations

import asyncio
import logging

import pytest

pytest.importorskip("verl", reason="needs verl (tox -e adapters-rl)")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hydra  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from repo_paths import REPO  # noqa: E402
from verl.experimental.agent_loop.agent_loop import (  # noqa: E402
    AgentLoopOutput,
    DictConfigWrap,
    _agent_loop_registry,
)
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from rlf_envs.adapters.verl import AGENT_NAME, POOL, RlfAgentLoop  # noqa: E402

ASSETS = REPO / "rlf_train" / "src" / "rlf_train" / "assets"
TOKENIZER = ASSETS / "tiny_tokenizer.json"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call><|im_end|>'


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER), eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")


class TinyEngine:
    """verl's server-manager interface over a tiny Qwen3 model sampling on the CPU, logprobs included (at most 12
    new tokens a call, as a model that stops early)."""

    def __init__(self, tokenizer) -> None:  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        cfg = transformers.Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                       max_position_embeddings=4096)
        self.model = transformers.Qwen3ForCausalLM(cfg).eval()
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.requests: list[tuple[str, list[int], dict]] = []  # type: ignore[type-arg]
        self.generated: list[int] = []  # ids per call

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict, **kw) -> TokenOutput:  # type: ignore[type-arg, no-untyped-def]
        self.requests.append((request_id, list(prompt_ids), dict(sampling_params)))
        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt_ids]), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                      max_new_tokens=min(sampling_params["max_tokens"], 12), eos_token_id=self.eos,
                                      pad_token_id=self.eos, output_logits=True, return_dict_in_generate=True)
        ids = out.sequences[0, len(prompt_ids):].tolist()
        self.generated.append(len(ids))
        logp = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, ids, strict=False)]
        return TokenOutput(token_ids=ids, log_probs=logp if sampling_params.get("logprobs") else None,
                           stop_reason="completed")


class ScriptEngine:
    """verl's server-manager interface answering with scripted turns (token ids of the text), no model."""

    def __init__(self, tokenizer, turns: list[str]) -> None:  # type: ignore[no-untyped-def]
        self.tok, self.turns, self.calls = tokenizer, turns, 0

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict, **kw) -> TokenOutput:  # type: ignore[type-arg, no-untyped-def]
        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        ids = self.tok.encode(text, add_special_tokens=False)[: sampling_params["max_tokens"]]
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids))


def trainer_config(prompt_length: int = 1024, response_length: int = 96):  # type: ignore[no-untyped-def]
    return DictConfigWrap(OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "prompt_length": prompt_length, "response_length": response_length}}, "data": {}}))


def make_loop(engine, tokenizer, config=None, **entry):  # type: ignore[no-untyped-def]
    """Instantiate the registered loop exactly as verl's AgentLoopWorker._run_agent_loop does."""
    spec = {**_agent_loop_registry[AGENT_NAME], **entry}
    return hydra.utils.instantiate(config=spec, trainer_config=config or trainer_config(), server_manager=engine,
                                   tokenizer=tokenizer, processor=None, hf_model_type=None, dataset_cls=None,
                                   data_config=DictConfigWrap(OmegaConf.create({})), tools=None)


def run(loop, **row):  # type: ignore[no-untyped-def]
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    return asyncio.run(loop.run(params, **row))


def test_registered_and_built_by_hydra_like_verls_worker(tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert _agent_loop_registry[AGENT_NAME] == {"_target_": "rlf_envs.adapters.verl.RlfAgentLoop"}
    loop = make_loop(ScriptEngine(tokenizer, ["x"]), tokenizer, env_id="rlf/Calculator-v0", name="rlf_agent",
                     env_kwargs=OmegaConf.create({"max_turns": 2}))  # an agent-loop file entry's keys
    assert isinstance(loop, RlfAgentLoop) and loop.env_id == "rlf/Calculator-v0" and loop.env_kwargs == {"max_turns": 2}


def test_sampled_episode_is_token_exact_with_aligned_logprobs(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = TinyEngine(tokenizer)
    loop = make_loop(engine, tokenizer, config=trainer_config(response_length=400), env_id="rlf/Calculator-v0",
                     env_kwargs={"max_turns": 3})
    out = run(loop, raw_prompt=[], extra_info={"task_index": 1})
    assert isinstance(out, AgentLoopOutput)
    n = len(out.response_ids)
    assert 0 < n <= 400 and len(out.response_mask) == n and len(out.response_logprobs) == n
    # the engine saw exactly the ids the loop returns: prompt, then its own ids + the env's observation ids
    assert engine.requests[0][1] == out.prompt_ids
    for rid, ctx, _ in engine.requests[1:]:
        assert rid == engine.requests[0][0]  # one sticky request id per episode
        assert ctx == (out.prompt_ids + out.response_ids)[: len(ctx)]
    assert all(p["max_tokens"] >= 1 and p["stop"] == ["<|im_end|>"] for _, _, p in engine.requests)
    # response_mask: 1 exactly on generated ids; logprobs equal the model's at those positions, 0 elsewhere
    ids = torch.tensor([out.prompt_ids + out.response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(engine.model(ids).logits[0].float(), -1)
    p0 = len(out.prompt_ids)
    for k, (tok, m, lp) in enumerate(zip(out.response_ids, out.response_mask, out.response_logprobs, strict=True)):
        if m:
            assert lp == pytest.approx(logp[p0 + k - 1, tok].item(), abs=1e-4)
        else:
            assert lp == 0.0
    assert sum(out.response_mask) == sum(engine.generated) and len(engine.generated) == 3  # max_turns
    assert 0 in out.response_mask  # the invalid turns' corrections are there, masked
    # verl's own conversion to its batch tensors works on it (reward on the last token)
    d = out.as_dict()
    assert d["responses"].tolist() == out.response_ids and d["response_mask"].tolist() == out.response_mask
    assert d["rm_scores"][-1].item() == out.reward_score


def test_scripted_episode_reward_turns_and_per_turn_warning(tokenizer, caplog) -> None:  # type: ignore[no-untyped-def]
    POOL._idle.clear()
    engine = ScriptEngine(tokenizer, [CALL, "<answer>353195</answer><|im_end|>"])
    loop = make_loop(engine, tokenizer, env_id="rlf/Calculator-v0",
                     env_kwargs={"turn_rewarder": {"valid_call_bonus": 0.25}})
    with caplog.at_level(logging.WARNING, logger="rlf_envs.adapters.verl"):
        out = run(loop, raw_prompt=[], extra_info={"task_index": 0})
    assert out.reward_score == 1.25 and out.extra_fields["turn_scores"] == [0.25, 0.0]
    assert out.extra_fields["rlf_end_reason"] == "answer" and out.extra_fields["rlf_outcome"] == 1.0
    assert out.num_turns == 4  # user, assistant (call), tool response, assistant (answer)
    assert any("per-turn rewards are summed" in r.message for r in caplog.records)
    obs = tokenizer.decode([t for t, m in zip(out.response_ids, out.response_mask, strict=True) if not m])
    assert obs == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_verl_row_with_reward_model_ground_truth(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A verl parquet row: raw_prompt messages + reward_model.ground_truth, env id in extra_info."""
    loop = make_loop(ScriptEngine(tokenizer, ["<answer>12</answer><|im_end|>"]), tokenizer)
    out = run(loop, raw_prompt=[{"role": "user", "content": "What is 3 * 4?"}],
              reward_model={"style": "rule", "ground_truth": "12"},
              extra_info={"env_id": "rlf/Calculator-v0", "index": 7})
    assert out.reward_score == 1.0
    assert "What is 3 * 4?" in tokenizer.decode(out.prompt_ids)


def test_response_budget_ends_the_episode_truncated_never_cut(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = ScriptEngine(tokenizer, [CALL])  # calls forever
    loop = make_loop(engine, tokenizer, config=trainer_config(response_length=60), env_id="rlf/Calculator-v0",
                     env_kwargs={"max_turns": 50})
    out = run(loop, raw_prompt=[], extra_info={"task_index": 0})
    assert len(out.response_ids) <= 60 and out.extra_fields["rlf_end_reason"] == "token_budget"
    env = POOL.take("rlf/Calculator-v0", {"max_turns": 50}, tokenizer)
    assert env.max_total_tokens == 4096  # the pooled env's own budget is restored
    assert (env.trajectory.token_ids or []) == out.prompt_ids + out.response_ids  # exactly what verl got


def test_bad_configuration_errors(tokenizer) -> None:  # type: ignore[no-untyped-def]
    loop = make_loop(ScriptEngine(tokenizer, ["x"]), tokenizer)
    with pytest.raises(ValueError, match="env id"):
        run(loop, raw_prompt=[], extra_info={})
    loop = make_loop(ScriptEngine(tokenizer, ["x"]), tokenizer, env_id="rlf/Calculator-v0",
                     env_kwargs={"tokenizer": "x"})
    with pytest.raises(ValueError, match="verl's own tokenizer"):
        run(loop, raw_prompt=[], extra_info={})
    loop = make_loop(ScriptEngine(tokenizer, ["x"]), tokenizer, config=trainer_config(prompt_length=16),
                     env_id="rlf/Calculator-v0")
    with pytest.raises(ValueError, match="prompt_length"):
        run(loop, raw_prompt=[], extra_info={"task_index": 0})
    with pytest.raises(ValueError, match="rlf/Nope-v0"):
        run(make_loop(ScriptEngine(tokenizer, ["x"]), tokenizer, env_id="rlf/Nope-v0"), raw_prompt=[])
