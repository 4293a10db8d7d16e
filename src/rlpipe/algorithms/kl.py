"""KL estimators between the policy and a reference, per token (Schulman, "Approximating KL Divergence", 2020).

With ``log_ratio = logπ_ref(a) − logπ_θ(a)`` for actions a sampled from π_θ:
k1 = −log_ratio (unbiased, high variance, can be negative), k2 = ½·log_ratio² (biased, low variance),
k3 = exp(log_ratio) − log_ratio − 1 (unbiased, always ≥ 0; the GRPO paper's choice);
low_var_kl = k3 clamped to [−10, 10] per token (verl's name for it): one badly-off token cannot dominate.

The KL coefficient β comes from a controller: :class:`FixedKLController`, or
:class:`AdaptiveKLController`, which steers β so the measured KL tracks a target (Ziegler et al. 2019).
"""

from __future__ import annotations

import torch

from rlpipe.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator", fix="check the spelling, or register one with @register_kl")
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


@register_kl("low_var_kl")
def kl_low_var(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return kl_k3(logprobs, ref_logprobs).clamp(-10.0, 10.0)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """(B, T) per-token KL estimate of π_θ ‖ π_ref."""
    return KL_ESTIMATORS.get(kind)(logprobs, ref_logprobs)


class FixedKLController:
    """β stays at its initial value."""

    def __init__(self, coef: float):
        self.value = float(coef)

    def update(self, current_kl: float, n_samples: int) -> float:
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences", §2.2):
    e = clip(KL / target − 1, −0.2, 0.2); β ← β · (1 + e · n / horizon), n = samples since the last update.
    β rises while the measured KL is above the target and falls while it is below."""

    def __init__(self, coef: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0 (got {target}, {horizon})")
        super().__init__(coef)
        self.target, self.horizon = float(target), int(horizon)

    def update(self, current_kl: float, n_samples: int) -> float:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_samples / self.horizon
        return self.value


def kl_controller(coef: float, target: float | None = None, horizon: int = 10_000) -> FixedKLController:
    return FixedKLController(coef) if target is None else AdaptiveKLController(coef, target, horizon)
