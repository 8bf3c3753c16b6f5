"""Replay a recorded update step on CPU, with no env and no engine: `python -m rlf_train.replay BUNDLE`.

A bundle (`rlf_train.bundle`) holds what one step trained on and what it computed. The replay recomputes, in the
order the trainer computes them, with this checkout's code: the loss mask from the rows, the returns from the
recorded rewards, the GRPO advantages, the behaviour log-probs from the rows' turns; then, given the step's weights
(the bundle's `state.pt`, written with `logging.replay_weights: true`, or `--checkpoint` of a checkpoint saved right
before the step), the learner's log-probs, every micro-batch's loss terms, every gradient norm and the updated
weights (by running `Trainer.update` itself on the recorded rows). It prints the first value that differs and
where, and exits 1; 0 when everything replays (exactly, unless --atol/--rtol allow a difference).

`--train-from RUN_OR_BUNDLES --out DIR` runs updates on recorded rollouts, in step order, without generating: from
the first bundle's state (or `--checkpoint`, or the config's initial weights), the weights it ends with saved as a
checkpoint in DIR, each step's metrics in DIR/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlf_envs.errors import RlfError
from rlf_train.bundle import Bundle, BundleError, MicroStep, list_bundles, read_bundle, state_hash
from rlf_train.config import ConfigError, TrainConfig, config_from_dict
from rlf_train.grpo import behaviour_logprobs, row_advantages, token_advantages, token_returns
from rlf_train.policy import lora
from rlf_train.policy.checkpoint import CheckpointMeta, save_checkpoint
from rlf_train.policy.load import load_policy
from rlf_train.policy.tokenizer import load_tokenizer
from rlf_train.rollout.batch import Rollouts, RolloutStats
from rlf_train.sft import pad_batch


@dataclass
class Divergence:
    """The first recomputed value that differs from the recorded one."""

    stage: str
    where: str
    recorded: float
    recomputed: float
    note: str = ""

    def __str__(self) -> str:
        return (f"first divergence: {self.stage} at {self.where}: recorded {self.recorded!r}, recomputed "
                f"{self.recomputed!r} (|diff| {abs(self.recorded - self.recomputed):.3g}){self.note}")


@dataclass
class ReplayReport:
    bundle: Path
    step: int
    checked: list[tuple[str, int]] = field(default_factory=list)  # (stage, values compared)
    skipped: list[str] = field(default_factory=list)  # stages that could not be replayed, and why
    divergence: Divergence | None = None

    @property
    def exact(self) -> bool:
        return self.divergence is None


class _Stop(Exception):
    pass


class _Checker:
    def __init__(self, report: ReplayReport, atol: float, rtol: float) -> None:
        self.report, self.atol, self.rtol = report, atol, rtol

    def tensor(self, stage: str, recorded: torch.Tensor, recomputed: torch.Tensor,
               where: Callable[[tuple[int, ...]], str], note: str = "") -> None:
        a, b = recorded.detach().double().cpu(), recomputed.detach().double().cpu()
        if a.shape != b.shape:
            self.report.divergence = Divergence(stage, f"shape {tuple(a.shape)} vs {tuple(b.shape)}", float("nan"),
                                                float("nan"), note)
            raise _Stop
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        close = same | ((a - b).abs() <= self.atol + self.rtol * a.abs())
        if not bool(close.all()):
            idx = tuple(int(i) for i in (~close).nonzero()[0])
            self.report.divergence = Divergence(stage, where(idx), float(a[idx]), float(b[idx]), note)
            raise _Stop
        self.report.checked.append((stage, int(a.numel())))

    def values(self, stage: str, recorded: Sequence[float], recomputed: Sequence[float],
               where: Callable[[int], str]) -> None:
        self.tensor(stage, torch.tensor(list(recorded), dtype=torch.float64),
                    torch.tensor(list(recomputed), dtype=torch.float64), lambda i: where(i[0]))

    def equal(self, stage: str, recorded: str, recomputed: str, note: str) -> None:
        if recorded != recomputed:
            self.report.divergence = Divergence(stage, "hash", float("nan"), float("nan"),
                                                f": {recorded[:12]} recorded, {recomputed[:12]} now{note}")
            raise _Stop
        self.report.checked.append((stage, 1))


def _row_token(trajs: Sequence[Any]) -> Callable[[tuple[int, ...]], str]:
    def where(i: tuple[int, ...]) -> str:
        row = i[0]
        tid = trajs[row].task.id if row < len(trajs) else "?"
        return f"row {row} (task {tid!r})" + (f", target token {i[1]}" if len(i) > 1 else "")
    return where


def _config(b: Bundle) -> TrainConfig:
    try:
        return config_from_dict(b.manifest.config)
    except ConfigError as e:
        raise BundleError(f"{b.path}: the bundle's config does not load in this rlf: {e}") from None


def _policy(cfg: TrainConfig, tokenizer: Any, state: dict[str, torch.Tensor] | None,
            checkpoint: Path | None) -> torch.nn.Module:
    """The policy of the step on CPU: the config's architecture with the bundle's (or a checkpoint's) weights."""
    mcfg = cfg.model.model_copy(update={"device": "cpu"})
    model = load_policy(mcfg, tokenizer, cfg.seed, weights_dir=checkpoint)
    if cfg.model.lora is not None and not lora.is_lora(model):
        model = lora.attach(model, cfg.model.lora, cfg.seed)
    if state is not None:
        model.load_state_dict(state)
    return model


def _learner_logprobs(cfg: TrainConfig, model: torch.nn.Module, trajs: Sequence[Any], pad_id: int,
                      T: int) -> torch.Tensor:
    from rlf_train.grpo import masked_logprobs

    r, mb = cfg.rollout, cfg.algorithm.micro_batch_size
    out = torch.zeros((len(trajs), T))
    with torch.no_grad():
        for s in range(0, len(trajs), mb):
            ids, attn, tgt, mask = pad_batch(trajs[s:s + mb], pad_id, torch.device("cpu"))
            lp, _ = masked_logprobs(model, ids, attn, tgt, mask, with_entropy=False, temperature=r.temperature,
                                    top_p=r.top_p)
            out[s:s + lp.shape[0], :lp.shape[1]] = lp
    return out


def replay_bundle(path: str | Path, *, checkpoint: Path | None = None, atol: float = 0.0,
                  rtol: float = 0.0) -> ReplayReport:
    """Recompute one bundle (see the module docstring); the report holds the first divergence, if any."""
    b = read_bundle(path)
    m = b.manifest
    report = ReplayReport(bundle=b.path, step=m.step)
    check = _Checker(report, atol, rtol)
    cfg = _config(b)
    torch.set_num_threads(m.threads)
    trajs, rec = b.trajectories, b.tensors
    a, G = cfg.algorithm, cfg.rollout.samples_per_prompt
    T = max(len(t.token_ids or []) for t in trajs) - 1
    rows = _row_token(trajs)
    try:
        # the loss mask the update used: the rows' own (policy tokens 1, prompt and observations 0)
        check.tensor("loss mask", rec["mask"], pad_batch(trajs, 0, torch.device("cpu"))[3], rows)
        # rewards -> returns -> advantages
        if a.name == "ppo":
            _ppo_chain(b, cfg, trajs, T, check, rows)
            report.skipped.append("ppo: the learner's log-probs, the critic's values and the loss terms are not "
                                  "replayed yet (the reward -> GAE chain is)")
            return report
        if m.episode_of_row is None:
            returns, ep = token_returns(trajs, T, a.per_turn_rewards)
            check.values("rewards", rec["ep_returns"].tolist(), ep.tolist(),
                         lambda i: f"row {i} (task {trajs[i].task.id!r}: final {trajs[i].reward!r} + per-turn)")
            check.tensor("returns", rec["returns"], returns, rows)
            adv = token_advantages(returns, ep, G, a.std_normalize, a.eps)
        else:
            ep = torch.tensor(m.episode_rewards or [], dtype=torch.float32)
            check.values("episode rewards", rec["ep_returns"].tolist(), ep.tolist(), lambda i: f"episode {i}")
            adv = row_advantages(ep, m.episode_of_row, T, G, a.std_normalize, a.eps)
        check.tensor("advantages", rec["adv"], adv, rows, note=f" (group size {G}, std_normalize {a.std_normalize})")
        if "behav_lp" in rec:
            check.tensor("behaviour log-probs", rec["behav_lp"], behaviour_logprobs(trajs, T), rows)
        # the step's weights: the learner's log-probs, then the update itself
        state = b.state["model"] if b.state is not None else None
        if state is None and checkpoint is None:
            report.skipped.append("log-probs and loss terms: the bundle has no state.pt (record with "
                                  "logging.replay_weights: true) and no --checkpoint was given")
            return report
        tokenizer = load_tokenizer(cfg.model)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        model = _policy(cfg, tokenizer, state, checkpoint)
        check.equal("weights before the update", m.hashes["weights_before"], state_hash(model.state_dict()),
                    " (another checkpoint than the step started from?)")
        check.tensor("learner log-probs", rec["old_lp"], _learner_logprobs(cfg, model, trajs, pad_id, T), rows)
        if b.state is None or "optimizer" not in b.state:
            report.skipped.append("loss terms and the update: no optimizer state in the bundle (replay_weights)")
            return report
        if a.kl_coef > 0 and not lora.is_lora(model):
            report.skipped.append("loss terms: the KL reference (a frozen copy of the policy) is not in the bundle")
            return report
        _replay_update(b, cfg, model, tokenizer, check)
    except _Stop:
        pass
    return report


def _ppo_chain(b: Bundle, cfg: TrainConfig, trajs: Sequence[Any], T: int, check: _Checker,
               rows: Callable[[tuple[int, ...]], str]) -> None:
    """PPO's reward chain: per-token rewards from the rows, then GAE from the recorded values."""
    from rlf_train.ppo import gae, token_rewards, whiten

    a, rec = cfg.algorithm, b.tensors
    check.tensor("token rewards", rec["token_rewards"], token_rewards(trajs, T, a.per_turn_rewards), rows)
    adv_raw, targets = gae(rec["token_rewards"], rec["values"], rec["mask"], a.gamma, a.lam)
    check.tensor("value targets", rec["value_targets"], targets, rows)
    check.tensor("advantages", rec["adv"], whiten(adv_raw, rec["mask"]), rows, note=" (GAE, whitened)")


def _optimizer(cfg: TrainConfig, model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    o = cfg.optim
    optimizer = torch.optim.AdamW(lora.trainable(model), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    warm = o.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    return optimizer, scheduler


def _update(b: Bundle, cfg: TrainConfig, model: torch.nn.Module, tokenizer: Any, run_dir: Path,
            optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """`Trainer.update` on the bundle's rows (the trainer's own code), writing its bundle under run_dir."""
    from rlf_train.trainer import Trainer

    m = b.manifest
    tasks = {i: t.task for i, t in zip(m.task_indices, b.trajectories, strict=False)}
    if m.episode_of_row is not None:
        tasks = {i: b.trajectories[m.episode_of_row.index(e)].task for e, i in enumerate(m.task_indices)
                 if e in m.episode_of_row}
    tr = Trainer.for_replay(cfg, run_dir, model, tokenizer, tasks, m.policy_version)
    episodes = None
    if m.episode_of_row is not None:
        episodes = Rollouts(list(b.trajectories), list(m.episode_of_row), RolloutStats(), {},
                            rewards=list(m.episode_rewards or []))
    return tr.update(m.step, list(b.trajectories), list(m.task_indices), optimizer, scheduler,
                     behaviour=m.behaviour, episodes=episodes)


def _replay_update(b: Bundle, cfg: TrainConfig, model: torch.nn.Module, tokenizer: Any, check: _Checker) -> None:
    assert b.state is not None
    with tempfile.TemporaryDirectory(prefix="rlf-replay-") as tmp:
        rcfg = cfg.model_copy(deep=True)
        rcfg.logging.replay_every, rcfg.logging.replay_weights, rcfg.logging.trajectories_every = 1, False, 0
        optimizer, scheduler = _optimizer(rcfg, model)
        optimizer.load_state_dict(b.state["optimizer"])
        scheduler.load_state_dict(b.state["scheduler"])
        _update(b, rcfg, model, tokenizer, Path(tmp), optimizer, scheduler)
        again = read_bundle(Path(tmp) / "replay" / f"step_{b.manifest.step:06d}")
    if len(again.micro) != len(b.micro):
        check.report.divergence = Divergence("micro-batches", "count", len(b.micro), len(again.micro))
        raise _Stop

    def micro(i: int) -> str:
        s: MicroStep = b.micro[i]
        return f"epoch {s.epoch}, rows {s.rows[0]}..{s.rows[1] - 1}"

    for name in ("loss", "pg_loss", "kl"):
        check.values(f"micro-batch {name}", [getattr(s, name) for s in b.micro],
                     [getattr(s, name) for s in again.micro], micro)
    check.values("gradient norm", b.grad_norms, again.grad_norms, lambda i: f"optimizer step {i}")
    check.equal("weights after the update", b.manifest.hashes["weights_after"], again.manifest.hashes["weights_after"],
                "")


def train_from(paths: Sequence[str | Path], out: Path, checkpoint: Path | None = None,
               say: Callable[[str], Any] = print) -> list[dict[str, Any]]:
    """Run the updates of recorded steps, in step order, without generating (see the module docstring)."""
    bundles = sorted((p for path in paths for p in list_bundles(path)), key=lambda p: int(p.name.split("_")[1]))
    if not bundles:
        raise BundleError(f"no replay bundles under {', '.join(map(str, paths))} (a run writes them with "
                          "logging.replay_every: N)")
    first = read_bundle(bundles[0])
    cfg = _config(first)
    torch.set_num_threads(first.manifest.threads)
    tokenizer = load_tokenizer(cfg.model)
    start = first.state if first.state is not None and checkpoint is None else None
    model = _policy(cfg, tokenizer, start["model"] if start is not None else None, checkpoint)
    optimizer, scheduler = _optimizer(cfg, model)
    if start is not None and "optimizer" in start:
        optimizer.load_state_dict(start["optimizer"])
        scheduler.load_state_dict(start["scheduler"])
    out.mkdir(parents=True, exist_ok=True)
    rcfg = cfg.model_copy(deep=True)
    rcfg.logging.replay_every, rcfg.logging.trajectories_every = 0, 0
    metrics = []
    with (out / "metrics.jsonl").open("w") as f:
        for path in bundles:
            b = first if path == bundles[0] else read_bundle(path)
            rec = _update(b, rcfg, model, tokenizer, out, optimizer, scheduler)
            rec = {k: v for k, v in rec.items() if isinstance(v, (int, float, str))}
            metrics.append(rec)
            f.write(json.dumps(rec) + "\n")
            say(f"step {b.manifest.step}: reward {rec.get('reward_mean', float('nan')):.3f} loss "
                f"{rec.get('loss', float('nan')):.4f} grad_norm {rec.get('grad_norm', float('nan')):.3f}")
    last = metrics[-1].get("step", 0) if metrics else 0
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    save_checkpoint(out, f"step_{last}", model, state,
                    CheckpointMeta(stage="rl", step=int(last), sft_done=True, extra={"trained_from": "replay"}),
                    keep_last=1, tokenizer=tokenizer)
    say(f"{len(bundles)} recorded steps trained on; weights in {out / 'checkpoints' / f'step_{last}'}")
    return metrics


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlf_train.replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("bundles", nargs="*", help="bundle dirs (run_dir/replay/step_K), or a run dir: all its bundles")
    ap.add_argument("--checkpoint", type=Path, help="the weights the step started from, when the bundle kept none")
    ap.add_argument("--atol", type=float, default=0.0, help="allowed absolute difference (default: exact)")
    ap.add_argument("--rtol", type=float, default=0.0, help="allowed relative difference (default: exact)")
    ap.add_argument("--train-from", nargs="+", metavar="RUN_OR_BUNDLE", help="train on recorded rollouts")
    ap.add_argument("--out", type=Path, help="with --train-from: where the weights and metrics go")
    args = ap.parse_args(argv)
    try:
        if args.train_from:
            if args.out is None:
                ap.error("--train-from needs --out DIR")
            train_from(args.train_from, args.out, args.checkpoint)
            return 0
        paths = [p for path in args.bundles for p in list_bundles(path)]
        if not paths:
            ap.error("give a bundle dir or a run dir with replay bundles (logging.replay_every: N)")
        worst = 0
        for p in paths:
            rep = replay_bundle(p, checkpoint=args.checkpoint, atol=args.atol, rtol=args.rtol)
            n = sum(k for _, k in rep.checked)
            print(f"{p}: step {rep.step}: {n} values in {len(rep.checked)} checks "
                  f"({', '.join(s for s, _ in rep.checked)})")
            for s in rep.skipped:
                print(f"  not replayed: {s}")
            if rep.divergence is not None:
                d = rep.divergence
                small = math.isfinite(d.recorded) and abs(d.recorded - d.recomputed) <= 1e-6 * max(abs(d.recorded), 1)
                print(f"  {d}" + ("\n  (a floating-point-sized difference: another machine, thread count or torch "
                                  "build? --rtol 1e-6 allows it)" if small else ""))
                worst = 1
            else:
                print("  replayed exactly" if args.atol == 0 and args.rtol == 0 else "  replayed within tolerance")
        return worst
    except (RlfError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
