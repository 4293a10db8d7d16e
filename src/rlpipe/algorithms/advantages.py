"""Advantage estimators: one typed batch in, (advantages, metrics) out, registered by name.

Every estimator takes an :class:`AdvantageInput`, so callers never branch on the algorithm's name.
Samples whose reward could not be computed (``valid`` False: timeout, unparseable, error, skipped)
take no part in any baseline or normalisation and get advantage 0; the trainer also masks them
out of the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlpipe.algorithms.registry import Registry

ADVANTAGES: Registry = Registry("advantage estimator")
register_advantage = ADVANTAGES.register


@dataclass
class AdvantageInput:
    """rewards: (N,) scalar reward per sample (any value where not valid);
    group_ids: (N,) long, samples of the same prompt share an id;
    valid: (N,) bool, reward status is ok;
    response_mask: (N, T) 1 on response tokens that take part in the loss."""

    rewards: torch.Tensor
    group_ids: torch.Tensor
    valid: torch.Tensor
    response_mask: torch.Tensor


def _group_stats(x: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample mean, unbiased std and count of its group's valid members (count 0 → mean 0, std 0)."""
    _, inv = torch.unique(groups, return_inverse=True)
    g = int(inv.max()) + 1 if inv.numel() else 0
    w = valid.to(x.dtype)
    xv = torch.where(valid, x, torch.zeros_like(x))
    count = torch.zeros(g, dtype=x.dtype).index_add_(0, inv, w)
    total = torch.zeros(g, dtype=x.dtype).index_add_(0, inv, xv)
    mean = total / count.clamp_min(1)
    sq = torch.zeros(g, dtype=x.dtype).index_add_(0, inv, w * (xv - mean[inv]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp_min(1))
    return mean[inv], std[inv], count[inv]


@register_advantage("grpo")
def grpo_advantages(
    batch: AdvantageInput, *, norm_by_std: bool = True, eps: float = 1e-6
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO (Shao et al. 2024, DeepSeekMath §4.1.2): A_i = (r_i − mean_g r) / (std_g r + ε), per token.

    Returns advantages (N, T) broadcast over each sample's response tokens, 0 elsewhere. A group
    whose valid rewards are all equal (or that has one valid member) gets advantage 0: it carries
    no learning signal.
    """
    r = batch.rewards.to(torch.float64)
    mean, std, count = _group_stats(r, batch.group_ids, batch.valid)
    adv = r - mean
    if norm_by_std:
        adv = adv / (std + eps)
    adv = torch.where(batch.valid & (count > 1), adv, torch.zeros_like(adv))
    out = adv.to(torch.float32).unsqueeze(-1) * batch.response_mask.to(torch.float32)
    _, inv = torch.unique(batch.group_ids, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    flat = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inv, (std > 0).to(torch.float64) * batch.valid)
    metrics = {
        "groups": float(n_groups),
        "groups_with_signal": float((flat > 0).sum()),
        "advantage_abs_mean": float(adv[batch.valid].abs().mean()) if bool(batch.valid.any()) else 0.0,
    }
    return out, metrics


def compute_advantages(name: str, batch: AdvantageInput, **kwargs) -> tuple[torch.Tensor, dict[str, float]]:
    return ADVANTAGES.get(name)(batch, **kwargs)
