"""How far the learner's log-probs are from the behaviour log-probs the rollout recorded for the same tokens.

Both are log-probs of the sampled token under the rollout's sampling distribution (temperature, top_p), so on the
tokens the current weights sampled they agree up to kernel noise (about 1e-5 between vLLM's CPU kernels and the
trainer's forward). A gap there is a bug the loss does not show: weights that never reached the engine, a
retokenised context, another temperature (verl #7495, rLLM #816). On older tokens the gap is the policy's own
change since it sampled them, so the metrics are split by staleness (`stale0`, `stale1`, `stale2+`), and by the
engine that sampled (`rollout.engine`, or `agent` for the policy endpoint).

Per group, over policy tokens: `diff_mean` / `diff_max` (|learner - behaviour|) and `kl`, the k3 estimate of
KL(behaviour || learner) from the behaviour's own samples, r = exp(learner - behaviour): mean(r - 1 - log r)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlf_envs.types import Trajectory

#: on tokens the current weights sampled, a KL past this says rollout and learner disagree (not staleness)
WARN_KL = 1e-3


def staleness(trajs: Sequence[Trajectory], T: int, current: int) -> torch.Tensor:
    """[N, T] how many updates old the weights that sampled each target position were (`current`, the version the
    update starts from, minus the turn's `policy_version`; 0 where none was recorded); -1 outside every action."""
    out = torch.full((len(trajs), T), -1, dtype=torch.long)
    for i, tr in enumerate(trajs):
        for turn in tr.turns:
            if turn.action_span is None or turn.action_span[0] < 1:
                continue
            s, e = turn.action_span
            v = turn.policy_version
            out[i, s - 1:min(e - 1, T)] = max(current - v, 0) if v is not None else 0
    return out


def has_behaviour(trajs: Sequence[Trajectory]) -> bool:
    """Whether every action of the batch carries the log-probs its sampler recorded (async, vLLM, agent rows)."""
    turns = [t for tr in trajs for t in tr.turns if t.action_span is not None and t.action_span[1] > t.action_span[0]]
    return bool(turns) and all(t.behaviour_logprobs is not None for t in turns)


def agreement_stats(learner: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, stale: torch.Tensor,
                    engine: str) -> dict[str, float]:
    """`agree/<engine>/<stale group>/{diff_mean,diff_max,kl,tokens}` over the masked positions of each group, and
    `agree/<engine>/kl` over all of them. Shapes [N, T]; `stale` from `staleness`."""
    learner, behaviour = learner.detach().float().cpu(), behaviour.detach().float().cpu()
    on = mask.detach().cpu().bool() & (stale >= 0)
    out: dict[str, float] = {}
    groups = {"stale0": stale == 0, "stale1": stale == 1, "stale2+": stale >= 2, "all": stale >= 0}
    for name, where in groups.items():
        sel = on & where
        n = int(sel.sum())
        if n == 0:
            continue
        d = (learner - behaviour)[sel]
        kl = torch.expm1(d) - d  # k3 with r = exp(d): r - 1 - log r
        key = f"agree/{engine}" if name == "all" else f"agree/{engine}/{name}"
        out[f"{key}/diff_mean"] = float(d.abs().mean())
        out[f"{key}/diff_max"] = float(d.abs().max())
        out[f"{key}/kl"] = float(kl.mean())
        out[f"{key}/tokens"] = float(n)
    return out


def disagreement(rec: dict[str, float], threshold: float = WARN_KL) -> tuple[str, float] | None:
    """The engine whose freshly sampled tokens (stale0) disagree with the learner past `threshold`, and its KL."""
    for key, value in rec.items():
        if key.startswith("agree/") and key.endswith("/stale0/kl") and value > threshold:
            return key.split("/")[1], value
    return None
