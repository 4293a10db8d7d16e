"""Policy losses: ``(logprobs, old_logprobs, advantages, mask) → (loss, metrics)``, registered by name."""

from __future__ import annotations

import torch

from rlpipe.algorithms.functional import masked_mean
from rlpipe.algorithms.registry import Registry

POLICY_LOSSES: Registry = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio: float = 0.2,
    normalizer: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level PPO clipped surrogate (Schulman et al. 2017, eq. 7), as used by GRPO.

    logprobs: (B, T) log π_θ(a_t|s_t) under the current policy (with grad);
    old_logprobs: (B, T) log-probs of the policy that sampled a_t; advantages: (B, T);
    mask: (B, T) 1 where the token takes part.
    loss = Σ_t mask·max(−A·ρ, −A·clip(ρ, 1−ε, 1+ε)) / normalizer, ρ = exp(logπ_θ − logπ_old).
    ``normalizer`` defaults to the number of masked tokens (token-mean); the trainer passes the
    token count of the whole mini-batch so any split into micro-batches/ranks gives the same gradient.
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    per_token = torch.maximum(unclipped, clipped)
    denom = mask.sum().clamp_min(1.0) if normalizer is None else normalizer
    loss = (per_token * mask).sum() / denom
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((clipped > unclipped).to(logprobs.dtype), mask),
            "approx_kl_old": masked_mean(0.5 * log_ratio**2, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, metrics


def policy_loss(name: str, *args, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return POLICY_LOSSES.get(name)(*args, **kwargs)
