"""The local backend's loop: optional SFT warm start, then GRPO on the episodes a rollout source gives
(`rlf_train.rollout`), with eval, checkpoints, exact resume, metrics (JSONL + TensorBoard [+ W&B]), progress bar
and reward curve."""

from __future__ import annotations

import copy
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlf_envs import runtime
from rlf_envs.env.vector import ToolVectorEnv
from rlf_envs.records import record_text_sample, sample_records, write_trajectories
from rlf_envs.types import Trajectory
from rlf_train.agreement import agreement_stats, has_behaviour, staleness
from rlf_train.bundle import BundleTrace, MicroStep, bundle_dir, code_hash, state_hash, tokenizer_hash, write_bundle
from rlf_train.config import ConfigError, TrainConfig, dump_config
from rlf_train.group_reward import GroupReward
from rlf_train.grpo import (
    behaviour_logprobs,
    check_groups,
    masked_logprobs,
    policy_loss,
    row_advantages,
    segment_weights,
    token_advantages,
    token_returns,
)
from rlf_train.logging_utils import MetricsLogger, Progress, plot_reward_curve, write_json_atomic
from rlf_train.policy import lora
from rlf_train.policy.checkpoint import (
    CheckpointMeta,
    latest_checkpoint,
    load_weights,
    prepare_run_dir,
    read_checkpoint,
    remove_checkpoints,
    save_checkpoint,
)
from rlf_train.policy.load import load_policy
from rlf_train.policy.model import num_parameters, resolve_device
from rlf_train.policy.tokenizer import load_tokenizer
from rlf_train.ppo import Critic, explained_variance, gae, token_rewards, value_loss, whiten
from rlf_train.rollout.async_worker import Admission, AsyncPlan, RolloutWorker
from rlf_train.rollout.batch import (
    Rollouts,
    SamplingParams,
    drop_infra_failed,
    episode_stats,
    is_success,
    reward_stats,
)
from rlf_train.rollout.env_factory import Stage, env_tasks, make_envs
from rlf_train.rollout.seeds import seed_base
from rlf_train.rollout.source import Source, make_source
from rlf_train.rollout.vllm import VllmRollout, check_policy_shape
from rlf_train.sft import Demo, check_scripted_demos, demo_trajectories, load_demos, pad_batch, scripted_demos, sft_loss
from rlf_train.watch import RunWatch


class Trainer:
    """The local backend (`backend: local`): one process that runs SFT, then GRPO, on one device.

    It holds the learner's state (policy, optimizer, RNG streams, data order) and the loop: draw prompts, ask the
    rollout source (`self.source`, built by `rlf_train.rollout.make_source`) for their episodes, update, log, eval,
    checkpoint. Where the episodes come from (the env with the local or vLLM engine, or an agent's own code) is the
    source's business, so the loop is the same for all of them, and a killed run resumes bit-identically."""

    @classmethod
    def for_replay(cls, cfg: TrainConfig, run_dir: Path, model: torch.nn.Module, tokenizer: Any,
                   tasks: dict[int, Any], policy_version: int) -> Trainer:
        """A learner without envs, engine or logger, for `rlf_train.replay`: `update` runs on recorded rows exactly as
        in the run (`tasks`: the batch's task index -> Task, for the group checks)."""
        tr = cls.__new__(cls)
        tr.cfg, tr.run_dir, tr.model, tr.tokenizer = cfg, Path(run_dir), model, tokenizer
        tr.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        tr.device = next(model.parameters()).device
        tr.train_tasks = tasks  # type: ignore[assignment]
        tr.group_reward = None  # the recorded rewards already hold the group judge's scores
        tr.policy_version = policy_version
        tr.ref_model = lora.AdapterOff(model) if cfg.algorithm.kl_coef > 0 and lora.is_lora(model) else None
        tr.meta, tr.state, tr.critic = None, None, None
        return tr

    def __init__(self, cfg: TrainConfig, run_dir: Path | None = None, resume: bool = False) -> None:
        """Everything that can be checked before training work starts is checked here (tokenizer, device,
        env ids/kwargs/splits, demos, run dir): a mistake raises ConfigError naming the key."""
        self.cfg = cfg
        self.run_dir = Path(run_dir) if run_dir is not None else cfg.resolved_run_dir()
        self.resume = resume
        if cfg.backend != "local":
            raise ValueError(f"Trainer is the local backend; backend={cfg.backend!r}")
        if cfg.sessions is not None:  # read by the session backend when the envs open it (rlf_envs...sessions.ray)
            os.environ.update(cfg.sessions.env_vars())
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.tokenizer = load_tokenizer(cfg.model)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        resolve_device(cfg.model.device)
        self.meta: CheckpointMeta | None = None
        self.state: dict[str, Any] | None = None
        ckpt = None
        if resume:
            if not (self.run_dir / "config.yaml").is_file():
                raise FileNotFoundError(f"--resume {self.run_dir}: no run there (no config.yaml); check the path, "
                                        "or start a new run without --resume")
            ckpt = latest_checkpoint(self.run_dir)
            if ckpt is not None:
                self.meta, self.state = read_checkpoint(ckpt)
            # no checkpoint yet (killed before the first one): the run starts over in the same dir
        elif (self.run_dir / "metrics.jsonl").exists() or latest_checkpoint(self.run_dir) is not None:
            raise FileExistsError(f"run dir {self.run_dir} already holds a run; continue it with --resume "
                                  f"{self.run_dir}, or pick another logging.run_dir / name (or delete that dir)")
        r = cfg.rollout
        self.n_rollout = r.prompts_per_step * r.samples_per_prompt
        self.train_envs = make_envs(cfg, self.tokenizer, "train", self.n_rollout)
        self.train_tasks = env_tasks(self.train_envs.envs[0])
        # group_reward: a group verifier (e.g. a judge ranking each GRPO group) gives the training reward
        self.group_reward = GroupReward.from_config(cfg.group_reward, self.train_envs.envs[0])
        if self.group_reward is not None:
            self.group_reward.check_endpoint()  # a judge that cannot answer: refused now, not 1,600 lines later
        # built now, not at the first eval: a wrong env.eval_split must fail before the SFT stage, not after
        self._eval_envs: ToolVectorEnv = make_envs(cfg, self.tokenizer, "eval", min(cfg.eval.num_tasks, r.batch_size))
        env_tasks(self._eval_envs.envs[0])
        self.demos = self._demos() if cfg.sft.enabled and cfg.sft.steps > 0 else []
        prepare_run_dir(self.run_dir)
        (self.run_dir / "config.yaml").write_text(dump_config(cfg))
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.model = load_policy(cfg.model, self.tokenizer, cfg.seed, weights_dir=ckpt)
        self.device = next(self.model.parameters()).device
        # rollout.engine vllm: built at the first rollout, its weights reloaded whenever policy_version moved on
        # (every update, the end of SFT)
        self.policy_version = 0
        if r.engine == "vllm":
            mc = self.model.config
            check_policy_shape(mc.hidden_size, mc.num_attention_heads, self.device.type == "cpu")
        envs: dict[Stage, ToolVectorEnv] = {"train": self.train_envs, "eval": self._eval_envs}
        # where episodes come from: the env with the configured engine, or the agent's code (rlf_train.rollout)
        self.source: Source = make_source(cfg, self.tokenizer, envs, self.run_dir, lambda: self.model,
                                          lambda: self.policy_version)
        self.gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.data_rng = np.random.default_rng(cfg.seed + 2)
        self.order: list[int] = []
        self.order_pos = 0
        self.ref_model: torch.nn.Module | lora.AdapterOff | None = None
        self.critic: Critic | None = None  # algorithm.name: ppo (built when RL starts)
        self.admission: Admission | None = None  # async RL: the staleness bound, with a log of every start
        self.async_worker: RolloutWorker | None = None
        # applied to the train envs before RL (in the async worker process too; must then be picklable): e.g.
        # benchmarks/async_training.py's slow-search wrapper
        self.train_env_hook: Callable[[ToolVectorEnv], None] | None = None
        self.watch: RunWatch | None = None  # warnings while the run trains (rlf_train.watch)
        self.logger = MetricsLogger(self.run_dir, tensorboard=cfg.logging.tensorboard,
                                    wandb_project=cfg.logging.wandb_project, wandb_mode=cfg.logging.wandb_mode,
                                    config_dict=cfg.model_dump(mode="json"))
        # rows logged after the checkpoint we continue from are dropped (they are logged again), so a resumed
        # run's metrics.jsonl / TensorBoard hold each step once
        self.logger.resume_from(self._kept_steps())
        self.evals: list[dict[str, Any]] = []
        if self.meta is not None and (self.run_dir / "eval.json").is_file():
            import json

            kept = self._kept_steps()["eval"]
            self.evals = [e for e in json.loads((self.run_dir / "eval.json").read_text()).get("evals", [])
                          if e["step"] <= kept]

    def _kept_steps(self) -> dict[str, float]:
        """Last step of each stage's metrics that the checkpoint we start from already includes."""
        m = self.meta
        if m is None:
            return {"sft": -1, "rl": -1, "eval": -1}
        if m.stage == "rl":
            return {"sft": math.inf, "rl": m.step, "eval": m.step}
        return {"sft": math.inf if m.sft_done else m.step, "rl": -1, "eval": -1}

    def _demos(self) -> list[Demo]:
        """SFT demonstrations (from sft.demos_path, else scripted), checked against the train tasks."""
        c = self.cfg.sft
        if c.demos_path:
            demos = load_demos(c.demos_path)
            bad = [d.task_index for d in demos if not 0 <= d.task_index < len(self.train_tasks)]
            if bad:
                raise ConfigError(f"sft.demos_path {c.demos_path}: task_index {bad[0]} is out of range (the "
                                  f"{self.cfg.env.train_split!r} split has {len(self.train_tasks)} tasks; "
                                  f"{len(bad)} demos affected); fix the file or point sft.demos_path elsewhere")
            return demos
        check_scripted_demos(self.train_envs.envs[0], self.cfg.env.id)
        fmt_name = getattr(self.train_envs.envs[0].format, "name", "search_r1")
        return scripted_demos(self.train_tasks, c.num_demos, fmt_name, c.p_no_search, c.p_wrong_query,
                              seed=self.cfg.seed + 3)

    # ---------------------------------------------------------------- helpers
    def _save(self, name: str, stage: str, step: int, optimizer: torch.optim.Optimizer | None,
              scheduler: Any = None, sft_done: bool = True, sft_rng: random.Random | None = None,
              data_state: dict[str, Any] | None = None) -> Path:
        """`data_state` (async RL): the task order as it was right after this step's prompts were drawn (the
        rollout worker has drawn further ahead; a resumed run starts those groups again)."""
        state = {
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "torch_rng": torch.get_rng_state(),
            "gen": self.gen.get_state(),
            **(data_state if data_state is not None else self._data_state()),
            "python_rng": random.getstate(),
            "sft_rng": sft_rng.getstate() if sft_rng is not None else None,
            **(self.critic.trainer_state() if self.critic is not None else {}),
        }
        meta = CheckpointMeta(stage=stage, step=step, sft_done=sft_done)
        return save_checkpoint(self.run_dir, name, self.model, state, meta,
                               keep_last=self.cfg.logging.keep_last, tokenizer=self.tokenizer)

    def _data_state(self) -> dict[str, Any]:
        return {"data_rng": copy.deepcopy(self.data_rng.bit_generator.state), "order": list(self.order),
                "order_pos": self.order_pos}

    def _restore_rng(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch_rng"])
        self.gen.set_state(state["gen"])
        self.data_rng.bit_generator.state = state["data_rng"]
        self.order = list(state["order"])
        self.order_pos = int(state["order_pos"])
        random.setstate(state["python_rng"])

    def _next_tasks(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            if self.order_pos >= len(self.order):
                self.order = self.data_rng.permutation(len(self.train_tasks)).tolist()
                self.order_pos = 0
            out.append(self.order[self.order_pos])
            self.order_pos += 1
        return out

    def eval_envs(self) -> ToolVectorEnv:
        return self._eval_envs

    @property
    def vllm(self) -> VllmRollout | None:
        """rollout.engine vllm's engine, once the first rollout built it."""
        return self.source.vllm

    def collect(self, stage: Stage, task_indices: Sequence[int], params: SamplingParams, seed_base: int,
                gen: torch.Generator | None) -> Rollouts:
        """The episodes of `task_indices` (of `stage`'s split) as GRPO rows, from the rollout source."""
        return self.source.collect(stage, task_indices, params, seed_base, gen)

    def store_trajectories(self, step: int, trajs: Sequence[Trajectory], source: str) -> None:
        """Sampled episodes for the viewer (run_dir/trajectories/step_K.jsonl); evals also get a TensorBoard
        text sample (the first episode)."""
        write_trajectories(self.run_dir, step, trajs, self.cfg.logging.trajectories, source)
        if source.startswith("eval") and trajs:
            self.logger.text(f"episode/{source}", record_text_sample(sample_records(trajs, 1, source=source,
                                                                                     step=step)[0]), step)

    # ---------------------------------------------------------------- eval
    def evaluate(self, step: int) -> dict[str, Any]:
        """Held-out success/reward/tool stats, greedy and sampled (on `eval.num_tasks` test tasks)."""
        envs = self.eval_envs()
        n_tasks = min(self.cfg.eval.num_tasks, len(env_tasks(envs.envs[0])))
        result: dict[str, Any] = {"step": step, "num_tasks": n_tasks}
        modes = []
        if self.cfg.eval.greedy:
            modes.append(("greedy", 0.0))
        if self.cfg.eval.sampled:
            modes.append(("sampled", self.cfg.eval.temperature))
        for mode, temp in modes:
            params = SamplingParams(temperature=temp, top_p=1.0,
                                    max_new_tokens=self.cfg.rollout.max_new_tokens_per_turn)
            gen = torch.Generator().manual_seed(10_000 + self.cfg.seed)  # same eval samples at every eval
            self.source.eval_metrics()  # (counts of earlier eval batches: not these)
            trajs: list[Trajectory] = []
            rewards: list[float] = []
            segments = False
            for s in range(0, n_tasks, envs.num_envs):
                idx = list(range(s, min(s + envs.num_envs, n_tasks)))
                got = self.collect("eval", idx, params, seed_base=s, gen=gen)
                trajs.extend(got.trajectories)
                rewards.extend(got.episode_rewards())
                segments = segments or got.rewards is not None
            self.store_trajectories(step, trajs, f"eval_{mode}")
            st = episode_stats(trajs)
            if segments:  # rows are an agent's segments: success and reward are per episode
                st.update(reward_stats(rewards))
            st.update(self.source.eval_metrics())  # what the source counted (an agent's errors, timeouts, ...)
            result[mode] = st
            result[f"success_{mode}"] = st["success_rate"]
        return result

    def _record_eval(self, res: dict[str, Any], progress: Progress) -> None:
        self.evals.append(res)
        write_json_atomic(self.run_dir / "eval.json", {"latest": res, "evals": self.evals})
        rec = {"stage": "eval", "step": res["step"]}
        rec.update({k: v for k, v in res.items() if k.startswith("success_")})
        for mode in ("greedy", "sampled"):
            if mode in res:
                rec[f"reward_{mode}"] = res[mode]["reward_mean"]
                rec[f"search_rate_{mode}"] = res[mode]["search_rate"]
                for k in ("agent_errors", "agent_timeouts", "agent_no_reward", "agent_breaks", "agent_blocked"):
                    if k in res[mode]:
                        rec[f"{k}_{mode}"] = res[mode][k]
        self.logger.log(rec)
        parts = [f"{k}={v:.3f}" for k, v in rec.items() if k.startswith("success_")]
        progress.print(f"[eval step {res['step']}] " + " ".join(parts))

    # ---------------------------------------------------------------- SFT
    def run_sft(self, progress: Progress) -> None:
        """SFT on the demos; checkpoints `sft_<step>` every `logging.save_every` steps (a killed run resumes
        mid-stage with its optimizer and batch order) and `sft` at the end."""
        c = self.cfg.sft
        env = self.train_envs.envs[0]
        demos = self.demos
        trajs = runtime.run(demo_trajectories(env, demos, self.tokenizer))
        trajs = [copy.copy(t) for t in trajs]
        kinds = {k: sum(d.kind == k for d in demos) / len(demos) for k in {d.kind for d in demos}}
        progress.print(f"SFT: {len(trajs)} demos ({', '.join(f'{k} {v:.0%}' for k, v in sorted(kinds.items()))}), "
                       f"demo success {sum(map(is_success, trajs)) / len(trajs):.2f}")
        opt = torch.optim.AdamW(self.model.parameters(), lr=c.lr, weight_decay=self.cfg.optim.weight_decay)
        rng = random.Random(self.cfg.seed + 4)
        start = 0
        if self.meta is not None and self.meta.stage == "sft" and not self.meta.sft_done and self.state is not None:
            start = self.meta.step
            opt.load_state_dict(self.state["optimizer"])
            rng.setstate(self.state["sft_rng"])
        progress.add("SFT", total=c.steps, completed=start)
        self.model.train()
        t0 = time.perf_counter()
        save_every = self.cfg.logging.save_every
        for step in range(start + 1, c.steps + 1):
            batch = [trajs[rng.randrange(len(trajs))] for _ in range(c.batch_size)]
            lr = c.lr * min(1.0, step / max(1, c.steps // 10)) * (0.5 * (1 + math.cos(math.pi * step / c.steps)))
            for g in opt.param_groups:
                g["lr"] = max(lr, c.lr * 0.05)
            loss, ntok = sft_loss(self.model, batch, self.pad_id)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
            opt.step()
            if step % 10 == 0 or step == c.steps:
                self.logger.log({"stage": "sft", "step": step, "loss": loss.item(),
                                 "grad_norm": float(gn), "tokens": ntok, "seconds": time.perf_counter() - t0})
            progress.update("SFT", info=f"loss {loss.item():.3f}")
            if save_every and step % save_every == 0 and step < c.steps:
                self._save(f"sft_{step}", "sft", step, opt, sft_done=False, sft_rng=rng)
        self._save("sft", "sft", c.steps, None)
        remove_checkpoints(self.run_dir, "sft_")
        self.policy_version += 1

    # ---------------------------------------------------------------- GRPO
    def _logprobs(self, model: torch.nn.Module, trajs: Sequence[Trajectory], grad: bool,
                  hidden_out: list[torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Log-probs of the policy tokens under the rollout's sampling distribution (rollout.temperature and
        top_p, see `grpo.sampling_logits`): the distribution the tokens were drawn from, so PPO ratios, the
        KL and the entropy are those of the policy that acted."""
        ids, attn, tgt, mask = pad_batch(trajs, self.pad_id, self.device)
        r = self.cfg.rollout
        with torch.set_grad_enabled(grad):
            lp, ent = masked_logprobs(model, ids, attn, tgt, mask, with_entropy=grad, temperature=r.temperature,
                                      top_p=r.top_p, hidden_out=hidden_out)
        return lp, mask, ent

    def _values(self, critic: Critic, trajs: Sequence[Trajectory], N: int, T: int) -> torch.Tensor:
        """[N, T] the critic's values of the batch's policy positions (no gradient), micro-batch by micro-batch."""
        out = torch.zeros((N, T))
        mb = self.cfg.algorithm.micro_batch_size
        with torch.no_grad():
            for s in range(0, N, mb):
                ids, attn, _, m = pad_batch(trajs[s:s + mb], self.pad_id, self.device)
                v = critic.values(self.model, ids, attn, m)
                out[s:s + v.shape[0], :v.shape[1]] = v.cpu()
        return out

    def _seed_base(self, step: int) -> int:
        return seed_base(self.cfg.seed, step)

    def _sampling(self) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens_per_turn)

    def grpo_step(self, step: int, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
        """Synchronous GRPO step: collect a batch with the current weights, then update on it."""
        r = self.cfg.rollout
        t_step = time.perf_counter()
        prompts = self._next_tasks(r.prompts_per_step)
        task_indices = [p for p in prompts for _ in range(r.samples_per_prompt)]
        got = self.collect("train", task_indices, self._sampling(), seed_base=self._seed_base(step), gen=self.gen)
        rstats = got.stats
        rec = self.update(step, got.trajectories, task_indices, optimizer, scheduler, behaviour=False,
                          episodes=got if got.rewards is not None else None)
        rec.update(got.metrics)
        rec.update({"gen_tokens": rstats.gen_tokens, "time_rollout": rstats.total_seconds,
                    "time_generate": rstats.gen_seconds, "time_env": rstats.env_seconds,
                    "time_step": time.perf_counter() - t_step})
        return rec

    def behaviour_logprobs(self, trajs: Sequence[Trajectory], T: int) -> torch.Tensor:
        """`grpo.behaviour_logprobs`: what the rollout recorded when it sampled each policy token."""
        return behaviour_logprobs(trajs, T)

    def update(self, step: int, trajs: Sequence[Trajectory], task_indices: Sequence[int],
               optimizer: torch.optim.Optimizer, scheduler: Any, behaviour: bool,
               episodes: Rollouts | None = None) -> dict[str, Any]:
        """One GRPO update on a batch (rows i*G..(i+1)*G-1 the G samples of prompt i). `behaviour`: the
        batch comes from the async rollout: the loss is the decoupled PPO objective with the recorded
        behaviour log-probs (`grpo.policy_loss`), and staleness is logged. `episodes` (rollout.agent): rows
        are segments, `episodes.episode_of_row` says whose; the G episodes of task i are the group, and every
        row of an episode gets the episode's advantage."""
        cfg, a = self.cfg, self.cfg.algorithm
        r = cfg.rollout
        infra_failed, rows_in = 0, len(trajs)
        every = cfg.logging.replay_every
        trace = BundleTrace() if every and step % every == 0 else None  # this step is written as a replay bundle
        state_before = None
        if trace is not None:
            state_before = {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                            "optimizer": copy.deepcopy(optimizer.state_dict()),
                            "scheduler": copy.deepcopy(scheduler.state_dict())}
            if self.critic is not None:
                state_before["critic"] = copy.deepcopy(self.critic.trainer_state())
        if episodes is None:  # infrastructure failures are not rewards: their groups leave the loss
            all_trajs = trajs
            trajs, task_indices, infra_failed = drop_infra_failed(trajs, task_indices, r.samples_per_prompt)
            if not trajs:  # every group holds one: no update this step (the metrics say why)
                return {"stage": "rl", "step": step, **episode_stats(all_trajs), "infra_failed": infra_failed,
                        "infra_dropped_rows": rows_in, "skipped_update": 1}
        # the advantage groups rows i*G..(i+1)*G-1 together: they must be the G samples of one prompt
        got = [t.task.id for t in trajs]
        want = [self.train_tasks[task_indices[e]].id for e in episodes.episode_of_row] if episodes is not None \
            else [self.train_tasks[i].id for i in task_indices]
        if episodes is not None and not trajs:
            raise RuntimeError("no agent episode of this batch called the policy endpoint: nothing to train on "
                               "(does the agent use the client it is given?)")
        if got != want:
            raise RuntimeError(f"rollout returned trajectories out of prompt order (tasks {got[:8]}..., expected "
                               f"{want[:8]}...): GRPO groups would mix prompts")
        check_groups([self.train_tasks[i].id for i in task_indices] if episodes is not None else got,
                     r.samples_per_prompt)
        group_metrics = self.group_reward.apply(trajs, r.samples_per_prompt) \
            if self.group_reward is not None and episodes is None else {}
        if cfg.logging.trajectories_every and step % cfg.logging.trajectories_every == 0:
            self.store_trajectories(step, trajs, "train")
        t_train = time.perf_counter()
        mb = a.micro_batch_size
        N = len(trajs)
        T = max(len(t.token_ids or []) for t in trajs) - 1

        def all_logprobs(model: torch.nn.Module) -> torch.Tensor:
            out = torch.zeros((N, T), device=self.device)
            for s in range(0, N, mb):
                lp = self._logprobs(model, trajs[s:s + mb], grad=False)[0]
                out[s:s + lp.shape[0], :lp.shape[1]] = lp
            return out

        with torch.no_grad():
            old_lp = all_logprobs(self.model)
            ref_lp = None
            if self.ref_model is not None:
                with lora.reference(self.ref_model) as ref:  # LoRA: the policy with its adapter off
                    ref_lp = all_logprobs(ref)
        behav_lp = self.behaviour_logprobs(trajs, T).to(self.device) if behaviour else None
        recorded = has_behaviour(trajs)  # the rollout recorded what it sampled with
        critic = self.critic if a.name == "ppo" else None
        # [N, T] the policy positions, on the CPU, once, for whatever below needs it (not on GRPO's plain path)
        pmask = pad_batch(trajs, self.pad_id, torch.device("cpu"))[3] \
            if recorded or critic is not None or trace is not None else None
        agree: dict[str, float] = {}
        if recorded and pmask is not None:  # how far the learner is from what the rollout sampled with
            seen = behav_lp if behav_lp is not None else self.behaviour_logprobs(trajs, T)
            engine = "agent" if episodes is not None else r.engine
            agree = agreement_stats(old_lp, seen, pmask, staleness(trajs, T, step - 1), engine)
        if episodes is None:
            returns, ep_returns = token_returns(trajs, T, a.per_turn_rewards)
            if critic is None:
                adv = token_advantages(returns, ep_returns, r.samples_per_prompt, a.std_normalize, a.eps)
            else:  # PPO: GAE over the policy's tokens with the critic's values (rlf_train.ppo)
                assert pmask is not None
                old_v = self._values(critic, trajs, N, T)
                tok_r = token_rewards(trajs, T, a.per_turn_rewards)
                adv_raw, v_target = gae(tok_r, old_v, pmask, a.gamma, a.lam)
                adv = whiten(adv_raw, pmask)
        else:  # rows are an agent's segments: each gets its episode's advantage
            ep_returns = torch.tensor(episodes.episode_rewards(), dtype=torch.float32)
            adv = row_advantages(ep_returns, episodes.episode_of_row, T, r.samples_per_prompt, a.std_normalize, a.eps)
        norm_len = r.max_total_tokens
        row_w = segment_weights(episodes.episode_of_row, [sum((t.loss_mask or [])[1:]) for t in trajs]) \
            if episodes is not None and a.segment_weight == "episode" else None
        if trace is not None:
            trace.trajectories, trace.task_indices, trace.behaviour = list(trajs), list(task_indices), behaviour
            if episodes is not None:
                trace.episode_of_row, trace.episode_rewards = list(episodes.episode_of_row), ep_returns.tolist()
            assert pmask is not None
            staged = {"ep_returns": ep_returns, "adv": adv, "old_lp": old_lp, "mask": pmask}
            if episodes is None:
                staged["returns"] = returns
            for name, value in (("ref_lp", ref_lp), ("behav_lp", behav_lp), ("row_weight", row_w)):
                if value is not None:
                    staged[name] = value
            if critic is not None:
                staged.update({"token_rewards": tok_r, "values": old_v, "value_targets": v_target})
            trace.tensors = staged
        losses, kls, clips, ents, gns, isw, vls = [], [], [], [], [], [], []
        shared = critic is not None and critic.separate is None
        self.model.train()
        for _epoch in range(a.ppo_epochs):
            mini_size = math.ceil(N / a.mini_batches)
            for ms in range(0, N, mini_size):
                me = min(ms + mini_size, N)
                total_tokens = float(sum(sum((t.loss_mask or [])[1:]) for t in trajs[ms:me]))
                total_seqs = float(row_w[ms:me].sum()) if row_w is not None else me - ms
                optimizer.zero_grad(set_to_none=True)
                if critic is not None and critic.optimizer is not None:
                    critic.optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                for s in range(ms, me, mb):
                    e = min(s + mb, me)
                    chunk = trajs[s:e]
                    keep: list[torch.Tensor] | None = [] if shared else None
                    lp, mask, ent = self._logprobs(self.model, chunk, grad=True, hidden_out=keep)
                    Tc = lp.shape[1]
                    old = old_lp[s:e, :Tc]
                    ref = ref_lp[s:e, :Tc] if ref_lp is not None else None
                    out = policy_loss(lp, old, adv[s:e, :Tc].to(self.device), mask, clip_low=a.clip_eps_low,
                                      clip_high=a.clip_eps_high, agg=a.loss_agg, total_tokens=total_tokens,
                                      total_seqs=total_seqs, norm_len=norm_len, ref_logp=ref, kl_coef=a.kl_coef,
                                      row_weight=None if row_w is None else row_w[s:e],
                                      **({} if behav_lp is None else
                                         {"behav_logp": behav_lp[s:e, :Tc], "is_cap": a.is_cap}))
                    loss = out.loss
                    if critic is not None:  # the value loss, aggregated like the policy's
                        ids, attn, _, vm = pad_batch(chunk, self.pad_id, self.device)
                        v = critic.values(self.model, ids, attn, vm, hidden=keep[0] if keep else None)[:, :Tc]
                        vl = value_loss(v, old_v[s:e, :Tc].to(v), v_target[s:e, :Tc].to(v), mask, clip=a.value_clip,
                                        agg=a.loss_agg, total_tokens=total_tokens, total_seqs=total_seqs,
                                        norm_len=norm_len)
                        loss = loss + (a.vf_coef * vl if shared else vl)
                        vls.append(float(vl.detach()))
                    loss.backward()
                    if trace is not None:
                        trace.micro.append(MicroStep(_epoch, (s, e), float(out.loss.detach()), out.pg_loss, out.kl,
                                                     out.clip_frac))
                    isw.append(out.is_weight_mean)
                    loss_sum += float(out.loss.detach())
                    kls.append(out.kl)
                    clips.append(out.clip_frac)
                    if ent is not None:
                        ents.append(float((ent * mask).sum() / mask.sum().clamp(min=1.0)))
                params = [*self.model.parameters(), *critic.head.parameters()] if shared and critic is not None \
                    else self.model.parameters()
                gns.append(float(torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)))
                if trace is not None:
                    trace.grad_norms.append(gns[-1])
                optimizer.step()
                if critic is not None and critic.optimizer is not None:  # a separate critic steps with the policy
                    torch.nn.utils.clip_grad_norm_(critic.parameters(), cfg.optim.grad_clip)
                    critic.optimizer.step()
                losses.append(loss_sum)
        scheduler.step()
        now = time.perf_counter()
        rec: dict[str, Any] = {"stage": "rl", "step": step}
        if infra_failed:
            rec.update({"infra_failed": infra_failed, "infra_dropped_rows": rows_in - len(trajs)})
        rec.update(episode_stats(trajs))
        if episodes is not None:  # rows are segments: success and reward are per episode
            rec.update(reward_stats(ep_returns.tolist()))
        groups = ep_returns.view(-1, r.samples_per_prompt)
        rec.update({
            "loss": float(np.mean(losses)), "kl": float(np.mean(kls)) if kls else 0.0,
            "clip_frac": float(np.mean(clips)) if clips else 0.0, "entropy": float(np.mean(ents)) if ents else 0.0,
            "grad_norm": float(np.mean(gns)), "lr": scheduler.get_last_lr()[0],
            "groups_with_signal": float((groups.std(dim=1) > 0).float().mean()),
            "time_train": now - t_train,
        })
        rec.update(group_metrics)
        rec.update(agree)
        if critic is not None:
            rec.update({"value_loss": float(np.mean(vls)) if vls else 0.0,
                        "value_mean": float(old_v[pmask.bool()].mean()) if pmask.any() else 0.0,
                        "value_target_mean": float(v_target[pmask.bool()].mean()) if pmask.any() else 0.0,
                        "explained_variance": explained_variance(old_v, v_target, pmask)})
        if behaviour:
            stale = [step - 1 - t.policy_version for tr in trajs for t in tr.turns if t.policy_version is not None]
            rec.update({"staleness_mean": float(np.mean(stale)) if stale else 0.0,
                        "staleness_max": int(max(stale, default=0)), "is_weight_mean": float(np.mean(isw))})
        if trace is not None and state_before is not None:
            self._write_bundle(step, trace, rec, state_before, "agent" if episodes is not None else r.engine)
        self.policy_version += 1
        return rec

    def _write_bundle(self, step: int, trace: BundleTrace, rec: dict[str, Any], state_before: dict[str, Any],
                      engine: str) -> None:
        """This step's replay bundle (`rlf_train.bundle`): rows, stage tensors, hashes, and the state before the
        update when logging.replay_weights."""
        hashes = {"weights_before": state_hash(state_before["model"]), "weights_after":
                  state_hash(self.model.state_dict()), "tokenizer": tokenizer_hash(self.tokenizer), **code_hash()}
        write_bundle(bundle_dir(self.run_dir, step), step=step, policy_version=self.policy_version, engine=engine,
                     config=self.cfg.model_dump(mode="json"), trace=trace, metrics=rec, hashes=hashes,
                     state=state_before if self.cfg.logging.replay_weights else None)

    def run_rl(self, progress: Progress, start_step: int) -> None:
        cfg = self.cfg
        if cfg.model.lora is not None:  # RL trains an adapter on the policy as it is now (rlf_train.policy.lora)
            sft_base = cfg.sft.enabled and (self.run_dir / "checkpoints" / "sft").is_dir()
            self.model = lora.attach(self.model, cfg.model.lora, cfg.seed, base="sft" if sft_base else None)
        a = cfg.algorithm
        if a.name == "ppo":  # the critic (rlf_train.ppo): a value head on the policy, or a separate model
            self.critic = Critic.build(self.model, a.critic, a.critic_lr or cfg.optim.lr, cfg.optim.betas)
            if self.state is not None and self.state.get("critic") is not None:
                self.critic.load_trainer_state(self.state)
        shared_head = list(self.critic.head.parameters()) if self.critic is not None and self.critic.separate is None \
            else []
        optimizer = torch.optim.AdamW([*lora.trainable(self.model), *shared_head], lr=cfg.optim.lr,
                                      betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay)
        warm = cfg.optim.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        if self.state is not None and self.meta is not None and self.meta.stage == "rl" \
                and self.state.get("optimizer") is not None:
            optimizer.load_state_dict(self.state["optimizer"])
            scheduler.load_state_dict(self.state["scheduler"])
        if cfg.algorithm.kl_coef > 0:
            self.ref_model = self._reference_model()
        progress.add("GRPO", total=cfg.algorithm.steps, completed=start_step)
        if self.train_env_hook is not None:
            self.train_env_hook(self.train_envs)
        if cfg.rollout.mode == "async":
            self._run_rl_async(progress, start_step, optimizer, scheduler)
        else:
            for step in range(start_step + 1, cfg.algorithm.steps + 1):
                rec = self.grpo_step(step, optimizer, scheduler)
                self._after_step(progress, step, rec, optimizer, scheduler, None)
        final = cfg.algorithm.steps
        if start_step < final or not self.evals or self.evals[-1]["step"] != final:
            self._save(f"step_{final}", "rl", final, optimizer, scheduler)
            self._record_eval(self.evaluate(final), progress)

    def _after_step(self, progress: Progress, step: int, rec: dict[str, Any], optimizer: torch.optim.Optimizer,
                    scheduler: Any, data_state: dict[str, Any] | None) -> None:
        cfg = self.cfg
        self.logger.log(rec)
        if self.watch is None:
            self.watch = RunWatch(progress.print)
        self.watch.step(rec)
        uses = "search" if "Search" in cfg.env.id else "tool use"  # the share of episodes that called a tool
        progress.update("GRPO", info=f"reward {rec['reward_mean']:.3f} success {rec['success_rate']:.2f} "
                                     f"{uses} {rec['search_rate']:.2f}")
        if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.algorithm.steps:
            self._record_eval(self.evaluate(step), progress)
        if cfg.logging.save_every and step % cfg.logging.save_every == 0:
            self._save(f"step_{step}", "rl", step, optimizer, scheduler, data_state=data_state)

    def _run_rl_async(self, progress: Progress, start_step: int, optimizer: torch.optim.Optimizer,
                      scheduler: Any) -> None:
        """`rollout.mode: async`: the source's worker (`Source.async_worker`: with its own copy of the policy, in a
        process of its own or on rlf's loop thread, `rollout.async_worker`) generates while this thread updates;
        after each update the weights are published as version = step. `time_wait` is the learner's idle time
        (waiting for a batch), `rollout_busy` the worker's generation time since the previous row."""
        cfg, r = self.cfg, self.cfg.rollout
        steps = cfg.algorithm.steps
        if start_step >= steps:
            return
        # the data order is drawn here, update by update as the sync trainer draws it; a checkpoint stores it as
        # it was right after its step's prompts
        drawn: dict[int, tuple[list[int], dict[str, Any]]] = {}
        for u in range(start_step + 1, steps + 1):
            drawn[u] = (self._next_tasks(r.prompts_per_step), self._data_state())
        prompts = {u: p for u, (p, _) in drawn.items()}
        self.admission = Admission(r.prompts_per_step, r.max_staleness)
        fixed = r.async_schedule == "fixed"
        keep = r.max_staleness + 1 if fixed else 1  # versions the worker may still need
        # the fixed schedule's resume: the versions start_step - s .. start_step - 1 come from the checkpoint
        history: dict[int, dict[str, torch.Tensor]] = {}
        if fixed and start_step > 0:
            saved = (self.state or {}).get("async_weights")
            need = range(max(0, start_step - r.max_staleness), start_step)
            if saved is None or any(v not in saved for v in need):
                raise ValueError(f"resume at step {start_step} with rollout.async_schedule: fixed needs the weights "
                                 f"of versions {list(need)} in the checkpoint, which was not written by a fixed-"
                                 "schedule run with this max_staleness; resume with rollout.async_schedule: free")
            history = {v: saved[v] for v in need}
        worker = self.source.async_worker(AsyncPlan(
            self.model, self._sampling(), self.admission, prompts, first_update=start_step + 1, last_update=steps,
            keep=keep, group_size=r.samples_per_prompt, batch_size=r.batch_size, gen=self.gen,
            env_hook=self.train_env_hook))
        store = worker.store

        def publish(version: int) -> None:
            store.publish(version, self.model)
            if fixed:  # a CPU copy of each version the worker may still need, for the checkpoint
                history[version] = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
                for old in [v for v in history if v <= version - keep]:
                    del history[old]

        if history:
            current = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            for v in sorted(history):
                self.model.load_state_dict(history[v])
                store.publish(v, self.model)
            self.model.load_state_dict(current)
        publish(start_step)
        self.async_worker = worker
        worker.start()
        busy_before = 0.0
        try:
            for step in range(start_step + 1, steps + 1):
                t_step = time.perf_counter()
                batch = worker.next_batch(step)
                t_wait = time.perf_counter() - t_step
                step_prompts, data_state = drawn.pop(step)
                task_indices = [p for p in step_prompts for _ in range(r.samples_per_prompt)]
                rec = self.update(step, batch.trajectories, task_indices, optimizer, scheduler, behaviour=True,
                                  episodes=batch.episodes)
                if batch.episodes is not None:
                    rec.update(batch.episodes.metrics)
                publish(step)
                if fixed:
                    data_state = {**data_state, "async_weights": {v: w for v, w in history.items() if v < step}}
                busy = worker.times.generate
                rec.update({"gen_tokens": batch.gen_tokens, "time_wait": t_wait, "rollout_busy": busy - busy_before,
                            "time_step": time.perf_counter() - t_step})
                busy_before = busy
                self._after_step(progress, step, rec, optimizer, scheduler, data_state)
        finally:
            worker.stop()

    def _reference_model(self) -> torch.nn.Module | lora.AdapterOff:
        if lora.is_lora(self.model):  # the base: the same weights with the adapter switched off, no copy
            return lora.AdapterOff(self.model)
        ref = load_policy(self.cfg.model, self.tokenizer, self.cfg.seed)
        sft_ckpt = self.run_dir / "checkpoints" / "sft"
        if self.cfg.sft.enabled and sft_ckpt.is_dir():
            load_weights(ref, sft_ckpt)
        elif self.meta is None:
            ref.load_state_dict(self.model.state_dict())
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    # ---------------------------------------------------------------- entry
    def close_engine(self) -> None:
        """Close what the rollout source started (rollout.engine vllm's engine, an agent's endpoint)."""
        self.source.close()

    def _run_stages(self, progress: Progress) -> None:
        """SFT (unless done), the eval before RL, then RL, each resumed from where the checkpoint left it."""
        cfg = self.cfg
        progress.print(f"run dir: {self.run_dir}  policy: {cfg.model.name_or_path} "
                       f"({num_parameters(self.model) / 1e6:.2f}M params, vocab {len(self.tokenizer)})  "
                       f"train tasks: {len(self.train_tasks)}")
        start_step = 0
        m = self.meta
        if m is not None:
            assert self.state is not None
            self._restore_rng(self.state)
            progress.print(f"resumed from the {m.stage} checkpoint at step {m.step}"
                           + ("" if m.stage == "rl" or m.sft_done else " (SFT continues)"))
        elif self.resume:
            progress.print(f"--resume {self.run_dir}: no checkpoint yet, starting the run over")
        if (m is None or (m.stage == "sft" and not m.sft_done)) and cfg.sft.enabled and cfg.sft.steps > 0:
            self.run_sft(progress)
        if m is None or m.stage == "sft":
            if cfg.eval.before_rl:
                self._record_eval(self.evaluate(0), progress)
            if cfg.algorithm.steps > 0 and cfg.logging.save_every:
                self._save("step_0", "rl", 0, None)
        else:
            start_step = m.step
        self.run_rl(progress, start_step)

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        t0 = time.perf_counter()
        with Progress(cfg.logging.progress) as progress:
            try:
                self._run_stages(progress)
            finally:  # rollout.engine vllm: the engine may have started in any stage that rolls out
                self.close_engine()
                line = self.source.summary()  # e.g. how an agent's episodes went, failures included (also on Ctrl-C)
                if line is not None:
                    progress.print(line)
                if self.group_reward is not None:
                    progress.print(self.group_reward.summary())
                    self.group_reward.close()
        self.logger.close()
        plot_reward_curve(self.run_dir)
        summary = {"run_dir": str(self.run_dir), "seconds": time.perf_counter() - t0, "evals": self.evals}
        write_json_atomic(self.run_dir / "summary.json", summary)
        return summary
