"""Small tensor helpers shared by the losses: masked means, token log-probs, entropy."""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """Mean of ``x`` where ``mask`` is 1; 0 (not NaN) when the mask is empty."""
    denom = mask.sum()
    return (x * mask).sum() / denom.clamp_min(1.0) if eps == 0.0 else (x * mask).sum() / (denom + eps)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log π(target_t | context) for each position.

    logits: (B, T, V) scores for the token at each position; targets: (B, T) token ids.
    Logits are divided by the sampling temperature so the result matches the sampler's log-probs.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.gather(logits.log_softmax(-1), -1, targets.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy (nats) of the next-token distribution at each position: (B, T, V) → (B, T)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = logits.log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def masked_stats(x: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The distribution of ``x`` where ``mask`` is 1: mean / std / min / max, the 10th / 50th / 90th
    percentiles (linear interpolation) and the share of exact zeros (empty mask: all zeros)."""
    vals = x[mask > 0].double()
    if vals.numel() == 0:
        return {k: 0.0 for k in ("mean", "std", "min", "max", "p10", "p50", "p90", "zero_share")}
    q = torch.quantile(vals, torch.tensor([0.1, 0.5, 0.9], dtype=vals.dtype))
    return {"mean": float(vals.mean()), "std": float(vals.std(unbiased=False)), "min": float(vals.min()),
            "max": float(vals.max()), "p10": float(q[0]), "p50": float(q[1]), "p90": float(q[2]),
            "zero_share": float((vals == 0).double().mean())}


def logprob_gap(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, threshold: float) -> dict[str, float]:
    """Train/inference mismatch on the sampled tokens: (B, T) log-probs of the same tokens under the
    trainer and under the sampler. ``abs_mean`` / ``abs_max`` of |Δ|, ``share_above``: share of tokens with
    |Δ| > threshold, ``kl``: mean of sampler − trainer (an estimate of KL(sampler ‖ trainer))."""
    diff = (trainer - sampler).double()
    on = mask > 0
    if not bool(on.any()):
        return {"abs_mean": 0.0, "abs_max": 0.0, "share_above": 0.0, "kl": 0.0}
    d = diff[on]
    return {"abs_mean": float(d.abs().mean()), "abs_max": float(d.abs().max()),
            "share_above": float((d.abs() > threshold).double().mean()), "kl": float((-d).mean())}
