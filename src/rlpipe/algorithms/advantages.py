"""Advantage estimators: one typed batch in, an :class:`AdvantageOutput` out, registered by name.

Every estimator takes an :class:`AdvantageInput` plus keyword-only options (``compute_advantages``
passes each estimator only the options it declares), so callers never branch on the name.

Tensors are *response-aligned*: column ``t`` of an (N, T) tensor is the t-th response token of a
sample. Samples whose reward could not be computed (``valid`` False: timeout, unparseable, error,
skipped) take no part in any baseline or normalisation and get advantage 0; the trainer also
masks them out of the loss. A row with no response tokens gets advantage 0, never NaN.

=====================  ==========================================================================
``grpo``               (r − mean_group r) / (std_group r + ε); ``norm_by_std=False`` drops the std
``dr_grpo``            r − mean_group r (Dr.GRPO, Liu et al. 2025; pair with the constant normaliser)
``rloo``               r − mean of the *other* members of the group (Ahmadian et al. 2024)
``reinforce_pp``       REINFORCE++ (Hu 2025): discounted return of token rewards (KL folded in),
                       whitened over every token of the batch
``reinforce_pp_baseline``  the same after subtracting the group mean from the outcome reward
``gae``                PPO with a learned critic: GAE(γ, λ) (Schulman et al. 2016), whitened
=====================  ==========================================================================
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from rlpipe.registry import Registry

ADVANTAGES: Registry = Registry("advantage estimator", fix="check the spelling, or register one with @register_advantage")
register_advantage = ADVANTAGES.register

#: Estimators that need a value model (the trainer builds the critic only for these).
NEEDS_CRITIC = frozenset({"gae"})


@dataclass
class AdvantageInput:
    """rewards: (N,) outcome reward per sample (any value where not valid);
    group_ids: (N,) long, samples of the same prompt share an id;
    valid: (N,) bool, reward status is ok;
    response_mask: (N, T) 1 on the response tokens (response-aligned);
    token_penalty: (N, T) per-token penalty taken off the reward (β·KL when KL is in the reward);
    values: (N, T) critic values V(s_t) before each response token (``gae`` only);
    step_rewards: (N, T) per-step rewards of episodes, each on the last token of its step's action
    (token-level estimators credit them there; ``rewards`` stays the total, the rest of it goes last)."""

    rewards: torch.Tensor
    group_ids: torch.Tensor
    valid: torch.Tensor
    response_mask: torch.Tensor
    token_penalty: torch.Tensor | None = None
    values: torch.Tensor | None = None
    step_rewards: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor:
        return self.response_mask.to(torch.float64)

    def sequence_rewards(self) -> torch.Tensor:
        """(N,) outcome reward minus the summed token penalty (what outcome estimators use)."""
        r = self.rewards.to(torch.float64)
        if self.token_penalty is not None:
            r = r - (self.token_penalty.to(torch.float64) * self.mask).sum(-1)
        return r

    def token_rewards(self, outcome: torch.Tensor | None = None) -> torch.Tensor:
        """(N, T): −penalty on every response token, plus the outcome reward on the last one (with step
        rewards: each on its action's last token, and the outcome's remainder on the last one)."""
        mask = self.mask
        out = torch.zeros_like(mask)
        if self.token_penalty is not None:
            out = out - self.token_penalty.to(torch.float64) * mask
        outcome = self.rewards.to(torch.float64) if outcome is None else outcome
        if self.step_rewards is not None:  # each step's reward at its action; what is left of the outcome at the end
            steps = self.step_rewards.to(torch.float64) * mask
            out = out + steps
            outcome = outcome - steps.sum(-1)
        if mask.shape[1] == 0:  # no response columns at all: nothing to place
            return out
        lengths = mask.sum(-1)
        has = lengths > 0
        # Index of the last response token (the mask may have holes, e.g. tool output in agent turns).
        last = (mask * torch.arange(1, mask.shape[1] + 1, dtype=mask.dtype)).argmax(-1)
        rows = torch.nonzero(has).squeeze(-1)
        out[rows, last[rows]] += outcome[rows]
        return out


@dataclass
class AdvantageOutput:
    advantages: torch.Tensor  # (N, T) float32, 0 off the response and on invalid rows
    returns: torch.Tensor | None = None  # (N, T) value targets (estimators with a critic)
    metrics: dict[str, float] = field(default_factory=dict)


def _group_stats(x: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample mean, unbiased std and count of its group's valid members (count 0 → mean 0, std 0)."""
    _, inv = torch.unique(groups, return_inverse=True)
    g = int(inv.max()) + 1 if inv.numel() else 0
    w = valid.to(x.dtype)
    # Work on offsets from one member's value, so an all-equal group has offsets (and advantages)
    # of exactly 0 rather than a rounding error of its mean.
    ref = torch.full((g,), float("-inf"), dtype=x.dtype).scatter_reduce(
        0, inv, torch.where(valid, x, torch.full_like(x, float("-inf"))), reduce="amax")
    ref = torch.where(torch.isfinite(ref), ref, torch.zeros_like(ref))
    d = torch.where(valid, x - ref[inv], torch.zeros_like(x))
    count = torch.zeros(g, dtype=x.dtype).index_add_(0, inv, w)
    mean_d = torch.zeros(g, dtype=x.dtype).index_add_(0, inv, d) / count.clamp_min(1)
    sq = torch.zeros(g, dtype=x.dtype).index_add_(0, inv, w * (d - mean_d[inv]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp_min(1))
    return (ref + mean_d)[inv], std[inv], count[inv]


def _group_metrics(batch: AdvantageInput, std: torch.Tensor) -> dict[str, float]:
    _, inv = torch.unique(batch.group_ids, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    signal = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inv, (std > 0).to(torch.float64) * batch.valid)
    return {"groups": float(n_groups), "groups_with_signal": float((signal > 0).sum())}


def _broadcast(seq_adv: torch.Tensor, batch: AdvantageInput) -> torch.Tensor:
    """(N,) per-sequence advantage → (N, T) on the response tokens of valid rows."""
    seq_adv = torch.where(batch.valid, seq_adv, torch.zeros_like(seq_adv))
    return (seq_adv.unsqueeze(-1) * batch.mask).to(torch.float32)


def _whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean) / (std + ε) over the masked entries; 0 off the mask (and everywhere if it is empty)."""
    n = mask.sum()
    if n == 0:
        return torch.zeros_like(x)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / (n - 1).clamp_min(1)
    return (x - mean) / (var.sqrt() + eps) * mask


def _discounted(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = Σ_{k≥t} γ^{k−t} r_k over the masked positions of each row (holes are skipped)."""
    out = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in range(rewards.shape[1] - 1, -1, -1):
        m = mask[:, t] > 0
        g = rewards[:, t] + gamma * running
        out[:, t] = torch.where(m, g, torch.zeros_like(g))
        running = torch.where(m, g, running)
    return out


def _abs_mean(adv: torch.Tensor, batch: AdvantageInput) -> float:
    m = batch.mask * batch.valid.unsqueeze(-1)
    return float((adv.abs() * m).sum() / m.sum()) if float(m.sum()) > 0 else 0.0


@register_advantage("grpo")
def grpo_advantages(batch: AdvantageInput, *, norm_by_std: bool = True, eps: float = 1e-6) -> AdvantageOutput:
    """GRPO (Shao et al. 2024, DeepSeekMath §4.1.2): A_i = (r_i − mean_g r) / (std_g r + ε) on every token.

    A group whose valid rewards are all equal (or that has one valid member) gets advantage 0: it
    carries no learning signal.
    """
    r = batch.sequence_rewards()
    mean, std, count = _group_stats(r, batch.group_ids, batch.valid)
    adv = r - mean
    if norm_by_std:
        adv = adv / (std + eps)
    adv = torch.where(count > 1, adv, torch.zeros_like(adv))
    out = _broadcast(adv, batch)
    return AdvantageOutput(out, None, _group_metrics(batch, std) | {"advantage_abs_mean": _abs_mean(out, batch)})


@register_advantage("dr_grpo")
def dr_grpo_advantages(batch: AdvantageInput) -> AdvantageOutput:
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = r_i − mean_g r.

    No std division (it over-weights near-uniform groups); the length bias is removed by the
    constant loss normaliser (``loss_agg_mode: constant``), which the ``dr_grpo`` algorithm defaults to.
    """
    return grpo_advantages(batch, norm_by_std=False)


@register_advantage("rloo")
def rloo_advantages(batch: AdvantageInput) -> AdvantageOutput:
    """RLOO (Ahmadian et al. 2024): A_i = r_i − (1/(n−1)) Σ_{j≠i} r_j = n/(n−1) · (r_i − mean_g r).

    n counts the group's valid members; a group with fewer than 2 has no baseline → advantage 0.
    """
    r = batch.sequence_rewards()
    mean, std, count = _group_stats(r, batch.group_ids, batch.valid)
    adv = torch.where(count > 1, (r - mean) * count / (count - 1).clamp_min(1), torch.zeros_like(r))
    out = _broadcast(adv, batch)
    return AdvantageOutput(out, None, _group_metrics(batch, std) | {"advantage_abs_mean": _abs_mean(out, batch)})


def _reinforce_pp(batch: AdvantageInput, outcome: torch.Tensor, gamma: float) -> AdvantageOutput:
    mask = batch.mask * batch.valid.unsqueeze(-1)
    returns = _discounted(batch.token_rewards(outcome), mask, gamma)
    adv = _whiten(returns, mask).to(torch.float32)
    n = float(mask.sum())
    return AdvantageOutput(adv, None, {
        "return_mean": float((returns * mask).sum()) / n if n else 0.0,
        "advantage_abs_mean": _abs_mean(adv, batch),
    })


@register_advantage("reinforce_pp")
def reinforce_pp_advantages(batch: AdvantageInput, *, gamma: float = 1.0) -> AdvantageOutput:
    """REINFORCE++ (Hu 2025): token rewards r_t = −β·KL_t (+ outcome on the last token), return
    G_t = Σ_{k≥t} γ^{k−t} r_k, then whitened over all response tokens of the batch (no critic, no groups)."""
    return _reinforce_pp(batch, batch.rewards.to(torch.float64), gamma)


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(batch: AdvantageInput, *, gamma: float = 1.0) -> AdvantageOutput:
    """REINFORCE++ with a group baseline: the outcome reward is centred on its prompt's group mean
    before the token returns are formed and whitened over the batch."""
    r = batch.rewards.to(torch.float64)
    mean, std, _ = _group_stats(r, batch.group_ids, batch.valid)
    out = _reinforce_pp(batch, r - mean, gamma)
    out.metrics |= _group_metrics(batch, std)
    return out


@register_advantage("gae")
def gae_advantages(batch: AdvantageInput, *, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True) -> AdvantageOutput:
    """GAE (Schulman et al. 2016) over the response tokens, with V = 0 after the last one:
    δ_t = r_t + γ·V_{t+1} − V_t, A_t = Σ_l (γλ)^l δ_{t+l}, returns R_t = A_t + V_t (the critic's target).
    Advantages are whitened over the batch's valid response tokens (``whiten``); returns are not."""
    if batch.values is None:
        raise ValueError("the 'gae' estimator needs critic values (AdvantageInput.values)")
    mask = batch.mask * batch.valid.unsqueeze(-1)
    rewards = batch.token_rewards()
    values = batch.values.to(torch.float64) * mask
    n, t_len = rewards.shape
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(n, dtype=torch.float64)
    running = torch.zeros(n, dtype=torch.float64)
    for t in range(t_len - 1, -1, -1):
        m = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * running
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
        running = torch.where(m, a, running)
        next_value = torch.where(m, values[:, t], next_value)
    returns = (adv + values) * mask
    out = _whiten(adv, mask) if whiten else adv * mask
    count = float(mask.sum())
    return AdvantageOutput(out.to(torch.float32), returns.to(torch.float32), {
        "return_mean": float(returns.sum()) / count if count else 0.0,
        "value_mean": float(values.sum()) / count if count else 0.0,
        "advantage_abs_mean": _abs_mean(out, batch),
    })


def compute_advantages(name: str, batch: AdvantageInput, **options: object) -> AdvantageOutput:
    """Run estimator ``name`` with the options it declares (others are ignored: one config feeds all)."""
    fn = ADVANTAGES.get(name)
    accepted = {p.name for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    return fn(batch, **{k: v for k, v in options.items() if k in accepted})
