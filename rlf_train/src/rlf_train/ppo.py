"""PPO with a critic on the local backend (`algorithm.name: ppo`): per-token rewards at turn ends, GAE over the
policy's tokens, a clipped value loss.

The sequence a policy acts in is its tokens with the env's observations between them. Only policy tokens are
decisions, so GAE runs over them alone, in order: the value of the state before policy token k is V_k (the critic
at target position k, the position whose logits predict it), its reward r_k is 0 except at the last token of each
turn (that turn's process reward, `Turn.reward`) and at the episode's last policy token (the outcome, plus its
turn's reward), and

    delta_k = r_k + gamma * V_{k+1} - V_k           (V after the last policy token: 0, the episode ends)
    A_k     = delta_k + gamma * lambda * A_{k+1}     returns R_k = A_k + V_k (the value targets)

Observation tokens get neither an advantage nor a value loss. The advantages are whitened over the batch's policy
tokens. The critic is a value head on the policy's last hidden state (`algorithm.critic: value_head`, trained
with the policy's optimizer, its loss weighted by `vf_coef`), or a separate model of the policy's architecture
with its own head and optimizer (`critic: separate`). Value loss: 0.5 max((V - R)^2, (V_clip - R)^2), V_clip the
old value moved by at most `value_clip`, aggregated like the policy loss."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from rlf_envs.types import Trajectory
from rlf_train.grpo import LossAgg, aggregate, model_body


def policy_positions(traj: Trajectory, T: int) -> list[int]:
    """The target positions (0..T-1) of the policy's tokens, in order (target t predicts token t + 1)."""
    mask = traj.loss_mask or []
    return [t - 1 for t in range(1, min(len(mask), T + 1)) if mask[t]]


def token_rewards(trajs: Sequence[Trajectory], T: int, per_turn: bool) -> torch.Tensor:
    """[N, T] each turn's reward at its last policy token (`per_turn`), the outcome at the episode's last one."""
    out = torch.zeros((len(trajs), T))
    for i, tr in enumerate(trajs):
        pos = policy_positions(tr, T)
        if not pos:
            continue
        if per_turn:
            for turn in tr.turns:
                span = turn.action_span
                if span is not None and turn.reward and span[1] >= 2 and span[1] - 2 in pos:
                    out[i, span[1] - 2] += turn.reward
        out[i, pos[-1]] += tr.reward
    return out


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over each row's masked positions only (see the module docstring): advantages and returns, [N, T],
    0 off the mask."""
    adv = torch.zeros_like(values)
    m = mask.bool()
    for i in range(values.shape[0]):
        pos = m[i].nonzero().flatten().tolist()
        nxt_v, nxt_a = 0.0, 0.0
        for t in reversed(pos):
            delta = float(rewards[i, t]) + gamma * nxt_v - float(values[i, t])
            nxt_a = delta + gamma * lam * nxt_a
            adv[i, t] = nxt_a
            nxt_v = float(values[i, t])
    return adv, (adv + values) * m


def whiten(adv: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    m = mask.bool()
    if int(m.sum()) < 2:
        return adv * m
    sel = adv[m]
    return ((adv - sel.mean()) / (sel.std() + eps)) * m


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
               clip: float, agg: LossAgg, total_tokens: float, total_seqs: float, norm_len: int) -> torch.Tensor:
    """0.5 max((V - R)^2, (V_clip - R)^2) per policy token (clip <= 0: the plain squared error), aggregated."""
    err = (values - returns) ** 2
    if clip > 0:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    return aggregate(0.5 * err, mask, agg, total_tokens, total_seqs, norm_len)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.bool()
    if int(m.sum()) < 2:
        return 0.0
    r, v = returns[m], values[m]
    var = float(r.var())
    return 1.0 - float((r - v).var()) / var if var > 0 else 0.0


def _body(model: torch.nn.Module) -> torch.nn.Module:
    split = model_body(model)
    if split is None:
        raise ValueError(f"algorithm.name: ppo needs a causal LM with a body and a head (found {type(model).__name__})")
    return split[0]


class Critic(torch.nn.Module):
    """The value function: a linear head on a body's last hidden state. `body` None: the policy's own body (the
    value head shares its trunk and optimizer); else a separate copy of the policy, trained by `optimizer`."""

    def __init__(self, hidden_size: int, separate: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.separate = separate
        self.optimizer: torch.optim.Optimizer | None = None

    @classmethod
    def build(cls, policy: torch.nn.Module, kind: str, lr: float, betas: tuple[float, float]) -> Critic:
        hidden = int(getattr(getattr(policy, "config", None), "hidden_size", 0)) or \
            int(_body(policy).get_input_embeddings().weight.shape[1])
        device = next(policy.parameters()).device
        if kind == "separate":
            sep = copy.deepcopy(policy.get_base_model() if hasattr(policy, "get_base_model") else policy)
            for p in sep.parameters():
                p.requires_grad_(True)
            critic = cls(hidden, sep).to(device)
            critic.optimizer = torch.optim.AdamW(critic.parameters(), lr=lr, betas=betas)
        else:
            critic = cls(hidden).to(device)
        return critic

    def values(self, policy: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               mask: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] V at the masked positions (0 elsewhere). `hidden`: the policy body's last hidden state when the
        caller has it already (a shared head: one forward for log-probs and values)."""
        if hidden is None or self.separate is not None:
            body = _body(self.separate if self.separate is not None else policy)
            hidden = body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        sel = mask.bool()
        out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        out[sel] = self.head(hidden[sel].float()).squeeze(-1)
        return out

    def trainer_state(self) -> dict[str, Any]:
        return {"critic": self.state_dict(),
                "critic_optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state["critic"])
        if self.optimizer is not None and state.get("critic_optimizer") is not None:
            self.optimizer.load_state_dict(state["critic_optimizer"])
