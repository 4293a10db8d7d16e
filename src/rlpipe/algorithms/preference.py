"""Reward-model maths: pairwise preference losses and the running reward normaliser. Pure torch.

Preference losses take the reward model's scalar scores of the chosen and rejected responses of
each pair and return ``(loss, metrics)``; they are registered by name (``rm.loss``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlpipe.registry import Registry

PREFERENCE_LOSSES: Registry = Registry("preference loss", fix="check the spelling, or register one with @PREFERENCE_LOSSES.register")


@PREFERENCE_LOSSES.register("bradley_terry")
def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """Bradley–Terry negative log-likelihood, mean over pairs (Ouyang et al. 2022, eq. 1).

    chosen, rejected: (P,) scores r(x, y_w), r(x, y_l). margin: (P,) or None — a pair with margin m
    must be won by at least m (Llama 2's margin loss, Touvron et al. 2023): −log σ(r_w − r_l − m).
    A NaN margin means "unknown" and counts as 0.
    """
    diff = chosen.float() - rejected.float()
    if margin is not None:
        diff = diff - torch.nan_to_num(margin.float(), nan=0.0)
    loss = -F.logsigmoid(diff).mean()
    gap = (chosen - rejected).detach().float()
    return loss, {"loss": float(loss.detach()), "pair_accuracy": float((gap > 0).float().mean()),
                  "score_gap": float(gap.mean()), "chosen_score": float(chosen.detach().float().mean()),
                  "rejected_score": float(rejected.detach().float().mean())}


def preference_loss(name: str):
    return PREFERENCE_LOSSES.get(name)


@dataclass
class RunningNorm:
    """Running mean / std of rewards (Welford), for PPO-RLHF reward normalisation.

    ``normalise`` uses the statistics from *before* the batch it is given, then absorbs the batch, so
    a batch is never scaled by itself; it is seeded with the reward model's statistics on its
    training responses so the first iteration is not scaled by nothing."""

    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0

    @classmethod
    def seeded(cls, mean: float, std: float, count: float) -> "RunningNorm":
        return cls(count=count, mean=mean, m2=std * std * count)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 0 else 1.0

    def update(self, xs: list[float]) -> None:
        for x in xs:
            self.count += 1
            delta = x - self.mean
            self.mean += delta / self.count
            self.m2 += delta * (x - self.mean)

    def normalise(self, xs: list[float], clip: float | None) -> list[float]:
        mean, std = (self.mean, max(self.std, 1e-6)) if self.count > 1 else (0.0, 1.0)
        out = [(x - mean) / std for x in xs]
        if clip is not None:
            out = [min(max(x, -clip), clip) for x in out]
        self.update(xs)
        return out

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}
