"""One `TrainConfig` -> the dotted flags of OpenRLHF's `python -m openrlhf.cli.train_ppo_ray` (>= 0.10.2).

Every key of the config is accounted for: it becomes flags or is read by the launcher or the agent executor
(`_RUNTIME_KEYS`), or, when the config changes it and OpenRLHF cannot honour it, is refused with a
`ConfigError` naming the key and the fix (`_REFUSED`). Defaults that OpenRLHF cannot honour are listed as notes in the
plan (e.g. the greedy *and* sampled eval of the local backend: OpenRLHF evaluates at one temperature).

Nothing here imports OpenRLHF: `--dry-run` works on a machine without it. `rlf_train.openrlhf.parser`
checks the flags with OpenRLHF's own parser when it is installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlf_train.config import ConfigError, TrainConfig, changed_keys

# keys read by the launcher (datasets, run dir, model export) or by the agent executor in the rollout actors
_RUNTIME_KEYS = (
    "name", "seed", "backend",
    "model.name_or_path", "model.tiny.", "model.dtype", "model.gradient_checkpointing",
    "env.",
    "rollout.prompts_per_step", "rollout.samples_per_prompt", "rollout.temperature", "rollout.top_p",
    "rollout.max_turns", "rollout.max_new_tokens_per_turn", "rollout.max_total_tokens", "rollout.max_obs_tokens",
    "algorithm.", "optim.",
    "eval.every", "eval.num_tasks", "eval.temperature", "eval.greedy", "eval.sampled",
    "logging.run_dir", "logging.tensorboard", "logging.wandb_project", "logging.wandb_mode",
    "logging.save_every", "logging.keep_last",
    "openrlhf.",
    "sessions.",  # the launcher puts them in every Ray worker's environment; the env gets sessions.backend
)  # fmt: skip

_NONE = object()
# keys OpenRLHF cannot honour when set explicitly: the one value it can take (if any), and the fix
_REFUSED: dict[str, tuple[Any, str]] = {
    "threads": (0, "torch CPU threads of the local backend; OpenRLHF's Ray actors run on GPUs (remove the key)"),
    "model.tokenizer": (_NONE, "OpenRLHF loads the tokenizer from model.name_or_path; put the tokenizer files there"),
    "model.device": ("auto", "Ray places every model on GPUs; set openrlhf.num_nodes / gpus_per_node instead"),
    "model.trust_remote_code": (True, "OpenRLHF always loads models with trust_remote_code=True (remove the key)"),
    "rollout.batch_size": (_NONE, "vLLM schedules its own batches; algorithm.micro_batch_size sets the training "
                                  "micro-batch (remove the key)"),
    "sft.enabled": (False, "backend openrlhf has no SFT stage: warm-start with backend local (or "
                           "openrlhf.cli.train_sft) and set model.name_or_path to the result"),
    "sft.": (_NONE, "backend openrlhf has no SFT stage (remove the sft section)"),
    "algorithm.eps": (_NONE, "OpenRLHF normalises group advantages with its own epsilon (remove the key)"),
    "eval.before_rl": (False, "OpenRLHF evaluates every eval.every steps, not before the first one "
                              "(set eval.before_rl: false)"),
    "logging.progress": (True, "OpenRLHF always shows its own progress bars (remove the key)"),
    # the local backend's asynchronous mode (docs/guides/async-rl.md); OpenRLHF has its own
    "rollout.mode": ("sync", "backend openrlhf trains asynchronously with openrlhf.async_train "
                             "(--train.async_enable); rollout.mode is the local backend's"),
    "rollout.max_staleness": (1, "OpenRLHF bounds staleness with openrlhf.async_queue_size "
                                 "(--train.async_queue_size); remove the key"),
    "rollout.async_worker": ("process", "OpenRLHF places rollouts on its own vLLM actors (remove the key)"),
    "rollout.partial_rollouts": (True, "use openrlhf.partial_rollout (--train.partial_rollout_enable) with "
                                       "openrlhf.async_train"),
    "rollout.engine": ("local", "backend openrlhf always generates with its own vLLM actors (remove the key)"),
    "rollout.vllm_gpu_memory_utilization": (0.3, "set openrlhf.vllm_gpu_memory_utilization for OpenRLHF's vLLM "
                                                 "actors (remove the key)"),
    "rollout.vllm_timeout_s": (600.0, "the local backend's vLLM engine deadline; OpenRLHF's vLLM actors run under "
                                      "Ray (remove the key)"),
    "rollout.async_schedule": ("free", "the local async worker's schedule; OpenRLHF schedules its own rollouts "
                                       "(remove the key)"),
    "algorithm.is_cap": (2.0, "the local backend's async correction; OpenRLHF applies its own (remove the key)"),
    "algorithm.segment_weight": ("episode", "OpenRLHF's executor returns one sample per episode (no segments to "
                                            "weigh); remove the key"),
    "logging.replay_every": (0, "replay bundles (rlf_train.replay) are written by the local backend; remove the key "
                                "(OpenRLHF saves its own checkpoints: logging.save_every)"),
    "logging.replay_weights": (False, "replay bundles are written by the local backend; remove the key"),
}

#: Whether OpenRLHF gets a LoRA policy's weights into its vLLM engines. 0.11.2 does not: `broadcast_to_vllm`
#: (openrlhf/trainer/ray/ppo_actor.py) sends the PeftModel's `named_parameters()` by name
#: (`base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`, `...lora_A.default.weight`) to vLLM's
#: `model.load_weights` (vllm_worker_wrap.py `update_weight`), which knows none of those names (OpenRLHF issues
#: #546: KeyError in update_weight; #1081: "LoRA with the vLLM backend is not supported"), and rlf's executor always
#: rolls out on OpenRLHF's vLLM actors. So `model.lora` is refused by name; `lora_flags` is the mapping a build
#: that merges the adapter before the sync would take (tested against OpenRLHF's own parser).
OPENRLHF_SYNCS_LORA = False
LORA_REFUSAL = ("OpenRLHF 0.11.2 trains LoRA (--ds.lora.rank) but cannot load the adapter into its vLLM rollout "
                "engines: its weight sync sends peft's parameter names (base_model.model...base_layer.weight, "
                "...lora_A...) to vLLM's load_weights, which fails on them (OpenRLHF issues #546, #1081), and this "
                "backend always rolls out with vLLM. Train LoRA with backend: local (docs/guides/lora.md), or "
                "remove model.lora")


def lora_flags(cfg: TrainConfig) -> list[str]:
    """`model.lora` as OpenRLHF's own LoRA flags (`--ds.lora.*` of train_ppo_ray; alpha is an int there)."""
    lo = cfg.model.lora
    if lo is None:
        return []
    return ["--ds.lora.rank", str(lo.rank), "--ds.lora.alpha", str(int(lo.alpha)), "--ds.lora.dropout",
            str(lo.dropout), "--ds.lora.target_modules", *lo.target_modules]


_ESTIMATOR = {"grpo": "group_norm", "dr_grpo": "dr_grpo", "ppo": "gae"}
_LOSS_AGG = {"token_mean": "token-mean", "seq_mean_token_mean": "seq-mean-token-mean"}
_DTYPE = {"bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class RunPaths:
    """Where OpenRLHF finds the run's files (absolute, or relative to a Ray job's working dir)."""

    model: str  # HF model id or directory (the exported tiny model for name_or_path: tiny)
    agent: str  # the AgentExecutor file (rlf_train/openrlhf/agent.py)
    prompts: str  # JSONL: {"prompt", "label", "datasource"}
    eval_prompts: str | None
    checkpoints: str
    output: str  # final HF weights
    tensorboard: str | None


@dataclass
class FlagPlan:
    flags: list[str]
    notes: list[str] = field(default_factory=list)  # defaults OpenRLHF does not honour, said out loud


def _matches(key: str, patterns: tuple[str, ...] | list[str]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in patterns)


def check_keys(cfg: TrainConfig) -> None:
    """Refuse every changed key OpenRLHF cannot honour (all problems in one error)."""
    problems = []
    lo = cfg.model.lora
    if lo is not None:  # one line for the section, not one per key
        if not OPENRLHF_SYNCS_LORA:
            problems.append(f"  model.lora: {LORA_REFUSAL}")
        if lo.alpha != int(lo.alpha):
            problems.append(f"  model.lora.alpha: OpenRLHF's --ds.lora.alpha is an integer, got {lo.alpha:g}")
    for key, value in changed_keys(cfg).items():
        if key.startswith("model.lora."):
            continue
        refusal = next((r for p, r in _REFUSED.items() if _matches(key, [p])), None)
        reason = None if refusal is None or refusal[0] == value else refusal[1]
        if refusal is None and not _matches(key, _RUNTIME_KEYS):  # a key added to TrainConfig but not mapped
            reason = "not mapped to OpenRLHF yet (remove it, or use openrlhf.extra_args)"
        if reason is not None:
            problems.append(f"  {key}: {reason}")
    a, r = cfg.algorithm, cfg.rollout
    if a.loss_agg not in _LOSS_AGG and not (a.name == "dr_grpo" and a.loss_agg == "seq_mean_token_sum_norm"):
        problems.append(f"  algorithm.loss_agg: {a.loss_agg!r} is Dr.GRPO's own aggregation (algorithm.name: "
                        f"dr_grpo); with {a.name} use token_mean or seq_mean_token_mean")
    if a.name in ("grpo", "dr_grpo") and r.samples_per_prompt < 2:
        problems.append(f"  rollout.samples_per_prompt: {a.name} needs groups of >= 2 samples, got "
                        f"{r.samples_per_prompt}")
    n_seq = r.prompts_per_step * r.samples_per_prompt
    if n_seq % a.mini_batches:
        problems.append(f"  algorithm.mini_batches: {a.mini_batches} must divide prompts_per_step x "
                        f"samples_per_prompt = {n_seq}")
    if r.max_new_tokens_per_turn >= r.max_total_tokens:
        problems.append("  rollout.max_new_tokens_per_turn: must be < rollout.max_total_tokens")
    o = cfg.openrlhf
    if o.colocate_all and not o.async_train and o.num_nodes * o.gpus_per_node != o.vllm_engines * \
            o.vllm_tensor_parallel_size:
        problems.append(f"  openrlhf.vllm_engines: with colocate_all, vllm_engines x vllm_tensor_parallel_size "
                        f"({o.vllm_engines} x {o.vllm_tensor_parallel_size}) must equal num_nodes x gpus_per_node "
                        f"({o.num_nodes} x {o.gpus_per_node})")
    if o.vllm_enable_sleep and not o.colocate_all:
        problems.append("  openrlhf.vllm_enable_sleep: needs openrlhf.colocate_all: true")
    if o.async_train and (o.vllm_enable_sleep or o.deepspeed_enable_sleep):
        problems.append("  openrlhf.async_train: set vllm_enable_sleep and deepspeed_enable_sleep to false "
                        "(rollouts and training run at the same time)")
    if (o.partial_rollout or o.async_queue_size != 1) and not o.async_train:
        key = "partial_rollout" if o.partial_rollout else "async_queue_size"
        problems.append(f"  openrlhf.{key}: needs openrlhf.async_train: true (OpenRLHF's async mode)")
    if o.packing_samples and "flash_attention" not in o.attn_implementation:
        problems.append("  openrlhf.packing_samples: needs a flash_attention attn_implementation "
                        f"(got {o.attn_implementation!r}); set packing_samples: false for sdpa/eager")
    if problems:
        raise ConfigError("backend openrlhf cannot honour these keys:\n" + "\n".join(problems))


def eval_temperature(cfg: TrainConfig) -> float:
    """OpenRLHF evaluates at one temperature: greedy (0) unless only the sampled eval is asked for."""
    e = cfg.eval
    return e.temperature if e.sampled and not e.greedy else 0.0


def openrlhf_flags(cfg: TrainConfig, paths: RunPaths) -> FlagPlan:
    """The flags for `openrlhf.cli.train_ppo_ray` (after `check_keys`)."""
    check_keys(cfg)
    a, r, o, opt, e, lg = cfg.algorithm, cfg.rollout, cfg.openrlhf, cfg.optim, cfg.eval, cfg.logging
    notes: list[str] = []
    f: list[str] = []

    def add(flag: str, value: Any = True) -> None:
        if value is True:
            f.append(flag)
        elif value is not False and value is not None:
            f.extend([flag, *(str(v) for v in value)] if isinstance(value, list | tuple) else [flag, str(value)])

    # model, cluster layout, DeepSpeed, vLLM
    add("--actor.model_name_or_path", paths.model)
    add("--ds.param_dtype", _DTYPE.get(cfg.model.dtype, "bf16"))
    if cfg.model.dtype not in _DTYPE:
        notes.append(f"model.dtype: {cfg.model.dtype} -> bfloat16 (OpenRLHF trains in bf16 or fp16; set "
                     "model.dtype: bfloat16 to silence this)")
    add("--actor.gradient_checkpointing_enable", cfg.model.gradient_checkpointing)
    f.extend(lora_flags(cfg))
    add("--actor.num_nodes", o.num_nodes)
    add("--actor.num_gpus_per_node", o.gpus_per_node)
    add("--ref.num_nodes", o.num_nodes)
    add("--ref.num_gpus_per_node", o.gpus_per_node)
    add("--vllm.num_engines", o.vllm_engines)
    add("--vllm.tensor_parallel_size", o.vllm_tensor_parallel_size)
    add("--vllm.gpu_memory_utilization", o.vllm_gpu_memory_utilization)
    add("--vllm.enable_sleep", o.vllm_enable_sleep)
    add("--vllm.enable_prefix_caching", o.vllm_enable_prefix_caching)
    add("--vllm.enforce_eager", o.vllm_enforce_eager)
    add("--train.colocate_all", o.colocate_all)
    add("--train.colocate_actor_ref", not o.colocate_all and a.kl_coef > 0)
    add("--ds.zero_stage", o.zero_stage)
    add("--ds.adam_offload", o.adam_offload)
    add("--ref.offload", o.ref_offload)
    add("--ds.enable_sleep", o.deepspeed_enable_sleep)
    add("--ds.packing_samples", o.packing_samples)
    add("--ds.attn_implementation", o.attn_implementation)
    add("--train.async_enable", o.async_train)
    if o.async_queue_size != 1:
        add("--train.async_queue_size", o.async_queue_size)
    add("--train.partial_rollout_enable", o.partial_rollout)
    add("--train.seed", cfg.seed)

    # data: prompts rendered by the env, labels = the task as JSON; the agent executor runs the episodes
    add("--train.agent_func_path", paths.agent)
    add("--data.prompt_dataset", paths.prompts)
    add("--data.input_key", "prompt")
    add("--data.label_key", "label")
    add("--data.max_len", r.max_total_tokens)
    add("--rollout.max_new_tokens", r.max_new_tokens_per_turn)
    add("--train.num_episodes", 1)  # the prompt file holds exactly algorithm.steps x prompts_per_step prompts

    # rollout and algorithm
    n_seq = r.prompts_per_step * r.samples_per_prompt
    add("--rollout.batch_size", r.prompts_per_step)
    add("--rollout.n_samples_per_prompt", r.samples_per_prompt)
    add("--rollout.temperature", r.temperature)
    add("--rollout.top_p", r.top_p)
    add("--rollout.micro_batch_size", a.micro_batch_size)
    add("--train.micro_batch_size", a.micro_batch_size)
    add("--train.batch_size", n_seq // a.mini_batches)
    add("--train.max_epochs", a.ppo_epochs)
    add("--algo.advantage.estimator", _ESTIMATOR[a.name])
    add("--algo.advantage.no_std_norm", a.name == "grpo" and not a.std_normalize)
    if a.name == "dr_grpo" and a.std_normalize:
        notes.append("algorithm.std_normalize: OpenRLHF's dr_grpo never divides by the group std")
    if a.loss_agg in _LOSS_AGG:
        add("--actor.loss_agg_mode", _LOSS_AGG[a.loss_agg])
    add("--actor.eps_clip_low_high", [a.clip_eps_low, a.clip_eps_high])
    add("--algo.kl.init_coef", a.kl_coef)
    if a.kl_coef > 0 and a.name != "ppo":  # GRPO: k3 KL as a loss term (PPO: k1 KL in the reward)
        add("--algo.kl.use_loss")
        add("--algo.kl.estimator", "k3")
    if a.name == "ppo":
        add("--critic.model_name_or_path", o.critic_name_or_path or paths.model)
        add("--critic.num_nodes", o.num_nodes)
        add("--critic.num_gpus_per_node", o.gpus_per_node)
        add("--critic.adam.lr", a.critic_lr if a.critic_lr is not None else o.critic_lr)
        add("--critic.value_clip", a.value_clip)
        add("--algo.advantage.gamma", a.gamma)
        add("--algo.advantage.lambd", a.lam)
        if a.critic == "value_head":
            notes.append("algorithm.critic: value_head -> OpenRLHF trains a separate critic (openrlhf.critic_*); "
                         "algorithm.vf_coef does not apply")
    if not a.per_turn_rewards:
        notes.append("algorithm.per_turn_rewards: false -> the executor returns the outcome reward only")
    else:
        notes.append("algorithm.per_turn_rewards: OpenRLHF takes one reward per sample; per-turn rewards are "
                     "added to the outcome (the local backend uses them as reward-to-go)")

    # optimiser: constant lr after a linear warm-up, as the local backend
    add("--actor.adam.lr", opt.lr)
    add("--actor.adam.weight_decay", opt.weight_decay)
    add("--actor.adam.betas", list(opt.betas))
    add("--actor.max_norm", opt.grad_clip)
    add("--actor.lr_scheduler", "constant_with_warmup")
    add("--actor.lr_warmup_ratio", round(min(1.0, opt.warmup_steps / max(a.steps, 1)), 6))

    # eval on the eval split
    if paths.eval_prompts is not None and (e.greedy or e.sampled):
        add("--eval.dataset", paths.eval_prompts)
        add("--eval.steps", e.every or a.steps)
        add("--eval.temperature", eval_temperature(cfg))
        add("--eval.n_samples_per_prompt", 1)
        if e.greedy and e.sampled:
            notes.append("eval: OpenRLHF evaluates at one temperature: greedy only (set eval.greedy: false for "
                         f"T={e.temperature})")
        if e.before_rl:
            notes.append("eval.before_rl: OpenRLHF does not evaluate before the first step")

    # checkpoints and logs
    add("--ckpt.path", paths.checkpoints)
    add("--ckpt.output_dir", paths.output)
    add("--ckpt.load_enable")  # --resume continues from the latest checkpoint; a fresh run dir has none
    add("--ckpt.save_steps", lg.save_every or -1)
    add("--ckpt.max_num", lg.keep_last)
    add("--ckpt.save_hf", o.save_hf)
    add("--logger.logging_steps", 1)
    if lg.tensorboard and paths.tensorboard is not None:
        add("--logger.tensorboard_dir", paths.tensorboard)
    if lg.wandb_project is not None and lg.wandb_mode != "disabled":
        add("--logger.wandb.project", lg.wandb_project)
        add("--logger.wandb.run_name", cfg.name)
        add("--logger.wandb.key", "$WANDB_API_KEY")  # filled from the environment at launch, never written

    f.extend(o.extra_args)
    return FlagPlan(f, notes)
