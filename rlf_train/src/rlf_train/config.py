"""The one training config: pydantic models, YAML loading and `--set a.b=c` overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rlf_envs.errors import RlfError


class ConfigError(RlfError, ValueError):
    """A config problem, with the dotted key and what is allowed."""


#: the env that holds a foreign environment's tasks (`rollout.environment`; rlf_train.rollout.foreign)
FOREIGN_ENV_ID = "rlf/Foreign-v0"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TinyModelConfig(_Section):
    """Shape of the offline tiny Qwen3-architecture policy (built from scratch, random init)."""

    hidden_size: int = Field(64, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(192, ge=8)
    max_position_embeddings: int = Field(1024, ge=64)
    tokenizer_vocab_size: int = Field(3072, ge=300, description="target vocab of the BPE tokenizer trained offline")
    tokenizer_file: str | None = Field(
        None, description="a `tokenizers` JSON file (a bare name is looked up in rlf_train's assets, e.g. "
                          "quickstart_tokenizer.json); default: the shipped tokenizer of the shipped search data")

    @model_validator(mode="after")
    def _heads(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        return self


#: Qwen3's linear layers (attention and MLP); the embedding and the (tied) output layer stay frozen
QWEN3_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(_Section):
    """LoRA through `peft` (`rlf_train.policy.lora`): RL trains a low-rank adapter on the frozen policy; the KL
    reference is the same model with the adapter switched off. Backend local only (see docs/guides/lora.md)."""

    rank: int = Field(16, ge=1, description="r: the adapter's rank")
    alpha: float = Field(32.0, gt=0.0, description="the adapter's output is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input; 0 keeps the PPO ratio "
                                                          "of an on-policy token at exactly 1 (the forward is "
                                                          "deterministic)")
    target_modules: list[str] = Field(default_factory=lambda: list(QWEN3_LORA_TARGETS),
                                      description="names of the linear layers that get an adapter (peft's "
                                                  "target_modules, matched against module-name suffixes)")

    @model_validator(mode="after")
    def _targets(self) -> LoraConfig:
        if not self.target_modules:
            raise ValueError("target_modules is empty: name at least one linear layer, e.g. q_proj")
        frozen = [t for t in self.target_modules if t in ("embed_tokens", "lm_head", "all-linear")]
        if frozen:
            raise ValueError(f"target_modules {frozen}: the embedding and the output layer (tied in Qwen3's small "
                             "models) are not adapted here, and 'all-linear' would include lm_head; list the "
                             f"linear layers by name (default: {QWEN3_LORA_TARGETS})")
        return self


class ModelConfig(_Section):
    """`name_or_path: tiny` builds the offline tiny model; anything else is a transformers causal LM path/id."""

    name_or_path: str = "tiny"
    tokenizer: str | None = Field(None, description="tokenizer path/id; default: same as name_or_path")
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    lora: LoraConfig | None = Field(None, description="train a LoRA adapter in RL instead of every weight (`lora: {}` "
                                                      "for the defaults); the SFT warm start, if any, trains every "
                                                      "weight and becomes the frozen base")


class EnvConfig(_Section):
    """Any registered gymnasium id (rlf envs or your own); kwargs go to gymnasium.make."""

    id: str = "rlf/Search-v0"
    kwargs: dict[str, Any] = Field(default_factory=dict)
    eval_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="overrides of kwargs for the eval env, e.g. {tasks: test.parquet}")
    train_split: str | None = Field("train", description="passed to the env as `split`; null: the env takes no "
                                    "split (e.g. rlf/Tools-v0, whose tasks come from kwargs.tasks)")
    eval_split: str | None = "test"
    imports: list[str] = Field(default_factory=lambda: ["rlf_envs"], description="modules imported to register envs")


class RolloutConfig(_Section):
    """How episodes are made: prompts and group size per step, sampling, the budgets each episode gets, the engine,
    the source (`agent`) and the async mode."""

    prompts_per_step: int = Field(8, ge=1)
    samples_per_prompt: int = Field(8, ge=1, description="G: the group size for GRPO")
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_turns: int = Field(4, ge=1)
    max_new_tokens_per_turn: int = Field(48, ge=1)
    max_total_tokens: int = Field(1024, ge=16)
    max_obs_tokens: int = Field(256, ge=1)
    batch_size: int = Field(64, ge=1, description="max sequences generated together")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: collect a batch, then update. async: a rollout worker keeps generating with the "
                            "newest published weights while the learner updates (docs/guides/async-rl.md); "
                            "backend openrlhf: --train.async_enable")
    max_staleness: int = Field(1, ge=0, description="async: no episode starts whose tokens could be more than this "
                                                    "many policy versions behind the update that trains on them")
    async_worker: Literal["process", "thread"] = Field(
        "process", description="async: where the rollout worker runs: its own process (envs and a policy copy "
                               "rebuilt from this config; weights through shared memory) or a thread of the "
                               "trainer (starts faster; shares the GIL with the learner)")
    partial_rollouts: bool = Field(True, description="async: an episode in flight at a weight update continues with "
                                                     "the new weights (False: it keeps the weights it started with); "
                                                     "backend openrlhf: --train.partial_rollout_enable")
    async_schedule: Literal["free", "fixed"] = Field(
        "free", description="async: free: the worker generates with the newest weights it has (fastest; with "
                            "max_staleness >= 1 which weights a token gets depends on timing). fixed: update u's "
                            "batch is generated entirely by weights version max(0, u - 1 - max_staleness), one "
                            "update after another (no partial rollouts): the run is a function of the seed and a "
                            "SIGKILLed run resumes exactly (docs/guides/async-rl.md)")
    engine: Literal["local", "vllm"] = Field(
        "local", description="what generates the local backend's rollouts and evals: local (rlf's KV-cache sampler) "
                             "or vllm (a vllm.LLM in the trainer's process, weights reloaded after every update; "
                             "needs vLLM, rollout.mode sync; rlf_train.rollout.vllm)")
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0.0, le=1.0, description="engine vllm on a GPU: the share of "
                                                                                  "GPU memory vLLM may take")
    vllm_timeout_s: float = Field(600.0, gt=0.0, description="engine vllm: the deadline of every call into the "
                                  "engine (start-up, each turn's generate, a weight reload, the prefix-cache reset, "
                                  "the shutdown); on expiry the engine's processes are killed and the run stops "
                                  "with an error naming the call. Start-up on CPU takes 0.5-2 min")

    agent: str | None = Field(
        None, description="train agent code as it is: 'package.module:function' or 'path/to/file.py:function', an "
                          "`async def agent(task, client)` given an OpenAI client on the trainer's policy endpoint, "
                          "one session per episode (docs/guides/own-agent.md). The env still gives the tasks, the "
                          "format the endpoint renders with (qwen3 or search_r1) and the verifier; it is not stepped")
    agent_concurrency: int = Field(64, ge=1, description="agent: the most episodes (sessions) running at once")
    agent_timeout_s: float = Field(300.0, gt=0.0, description="agent: an episode still running after this long is "
                                   "cancelled, scored 0 and counted (agent_timeouts); its session refuses calls")
    agent_max_calls: int = Field(64, ge=1, description="agent: the most completions one episode may ask for")
    environment: str | None = Field(
        None, description="train an environment written for another framework as it is: 'verifiers:<taskset id or "
                          "module>', or 'openenv:<server URL, env dir or module:app>'; its own rollout "
                          "and scoring code runs against the policy endpoint (as rollout.agent: agent_concurrency, "
                          "agent_timeout_s, agent_max_calls apply), its dataset gives the tasks; its options go in "
                          "env.kwargs.options (docs/guides/foreign-envs.md)")

    @model_validator(mode="after")
    def _engine(self) -> RolloutConfig:
        if self.environment is not None and self.agent is not None:
            raise ValueError("rollout.environment and rollout.agent both name the code that makes the episodes: "
                             "give one of them")
        if (self.agent is not None or self.environment is not None) and self.mode == "async" and (
                self.async_worker != "thread" or self.async_schedule != "free" or not self.partial_rollouts):
            key = "rollout.agent" if self.agent is not None else "rollout.environment"
            raise ValueError(f"{key} with rollout.mode: async runs its episodes on a thread of the trainer, "
                             "with the free schedule and partial rollouts: set rollout.async_worker: thread (and "
                             "leave async_schedule: free, partial_rollouts: true)")
        if self.engine == "vllm" and self.mode != "sync":
            raise ValueError("rollout.engine: vllm runs with rollout.mode: sync (the async worker generates with "
                             "rlf's sampler); set one of them back")
        return self


class SFTConfig(_Section):
    """Supervised warm start on scripted demonstrations (or a JSONL of demonstrations)."""

    enabled: bool = False
    steps: int = Field(200, ge=0)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(1e-3, gt=0.0)
    num_demos: int = Field(512, ge=1)
    demos_path: str | None = Field(None, description="JSONL of {task_index, actions: [str,...]}; default: scripted")
    # scripted demos (Search): shares of imperfect behaviour
    p_no_search: float = Field(0.5, ge=0.0, le=1.0, description="answer directly (a guess) without searching")
    p_wrong_query: float = Field(0.0, ge=0.0, le=1.0, description="search for the wrong entity")


#: the AlgorithmConfig keys that only algorithm.name: ppo reads (set with another algorithm: an error, not a no-op)
PPO_KEYS = frozenset({"critic", "gamma", "lam", "vf_coef", "value_clip", "critic_lr"})


class AlgorithmConfig(_Section):
    """The RL update: GRPO / Dr.GRPO (PPO-clip on group-normalised advantages) or PPO, and its knobs."""

    name: Literal["grpo", "dr_grpo", "ppo"] = Field(
        "grpo", description="grpo | dr_grpo | ppo (GAE with a critic: rlf_train.ppo on the local backend, "
                            "OpenRLHF's critic on backend openrlhf)")
    steps: int = Field(100, ge=0)
    std_normalize: bool = Field(True, description="divide group advantages by the group std (off for Dr.GRPO)")
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    clip_eps_low: float = Field(0.2, ge=0.0)
    clip_eps_high: float = Field(0.2, ge=0.0)
    ppo_epochs: int = Field(1, ge=1)
    micro_batch_size: int = Field(32, ge=1, description="sequences per forward/backward (gradient accumulation)")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per rollout batch per epoch")
    kl_coef: float = Field(0.0, ge=0.0, description="k3 KL to a frozen reference; 0 disables (no ref model)")
    is_cap: float = Field(2.0, ge=1.0, description="async: truncation C of the importance weight "
                                                   "min(pi_prox / pi_behaviour, C) of the decoupled PPO loss")
    per_turn_rewards: bool = Field(True, description="add per-turn env rewards as reward-to-go when present")
    # PPO (algorithm.name: ppo)
    critic: Literal["value_head", "separate"] = Field(
        "value_head", description="ppo: a value head on the policy's last hidden state, trained with the policy's "
                                  "optimizer (its loss x vf_coef), or a separate copy of the policy with its own head "
                                  "and optimizer (OpenRLHF always trains a separate critic)")
    gamma: float = Field(1.0, gt=0.0, le=1.0, description="ppo: GAE discount per policy token")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="ppo: GAE lambda")
    vf_coef: float = Field(0.5, ge=0.0, description="ppo, critic value_head: weight of the value loss")
    value_clip: float = Field(0.2, ge=0.0, description="ppo: clip of the value update around the old value (0: off)")
    critic_lr: float | None = Field(None, gt=0.0, description="ppo, critic separate: its learning rate "
                                                              "(default optim.lr; OpenRLHF: openrlhf.critic_lr)")
    segment_weight: Literal["episode", "segment"] = Field(
        "episode", description="rollout.agent rows are an episode's segments (history trimmed, edited, compacted): "
                               "'episode': each episode counts once in the sequence-level loss_aggs (its k segments "
                               "1/k each); 'segment': each segment counts as a sequence. token_mean weighs tokens "
                               "either way")
    eps: float = 1e-6

    @model_validator(mode="after")
    def _dr(self) -> AlgorithmConfig:
        if self.name == "dr_grpo":
            if "std_normalize" not in self.model_fields_set:
                object.__setattr__(self, "std_normalize", False)
            if "loss_agg" not in self.model_fields_set:
                object.__setattr__(self, "loss_agg", "seq_mean_token_sum_norm")
        defaults = type(self).model_fields
        ppo_only = sorted(k for k in PPO_KEYS & self.model_fields_set if getattr(self, k) != defaults[k].default) \
            if self.name != "ppo" else []  # a dumped config (a run's config.yaml) carries the defaults: fine
        if ppo_only:
            keys = ", ".join("algorithm." + k for k in ppo_only)
            raise ValueError(f"{keys}: PPO's critic settings apply to algorithm.name: ppo only (this is "
                             f"{self.name}); remove them or set algorithm.name: ppo")
        return self


class OptimConfig(_Section):
    """AdamW for the RL stage (the warm start has its own `sft.lr`)."""

    lr: float = Field(3e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0.0)
    warmup_steps: int = Field(0, ge=0)


class EvalConfig(_Section):
    """Held-out evaluation during the run: how often, on how many tasks, greedy and/or sampled."""

    every: int = Field(0, ge=0, description="evaluate every N RL steps (0: only at the end)")
    num_tasks: int = Field(128, ge=1)
    greedy: bool = True
    sampled: bool = Field(True, description="also evaluate at temperature `temperature`")
    temperature: float = Field(1.0, gt=0.0)
    before_rl: bool = Field(True, description="evaluate after the warm start, before RL")


class LoggingConfig(_Section):
    """Where a run writes (run dir, checkpoints, trajectories) and what it logs to (JSONL, TensorBoard, W&B)."""

    run_dir: str = "runs/{name}"
    tensorboard: bool = True
    wandb_project: str | None = None
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    progress: bool = True
    save_every: int = Field(0, ge=0, description="checkpoint every N RL steps (0: only at the end)")
    keep_last: int = Field(2, ge=1)
    trajectories: int = Field(8, ge=-1, description="episodes stored per eval mode and per sampled training step "
                              "in run_dir/trajectories/step_K.jsonl for the viewer (-1: all, 0: none)")
    trajectories_every: int = Field(10, ge=0, description="also store training episodes every N RL steps (0: never)")
    replay_every: int = Field(0, ge=0, description="write a replay bundle every N RL steps in run_dir/replay/step_K/ "
                              "(rows, rewards, advantages, log-probs, loss terms, hashes; `python -m "
                              "rlf_train.replay` recomputes it on CPU); 0: never")
    replay_weights: bool = Field(False, description="bundles also keep the policy, optimizer and scheduler state "
                                 "from before the update, so a replay recomputes the log-probs, every loss term "
                                 "and the updated weights (the size of a checkpoint per bundle)")


class OpenRLHFConfig(_Section):
    """Settings of `backend: openrlhf` that have no counterpart in the local backend (cluster layout, vLLM,
    DeepSpeed). Everything else (model, rollout, algorithm, optim, eval, logging) maps from the shared
    sections; see `rlf_train.openrlhf.flags` for the full mapping."""

    ray_address: str | None = Field(
        None, description="an existing Ray cluster (e.g. http://head:8265, submitted as a Ray job); "
                          "None: OpenRLHF starts a local Ray head on this machine")
    shared_dir: str | None = Field(
        None, description="with ray_address: a directory every node sees (shared storage) for checkpoints, "
                          "final weights and logs; the run dir's inputs travel with the Ray job")
    num_nodes: int = Field(1, ge=1, description="nodes for the actor (and reference) model")
    gpus_per_node: int = Field(8, ge=1)
    vllm_engines: int = Field(8, ge=1, description="vLLM rollout engines")
    vllm_tensor_parallel_size: int = Field(1, ge=1)
    vllm_gpu_memory_utilization: float = Field(0.6, gt=0.0, le=1.0)
    vllm_enable_sleep: bool = Field(True, description="free vLLM memory while training (needs colocate_all)")
    vllm_enable_prefix_caching: bool = True
    vllm_enforce_eager: bool = False
    colocate_all: bool = Field(True, description="actor, reference and vLLM share the same GPUs")
    zero_stage: int = Field(3, ge=0, le=3, description="DeepSpeed ZeRO stage")
    adam_offload: bool = False
    ref_offload: bool = False
    deepspeed_enable_sleep: bool = Field(True, description="offload DeepSpeed states while vLLM generates")
    packing_samples: bool = True
    attn_implementation: str = Field("flash_attention_2", description="transformers attention for training")
    async_train: bool = Field(False, description="OpenRLHF's async mode: rollouts overlap training")
    async_queue_size: int = Field(1, ge=1, description="with async_train: rollout batches buffered between "
                                                       "sampler and trainer (--train.async_queue_size)")
    partial_rollout: bool = Field(False, description="with async_train: weights sync by pausing vLLM mid-"
                                                     "generation (--train.partial_rollout_enable)")
    critic_name_or_path: str | None = Field(None, description="critic init for algorithm.name: ppo "
                                                              "(default: the policy's weights)")
    critic_lr: float = Field(9e-6, gt=0.0)
    save_hf: bool = Field(True, description="also save HuggingFace weights with each checkpoint")
    env_vars: dict[str, str] = Field(default_factory=dict, description="extra env vars for every Ray worker")
    extra_args: list[str] = Field(
        default_factory=list, description="more OpenRLHF flags, passed as they are (checked by OpenRLHF's parser "
                                          "when it is installed), e.g. ['--ds.use_liger_kernel']")


class SessionsConfig(_Section):
    """Where coding-agent sandboxes run (rlf/SWE-v0 and Harbor tasks): `backend` goes to the env as its `backend`;
    for `ray`, the cluster and the session nodes (docs/guides/coding-agent-cluster.md). Applied to this process and,
    with backend: openrlhf, to every Ray worker (so the rollout actors place sessions on the cluster's session nodes
    instead of beside the vLLM engines)."""

    backend: Literal["local", "docker", "ray"] = "local"
    address: str | None = Field(None, description="ray: the cluster (ray.init's address; default RLF_RAY_ADDRESS, "
                                                  "else 'auto')")
    nodes: str | None = Field(None, description="ray: the session nodes, e.g. 'resource:sandbox' or 'role=cpu' "
                                                "(default: nodes without GPUs when any exist)")
    per_node: float | None = Field(None, gt=0, description="ray: sessions per node at most")
    inner: Literal["local", "docker"] = Field("local", description="ray: the backend each node's host runs")

    def env_vars(self) -> dict[str, str]:
        """The variables the ray backend reads (rlf_envs.sandbox.sessions.ray)."""
        if self.backend != "ray":
            return {}
        out = {"RLF_RAY_SESSION_INNER": self.inner}
        for key, v in (("RLF_RAY_ADDRESS", self.address), ("RLF_RAY_SESSION_NODES", self.nodes),
                       ("RLF_RAY_SESSIONS_PER_NODE", None if self.per_node is None else f"{self.per_node:g}")):
            if v is not None:
                out[key] = v
        return out


class TrainConfig(_Section):
    """The one training config (`python -m rlf_train --config X.yaml`): every section, so one YAML file says all a run
    does and the run dir's config.yaml is enough to resume or evaluate it."""

    name: str = "run"
    seed: int = 0
    backend: Literal["local", "openrlhf"] = "local"
    threads: int = Field(0, ge=0, description="torch CPU threads (0: torch default)")
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    openrlhf: OpenRLHFConfig = Field(default_factory=OpenRLHFConfig)
    sessions: SessionsConfig | None = Field(None, description="where coding-agent sandboxes run (SWE/Harbor envs)")
    group_reward: dict[str, Any] | None = Field(
        None, description="a group verifier (e.g. {type: group_judge, base_url: ..., model: ...}) that scores each "
                          "GRPO group of a training batch; its score replaces the env verifier's as the training "
                          "reward (eval keeps the env's). docs/guides/group-judge.md")

    @model_validator(mode="after")
    def _sessions(self) -> TrainConfig:
        if self.sessions is not None:
            for where, kw in (("env.kwargs", self.env.kwargs), ("env.eval_kwargs", self.env.eval_kwargs)):
                if kw.get("backend", self.sessions.backend) != self.sessions.backend:
                    raise ValueError(f"{where}.backend {kw['backend']!r} and sessions.backend "
                                     f"{self.sessions.backend!r} disagree: give it once, in sessions")
            self.env.kwargs = {**self.env.kwargs, "backend": self.sessions.backend}
        return self

    @model_validator(mode="after")
    def _foreign(self) -> TrainConfig:
        """`rollout.environment` gives the env: rlf/Foreign-v0 (rlf_train.rollout.foreign), whose tasks are the
        foreign environment's dataset."""
        spec = self.rollout.environment
        if spec is None:
            return self
        if "id" in self.env.model_fields_set and self.env.id != FOREIGN_ENV_ID:
            raise ValueError(f"rollout.environment {spec!r} gives the env (its tasks come from the foreign "
                             f"environment): leave env.id unset (got {self.env.id!r})")
        if self.env.kwargs.get("environment", spec) != spec:
            raise ValueError(f"env.kwargs.environment {self.env.kwargs['environment']!r} and rollout.environment "
                             f"{spec!r} disagree: give it once, in rollout.environment")
        self.env.id = FOREIGN_ENV_ID
        if "rlf_train.rollout.foreign" not in self.env.imports:
            self.env.imports = [*self.env.imports, "rlf_train.rollout.foreign"]
        self.env.kwargs = {**self.env.kwargs, "environment": spec}
        return self

    @model_validator(mode="after")
    def _backend(self) -> TrainConfig:
        if self.rollout.environment is not None and self.backend != "local":
            raise ValueError("rollout.environment runs on backend: local (OpenRLHF's Ray rollout workers step rlf "
                             "envs, not a foreign environment's own rollout): set backend: local")
        if self.group_reward is not None and self.rollout.environment is not None:
            raise ValueError("group_reward with rollout.environment: the foreign environment's own scorer gives the "
                             "reward; remove group_reward")
        if self.group_reward is not None and (self.backend != "local" or self.rollout.agent is not None):
            raise ValueError("group_reward runs on backend: local with env-driven rollouts (not rollout.agent) "
                             "for now; remove it, or score with the env's verifier")
        if self.algorithm.name == "ppo" and self.backend == "local" and self.rollout.agent is not None:
            raise ValueError("algorithm.name: ppo with rollout.agent is not supported yet (an agent's rows are "
                             "segments of episodes; GAE runs over one row's tokens): use grpo, or an env")
        if self.model.lora is not None and self.backend == "local" and self.rollout.mode == "async":
            raise ValueError("model.lora with rollout.mode: async is not supported yet (the async worker rebuilds a "
                             "full-weight policy and receives full state dicts); use rollout.mode: sync with LoRA")
        return self

    def resolved_run_dir(self) -> Path:
        return Path(self.logging.run_dir.format(name=self.name, seed=self.seed))


def _format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
            parent = _model_at(err["loc"][:-1])
            if parent is not None:
                msg += f"; allowed keys here: {', '.join(sorted(parent.model_fields))}"
        elif err["type"] == "literal_error":
            msg = f"{msg} (got {err.get('input')!r})"
        else:
            msg = f"{msg} (got {err.get('input')!r})"
        lines.append(f"  {key}: {msg}")
    return "invalid config:\n" + "\n".join(lines)


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = TrainConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = field.annotation if field is not None else None
        if ann is not None and not isinstance(ann, type):  # an optional section (`X | None`): its model
            ann = next((a for a in getattr(ann, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)),
                       None)
        if ann is None or not isinstance(ann, type) or not issubclass(ann, BaseModel):
            return None
        model = ann
    return model


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one `a.b=c` override in place (c is parsed as YAML: numbers, bools, lists...)."""
    if "=" not in assignment:
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    key, value = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set: bad key {key!r}")
    node = data
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {p!r} is not a section")
        node = child
    node[parts[-1]] = _parse_scalar(value)


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """Load YAML (or defaults if path is None), apply overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded
    for o in overrides or []:
        apply_override(data, o)
    return config_from_dict(data)


def changed_keys(cfg: TrainConfig) -> dict[str, Any]:
    """The dotted leaf keys whose values differ from the defaults (what a config file or --set changed;
    a resolved config.yaml that spells out every default changes nothing)."""

    def leaves(m: BaseModel, prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in type(m).model_fields:
            v = getattr(m, name)
            out.update(leaves(v, f"{prefix}{name}.") if isinstance(v, BaseModel) else {f"{prefix}{name}": v})
        return out

    default = leaves(TrainConfig())
    return {k: v for k, v in leaves(cfg).items() if default.get(k) != v}


def dump_config(cfg: TrainConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
