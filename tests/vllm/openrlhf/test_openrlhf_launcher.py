"""`backend: openrlhf` launcher (tox -e openrlhf): the same YAML -> OpenRLHF's flags, checked by OpenRLHF's own
parser from the installed package; every config key is mapped or refused by name; the run dir holds what the
run needs; the shipped recipes dry-run."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
from openrlhf_support import ROOT, openrlhf_modules, read_jsonl, search_config

from rlf_train.cli import main
from rlf_train.config import ConfigError, TrainConfig, load_config
from rlf_train.openrlhf.flags import openrlhf_flags
from rlf_train.openrlhf.launcher import AGENT_FILE, COMMAND_FILE, prepare
from rlf_train.openrlhf.parser import OpenRLHFFlagError, openrlhf_options, parse_flags

SHIPPED_TRAIN = ROOT / "rlf_envs" / "src" / "rlf_envs" / "data" / "search" / "train.jsonl"
SHIPPED_TEST = ROOT / "rlf_envs" / "src" / "rlf_envs" / "data" / "search" / "test.jsonl"


def test_openrlhfs_own_parser_and_validation_are_used() -> None:
    with pytest.raises(OpenRLHFFlagError, match="unrecognized arguments: --rollout.samples"):
        parse_flags(["--rollout.samples", "4"])
    with pytest.raises(OpenRLHFFlagError, match="group_norm requires n_samples_per_prompt > 1"):
        parse_flags(["--algo.advantage.estimator", "group_norm"])
    args = parse_flags(["--train.agent_func_path", "a.py"])
    assert args.reward.remote_url == ["agent"]  # OpenRLHF's own post-processing ran


@pytest.mark.parametrize("recipe", ["search_qwen3_4b.yaml", "search_qwen3_0.6b_1gpu.yaml"])
def test_shipped_recipes_dry_run(recipe: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sets = ["--set", f"logging.run_dir={tmp_path}/run", "--set", "algorithm.steps=2"]
    if recipe == "search_qwen3_4b.yaml":  # its Search-R1 parquet files live on the GPU machine
        sets += ["--set", f"env.kwargs.tasks={SHIPPED_TRAIN}", "--set", f"env.eval_kwargs.tasks={SHIPPED_TEST}"]
    assert main(["--config", str(ROOT / "configs" / recipe), "--dry-run", *sets]) == 0
    out = capsys.readouterr().out
    assert "flags: checked by OpenRLHF 0.11" in out
    run = tmp_path / "run"
    cfg = load_config(ROOT / "configs" / recipe, [s for s in sets if s != "--set"])
    script = (run / COMMAND_FILE).read_text()
    argv = shlex.split(script.split("set -euo pipefail\n", 1)[1].replace("\\\n", " "))
    flags = argv[argv.index("openrlhf.cli.train_ppo_ray") + 1:]
    env = dict(a.split("=", 1) for a in argv if a.startswith(("RLF_OPENRLHF_CONFIG=", "RAY_ADDRESS=")))
    args = parse_flags(flags)
    assert env["RAY_ADDRESS"] == "local"
    assert TrainConfig.model_validate(json.loads(env["RLF_OPENRLHF_CONFIG"])) == cfg
    r = cfg.rollout
    assert args.actor.model_name_or_path == cfg.model.name_or_path
    assert args.train.agent_func_path == str(AGENT_FILE)
    assert args.algo.advantage.estimator == "group_norm"
    assert args.rollout.n_samples_per_prompt == r.samples_per_prompt
    assert args.rollout.batch_size == r.prompts_per_step
    assert args.data.max_len == r.max_total_tokens and args.rollout.max_new_tokens == r.max_new_tokens_per_turn
    assert args.algo.kl.use_loss and args.algo.kl.estimator == "k3" and args.algo.kl.init_coef == cfg.algorithm.kl_coef
    assert args.actor.adam.lr == cfg.optim.lr and args.eval.temperature == 0.0
    assert args.data.input_key == "prompt" and args.data.label_key == "label" and not args.data.apply_chat_template
    assert len(read_jsonl(Path(args.data.prompt_dataset))) == 2 * r.prompts_per_step
    evals = read_jsonl(Path(args.eval.dataset))
    assert len(evals) == min(cfg.eval.num_tasks, len(SHIPPED_TEST.read_text().splitlines()))
    assert all(e["prompt"].startswith("<|im_start|>user\n") for e in evals)  # chat_wrap for Qwen3


def test_tiny_model_is_exported_as_a_hf_model(bm25_index_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = search_config(bm25_index_dir, tmp_path / "run")
    launch = prepare(cfg)
    args = parse_flags(launch.plan.flags)
    model_dir = Path(args.actor.model_name_or_path)
    assert model_dir == tmp_path / "run" / "tiny_model"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    from rlf_train.policy.tokenizer import load_tokenizer

    ours = load_tokenizer(cfg.model)
    text = read_jsonl(Path(args.data.prompt_dataset))[0]["prompt"] + "<search> x</search>"
    assert tok.encode(text, add_special_tokens=False) == ours.encode(text, add_special_tokens=False)
    assert model.config.vocab_size == len(ours)


def test_resume_and_existing_run_dir(bm25_index_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = search_config(bm25_index_dir, tmp_path / "run")
    prepare(cfg)
    with pytest.raises(FileExistsError, match="--resume"):
        prepare(cfg)
    launch = prepare(cfg, resume=True)
    assert "--ckpt.load_enable" in launch.plan.flags
    # no GPU here: a real start stops with a clear message (exit 2), after writing the run dir
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text((tmp_path / "run" / "config.yaml").read_text())
    assert main(["--config", str(cfg_path), "--set", f"logging.run_dir={tmp_path}/run2"]) == 2
    assert "needs NVIDIA GPUs" in capsys.readouterr().err


def test_remote_cluster_submission(bm25_index_dir: Path, tmp_path: Path) -> None:
    cfg = search_config(bm25_index_dir, tmp_path / "run", **{"openrlhf.ray_address": "http://10.0.0.1:8265"})
    with pytest.raises(ConfigError, match="openrlhf.shared_dir"):
        prepare(cfg)
    cfg = search_config(bm25_index_dir, tmp_path / "run", **{"openrlhf.ray_address": "http://10.0.0.1:8265",
                                                             "openrlhf.shared_dir": "/shared/runs"})
    launch = prepare(cfg)
    assert launch.argv[:5] == ["ray", "job", "submit", "--address", "http://10.0.0.1:8265"]
    runtime_env = json.loads(launch.argv[launch.argv.index("--runtime-env-json") + 1])
    assert runtime_env["working_dir"] == str(tmp_path / "run")
    assert json.loads(runtime_env["env_vars"]["RLF_OPENRLHF_CONFIG"]) == cfg.model_dump(mode="json")
    args = parse_flags(launch.argv[launch.argv.index("openrlhf.cli.train_ppo_ray") + 1:])
    assert args.train.agent_func_path == "rlf_agent.py" and (tmp_path / "run" / "rlf_agent.py").is_file()
    assert args.data.prompt_dataset == "data/train.jsonl" and args.actor.model_name_or_path == "tiny_model"
    assert args.ckpt.path == "/shared/runs/orl-test/ckpt"
    vllm_engine, _ = openrlhf_modules()
    import os

    old = os.getcwd()
    os.chdir(tmp_path / "run")  # a Ray job runs in its working dir
    try:
        os.environ["RLF_OPENRLHF_CONFIG"] = runtime_env["env_vars"]["RLF_OPENRLHF_CONFIG"]
        assert vllm_engine._load_agent_executor(args.train.agent_func_path).cfg == cfg
    finally:
        os.environ.pop("RLF_OPENRLHF_CONFIG", None)
        os.chdir(old)


def _leaves(model: Any, prefix: str = "") -> dict[str, Any]:
    from pydantic import BaseModel

    out: dict[str, Any] = {}
    for name in type(model).model_fields:
        v = getattr(model, name)
        if isinstance(v, BaseModel):
            out.update(_leaves(v, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = v
    return out


def _other(key: str, value: Any) -> Any:
    """A valid value different from `value` for this key."""
    special = {"backend": None, "algorithm.name": "dr_grpo", "algorithm.loss_agg": "seq_mean_token_mean",
               "model.dtype": "float16", "model.name_or_path": "Qwen/Qwen3-0.6B",
               "model.device": "cuda", "env.id": None, "openrlhf.attn_implementation": "flash_attention_2",
               "openrlhf.ray_address": None, "openrlhf.vllm_tensor_parallel_size": None,
               "openrlhf.vllm_engines": None, "openrlhf.gpus_per_node": None, "openrlhf.num_nodes": None,
               "openrlhf.zero_stage": 2, "rollout.samples_per_prompt": 4, "algorithm.mini_batches": 2,
               "openrlhf.env_vars": {"NCCL_DEBUG": "INFO"}, "openrlhf.extra_args": ["--ds.use_liger_kernel"],
               "env.kwargs": None, "env.eval_kwargs": {"topk": 2}, "env.imports": ["rlf_envs", "no_such_module"],
               "env.train_split": None, "env.eval_split": "train", "logging.run_dir": None,
               "model.tiny.tokenizer_file": "quickstart_tokenizer.json", "model.tokenizer": "Qwen/Qwen3-0.6B",
               "openrlhf.shared_dir": None,
               "logging.wandb_project": "p", "openrlhf.packing_samples": None, "openrlhf.async_train": None,
               "openrlhf.vllm_enable_sleep": None, "openrlhf.colocate_all": None,
               "name": None,  # names the run dir (here given explicitly) and the W&B run
               "eval.temperature": None,  # used with eval.sampled only: see test_refusals_are_one_clear_error
               "logging.wandb_mode": None,  # used with logging.wandb_project only (WANDB_MODE)
               "openrlhf.critic_lr": None, "openrlhf.critic_name_or_path": None,  # ppo only: see test_refusals
               "model.tiny.num_heads": 8, "model.tiny.num_kv_heads": 1, "model.tiny.hidden_size": 128,
               "rollout.max_total_tokens": 600, "rollout.max_new_tokens_per_turn": 20,
               "rollout.mode": "async", "rollout.async_worker": "thread", "rollout.engine": "vllm",
               "rollout.async_schedule": "fixed",
               "model.tiny.tokenizer_vocab_size": 1000,  # below the shipped one: a tokenizer is trained
               "model.lora": {"rank": 8},  # refused by name (flags.LORA_REFUSAL); see test_lora_keys_*
               # PPO's critic keys with grpo: refused by name (tests/train/test_ppo.py maps them for ppo)
               "algorithm.critic": "separate", "algorithm.critic_lr": 1e-5, "algorithm.gamma": 0.99,
               "algorithm.lam": 0.9, "algorithm.vf_coef": 1.0, "algorithm.value_clip": 0.3,
               "algorithm.segment_weight": "segment"}
    if key in special:
        return special[key]
    if value is None:
        return "other"
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return round(value * 0.5 + 0.05, 6)
    if isinstance(value, tuple):
        return (0.8, 0.9)
    raise AssertionError(f"no test value for {key}={value!r}: add one")


def _effect(launch: Any, cfg: TrainConfig) -> tuple[Any, ...]:
    """What the run sees besides the flags: the prompt files, the exported model, and the envs the rollout
    actors build for each split."""
    from rlf_train.openrlhf.executor import RlfAgentExecutor
    from rlf_train.policy.tokenizer import load_tokenizer

    ex = RlfAgentExecutor(cfg)
    ex._tokenizer = load_tokenizer(cfg.model)
    envs = []
    for split in ("train", "eval"):
        env = ex.new_env(split, cfg.rollout.max_total_tokens)
        envs.append((type(env), env.max_turns, env.max_obs_tokens, env.max_total_tokens, env.format.name,
                     env.search_tool.default_topk, len(env.tasks)))
    files = [p.read_bytes() for p in sorted(launch.run_dir.rglob("*")) if p.is_file()
             and p.name not in ("config.yaml", COMMAND_FILE, "openrlhf_plan.txt")]
    return (files, ex.settings, envs)


ALWAYS_SO = {("model.trust_remote_code", "True")}  # OpenRLHF loads every model with trust_remote_code=True


def _norm(launch: Any) -> tuple[Any, ...]:
    """The flags (run dir aside), the notes the plan prints about defaults OpenRLHF does not honour, and the
    env vars of the command."""
    env = {k: v for k, v in launch.env.items() if k != "RLF_OPENRLHF_CONFIG"}
    return [f.replace(str(launch.run_dir), "RUN_DIR") for f in launch.plan.flags], launch.plan.notes, env


def test_every_key_is_mapped_consumed_or_refused_by_name(bm25_index_dir: Path, tmp_path: Path) -> None:
    base_cfg = search_config(bm25_index_dir, tmp_path / "base")
    base = prepare(base_cfg)
    skipped = []
    for key, value in _leaves(base_cfg).items():
        new = _other(key, value)
        if new is None:  # layout keys whose other values need other keys too: covered by the recipes' tests
            skipped.append(key)
            continue
        run_dir = tmp_path / key
        try:
            cfg = search_config(bm25_index_dir, run_dir, **{key: new, "logging.run_dir": str(run_dir)})
            launch = prepare(cfg)
        except (ConfigError, ValueError) as e:
            assert key in str(e), f"{key}: refused without naming it: {e}"
            continue
        if _norm(launch) != _norm(base) or (key, repr(new)) in ALWAYS_SO:
            continue  # mapped to flags (or said in a note), or what OpenRLHF always does
        assert _effect(launch, cfg) != _effect(base, base_cfg), f"{key}={new!r} changed nothing the run sees"
    assert len(skipped) < 24, skipped


def test_refusals_are_one_clear_error(bm25_index_dir: Path, tmp_path: Path) -> None:
    cfg = search_config(bm25_index_dir, tmp_path / "r", **{"sft.enabled": True, "threads": 2,
                                                           "algorithm.loss_agg": "seq_mean_token_sum_norm"})
    with pytest.raises(ConfigError) as e:
        openrlhf_flags(cfg, None)  # type: ignore[arg-type]
    msg = str(e.value)
    assert "sft.enabled: backend openrlhf has no SFT stage" in msg and "threads:" in msg
    assert "algorithm.loss_agg" in msg
    with pytest.raises(ValueError, match="algorithm.gamma: PPO's critic settings apply to algorithm.name: ppo only"):
        search_config(bm25_index_dir, tmp_path / "r", **{"algorithm.gamma": 0.9})
    ppo = search_config(bm25_index_dir, tmp_path / "ppo", **{"algorithm.name": "ppo"})
    args = parse_flags(prepare(ppo).plan.flags)
    assert args.algo.advantage.estimator == "gae" and args.critic.model_name_or_path == args.actor.model_name_or_path
    assert not args.algo.kl.use_loss
    sampled = search_config(bm25_index_dir, tmp_path / "s", **{"eval.greedy": False, "eval.sampled": True,
                                                               "eval.temperature": 0.7})
    assert parse_flags(prepare(sampled).plan.flags).eval.temperature == 0.7


def test_async_and_partial_rollout_reach_openrlhfs_parser(bm25_index_dir: Path, tmp_path: Path) -> None:
    base = {"openrlhf.async_train": True, "openrlhf.vllm_enable_sleep": False,
            "openrlhf.deepspeed_enable_sleep": False}
    cfg = search_config(bm25_index_dir, tmp_path / "a", **base, **{"openrlhf.partial_rollout": True,
                                                                  "openrlhf.async_queue_size": 3})
    args = parse_flags(prepare(cfg).plan.flags)
    assert args.train.async_enable and args.train.partial_rollout_enable and args.train.async_queue_size == 3
    plain = parse_flags(prepare(search_config(bm25_index_dir, tmp_path / "p", **base)).plan.flags)
    assert plain.train.async_enable and not plain.train.partial_rollout_enable and plain.train.async_queue_size == 1
    with pytest.raises(ConfigError, match="openrlhf.partial_rollout: needs openrlhf.async_train: true"):
        prepare(search_config(bm25_index_dir, tmp_path / "b", **{"openrlhf.partial_rollout": True}))
    # the rule is OpenRLHF's own too: its parser refuses the same combination
    with pytest.raises(OpenRLHFFlagError, match="partial_rollout_enable requires --train.async_enable"):
        parse_flags(["--train.agent_func_path", "a.py", "--train.partial_rollout_enable"])


def test_openrlhf_options_are_the_installed_parsers() -> None:
    opts = openrlhf_options()
    assert {"--train.async_enable", "--train.async_queue_size", "--train.partial_rollout_enable",
            "--train.agent_func_path", "--vllm.sync_backend"} <= opts
    assert "--rollout.samples" not in opts and all(o.startswith("-") for o in opts)
    assert openrlhf_options() is opts  # read once per process


def test_lora_keys_map_to_openrlhfs_own_flags_and_are_refused_by_name(bm25_index_dir: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`model.lora` -> `--ds.lora.*` (OpenRLHF's own parser takes them, with every other flag of the run); refused
    by name as long as OpenRLHF cannot sync a LoRA policy into its vLLM engines (flags.OPENRLHF_SYNCS_LORA)."""
    from rlf_train.openrlhf import flags

    lora = {"model.lora": {"rank": 8, "alpha": 16, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}}
    with pytest.raises(ConfigError, match=r"model\.lora: OpenRLHF 0\.11\.2 trains LoRA .*#546") as e:
        prepare(search_config(bm25_index_dir, tmp_path / "r", **lora))
    assert [ln for ln in str(e.value).splitlines() if ln.strip().startswith("model.lora")] == [
        f"  model.lora: {flags.LORA_REFUSAL}"]  # one line for the section
    with pytest.raises(ConfigError, match=r"model\.lora\.alpha: OpenRLHF's --ds\.lora\.alpha is an integer"):
        prepare(search_config(bm25_index_dir, tmp_path / "a", **{"model.lora": {"alpha": 2.5}}))
    monkeypatch.setattr(flags, "OPENRLHF_SYNCS_LORA", True)
    args = parse_flags(prepare(search_config(bm25_index_dir, tmp_path / "ok", **lora)).plan.flags)
    assert (args.ds.lora.rank, args.ds.lora.alpha, args.ds.lora.dropout) == (8, 16, 0.05)
    assert args.ds.lora.target_modules == ["q_proj", "v_proj"]
    plain = parse_flags(prepare(search_config(bm25_index_dir, tmp_path / "p")).plan.flags)
    assert plain.ds.lora.rank == 0  # no model.lora: OpenRLHF's default, full weights


def test_the_sessions_section_reaches_every_ray_worker(bm25_index_dir: Path, tmp_path: Path) -> None:
    from rlf_train.config import SessionsConfig

    # (model_copy: the search env takes no session backend, so the section's env.kwargs.backend is left out here;
    # what is tested is that the launcher hands the section's settings to every Ray worker)
    cfg = search_config(bm25_index_dir, tmp_path / "run").model_copy(
        update={"sessions": SessionsConfig(backend="ray", nodes="resource:sandbox", per_node=16)})
    launch = prepare(cfg)
    assert launch.env["RLF_RAY_SESSION_NODES"] == "resource:sandbox"
    assert launch.env["RLF_RAY_SESSIONS_PER_NODE"] == "16" and launch.env["RLF_RAY_SESSION_INNER"] == "local"
    assert "export RLF_RAY_SESSION_NODES=resource:sandbox" in launch.script()
