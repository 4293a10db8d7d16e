"""Policy and value losses: ``(…, mask, *, agg, options) → (loss, metrics)``, registered by name.

Per-token terms are reduced by :func:`aggregate` with a :class:`LossAgg`, which carries the counts
of the whole mini-batch so that any split into micro-batches or ranks sums to the same gradient.

Policy losses:

- ``ppo_clip``: token-level clipped surrogate (Schulman et al. 2017), with separate low/high clip
  ranges ("clip-higher", DAPO: Yu et al. 2025) and the dual-clip bound for negative advantages
  (Ye et al. 2020).
- ``gspo``: the sequence-level importance ratio s_i = exp(mean_t log ρ_{i,t}) (GSPO: Zheng et al.
  2025), in its token form so token-level advantages work too; its clip ranges are much smaller
  (3e-4 / 4e-4 in the paper).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Literal

import torch

from rlpipe.algorithms.functional import masked_mean
from rlpipe.registry import Registry

POLICY_LOSSES: Registry = Registry("policy loss", fix="check the spelling, or register one with @register_policy_loss")
register_policy_loss = POLICY_LOSSES.register

AggMode = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant"]
AGG_MODES: tuple[str, ...] = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant")


@dataclass(frozen=True)
class LossAgg:
    """How per-token losses become one number.

    token_mean:          Σ_{i,t} x / (tokens in the mini-batch)
    seq_mean_token_sum:  Σ_i Σ_t x / (sequences in the mini-batch)
    seq_mean_token_mean: Σ_i (Σ_t x / |o_i|) / (sequences in the mini-batch)
    constant:            Σ_{i,t} x / (sequences × ``constant``)  — Dr.GRPO, constant = max response length

    ``num_tokens`` / ``num_seqs`` are the mini-batch's counts; ``None`` means "this call's own counts".
    A sequence counts when it has at least one masked-in token, except under ``constant``, where every
    sequence of the mini-batch counts (the normaliser must not depend on the mask).
    """

    mode: str = "token_mean"
    num_tokens: float | None = None
    num_seqs: float | None = None
    constant: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in AGG_MODES:
            raise ValueError(f"unknown loss aggregation {self.mode!r}; valid: {', '.join(AGG_MODES)}")
        if self.mode == "constant" and not (self.constant is not None and self.constant > 0):
            raise ValueError("loss aggregation 'constant' needs a positive constant (e.g. the max response length)")


def aggregate(x: torch.Tensor, mask: torch.Tensor, agg: LossAgg | None = None) -> torch.Tensor:
    """Reduce (B, T) per-token values under ``mask`` to a scalar; 0 (never NaN) when nothing is masked in."""
    agg = agg or LossAgg()
    mask = mask.to(x.dtype)
    if agg.mode == "token_mean":
        n = mask.sum() if agg.num_tokens is None else torch.tensor(agg.num_tokens, dtype=x.dtype)
        return (x * mask).sum() / n.clamp_min(1.0)
    if agg.mode == "constant":
        # Dr.GRPO: a constant normaliser. Every sequence of the mini-batch counts, also one whose tokens
        # are all masked out (e.g. a truncated response under mask_truncated): counting only the
        # sequences left after masking would make the normaliser depend on the data again.
        seqs = float(mask.shape[0]) if agg.num_seqs is None else float(agg.num_seqs)
        return (x * mask).sum() / (max(seqs, 1.0) * float(agg.constant))
    seqs = (mask.sum(-1) > 0).sum().to(x.dtype) if agg.num_seqs is None else torch.tensor(agg.num_seqs, dtype=x.dtype)
    seqs = seqs.clamp_min(1.0)
    if agg.mode == "seq_mean_token_sum":
        return (x * mask).sum() / seqs
    if agg.mode == "seq_mean_token_mean":
        return ((x * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)).sum() / seqs


def _ratio_metrics(log_ratio: torch.Tensor, ratio: torch.Tensor, clipped_mask: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    on = mask > 0
    return {
        "clip_frac": masked_mean(clipped_mask.to(mask.dtype), mask),
        "approx_kl_old": masked_mean(0.5 * log_ratio**2, mask),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": ratio[on].max() if on.any() else torch.tensor(1.0),
        "ratio_min": ratio[on].min() if on.any() else torch.tensor(1.0),
    }


def _weighted(per_token: torch.Tensor, is_weights: torch.Tensor | None) -> torch.Tensor:
    """Per-token importance weights (truncated IS against the sampler), constants for the gradient."""
    return per_token if is_weights is None else per_token * is_weights.detach()


def _clipped_surrogate(ratio, advantages, clip_low, clip_high, dual_clip):
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if dual_clip is not None:
        # For A < 0 a huge ratio makes the loss unbounded; cap it at −A·c (c > 1).
        bound = -advantages * dual_clip
        capped = torch.minimum(per_token, bound)
        neg = advantages < 0
        was_clipped = was_clipped | (neg & (bound < per_token))
        per_token = torch.where(neg, capped, per_token)
    return per_token, was_clipped


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: LossAgg | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level PPO clipped surrogate (Schulman et al. 2017, eq. 7), as used by GRPO and DAPO.

    logprobs: (B, T) log π_θ(a_t|s_t) under the current policy (with grad); old_logprobs: (B, T) of
    the policy that sampled a_t; advantages: (B, T); mask: (B, T) 1 where the token takes part.
    per token: max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high)), ρ = exp(logπ_θ − logπ_old); with dual clip
    c, tokens with A < 0 take min(that, −A·c). ``clip_high`` defaults to ``clip_low``.
    ``is_weights``: (B, T) per-token weights (truncated importance sampling), or None.
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    per_token, was_clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_low if clip_high is None else clip_high, dual_clip)
    loss = aggregate(_weighted(per_token, is_weights), mask, agg)
    with torch.no_grad():
        metrics = _ratio_metrics(log_ratio, ratio, was_clipped, mask)
    return loss, metrics


@register_policy_loss("gspo")
def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: LossAgg | None = None,
    clip_low: float = 3e-4,
    clip_high: float | None = 4e-4,
    dual_clip: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): clip the length-normalised *sequence* ratio
    s_i = exp(Σ_t m·(logπ_θ − logπ_old) / |o_i|), not each token's.

    Token form (GSPO-token): s_{i,t} = sg[s_i] · π_θ(y_t)/sg[π_θ(y_t)], equal to s_i in value and
    with gradient s_i·∇logπ_θ(y_t); with a per-sequence advantage it is exactly GSPO's gradient.
    The paper reduces with seq_mean_token_mean (what the ``gspo`` algorithm defaults to).
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
    token_log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(token_log_ratio.clamp(max=10.0))
    per_token, was_clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_low if clip_high is None else clip_high, dual_clip)
    loss = aggregate(_weighted(per_token, is_weights), mask, agg)
    with torch.no_grad():
        metrics = _ratio_metrics(log_ratio, ratio, was_clipped, mask)
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = 0.2,
    agg: LossAgg | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO2 / OpenAI baselines): ½·max((V − R)², (V_clip − R)²),
    V_clip = V_old + clip(V − V_old, −c, c). ``clip=None`` is plain ½(V − R)²."""
    mask = mask.to(values.dtype)
    err = (values - returns) ** 2
    if clip is not None:
        v_clipped = old_values + (values - old_values).clamp(-clip, clip)
        err_clipped = (v_clipped - returns) ** 2
        per_token = 0.5 * torch.maximum(err, err_clipped)
        clipped = err_clipped > err
    else:
        per_token, clipped = 0.5 * err, torch.zeros_like(err, dtype=torch.bool)
    loss = aggregate(per_token, mask, agg)
    with torch.no_grad():
        metrics = {"vf_clip_frac": masked_mean(clipped.to(mask.dtype), mask), "value_mse": masked_mean(err, mask)}
    return loss, metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var(R − V) / Var(R) over the masked entries (1: perfect critic, ≤ 0: no better than a constant)."""
    mask = mask.to(torch.float64)
    n = float(mask.sum())
    if n < 2:
        return float("nan")
    r, v = returns.to(torch.float64), values.to(torch.float64)

    def var(x: torch.Tensor) -> float:
        mean = (x * mask).sum() / n
        return float((((x - mean) * mask) ** 2).sum() / n)

    var_r = var(r)
    return 1.0 - var(r - v) / var_r if var_r > 0 else float("nan")


def policy_loss(name: str, *args, **options) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run policy loss ``name`` with the options it declares (others are ignored: one config feeds all)."""
    fn = POLICY_LOSSES.get(name)
    accepted = {p.name for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    return fn(*args, **{k: v for k, v in options.items() if k in accepted})
