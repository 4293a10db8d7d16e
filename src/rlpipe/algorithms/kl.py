"""KL estimators between the policy and a reference, per token (Schulman, "Approximating KL Divergence", 2020).

With ``log_ratio = logπ_ref(a) − logπ_θ(a)`` for actions a sampled from π_θ:
k1 = −log_ratio (unbiased, high variance, can be negative), k2 = ½·log_ratio² (biased, low variance),
k3 = exp(log_ratio) − log_ratio − 1 (unbiased, always ≥ 0; the GRPO paper's choice).
"""

from __future__ import annotations

import torch

from rlpipe.algorithms.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator")
register_kl = KL_ESTIMATORS.register


@register_kl("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs - ref_logprobs


@register_kl("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (ref_logprobs - logprobs) ** 2


@register_kl("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    # Clamp the log-ratio before exp: one wild token must not turn the whole loss into inf.
    log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return torch.exp(log_ratio) - log_ratio - 1.0


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """(B, T) per-token KL estimate of π_θ ‖ π_ref."""
    return KL_ESTIMATORS.get(kind)(logprobs, ref_logprobs)
