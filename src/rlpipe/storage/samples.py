"""A scored sample as the update takes it: one row of the trajectory table, reduced to what the
trainer needs. It lives with the trajectory data (not in the trainer) so that rollout code — single-
and multi-turn — builds samples without importing the trainer."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Sample:
    """One scored completion or episode."""

    prompt_ids: list[int]
    response_ids: list[int]
    old_logprobs: list[float]  # sampling log-probs, one per response token (0 on observation tokens)
    reward: float | None  # None unless the reward status is ok
    group: int  # samples of the same prompt share a group
    loss_mask: list[int] | None = None  # per response token: 1 on the policy's own tokens; None = all 1
    truncated: bool = False  # cut at max_new_tokens (or, for an episode, by its step / time / context limit)
    step_rewards: list[float] | None = None  # episodes: per response token, step k's reward on its action's last token

    @property
    def valid(self) -> bool:
        return self.reward is not None and math.isfinite(self.reward)

    @property
    def action_mask(self) -> list[int]:
        return list(self.loss_mask) if self.loss_mask is not None else [1] * len(self.response_ids)


def step_reward_tokens(loss_mask: list[int], step_rewards: list[float]) -> list[float]:
    """Per response token: the reward of step k on the last token of action k (the k-th run of 1s in the
    loss mask), 0 elsewhere. Raises when the mask holds another number of actions than there are steps."""
    ends = [j for j, m in enumerate(loss_mask) if m and (j + 1 == len(loss_mask) or not loss_mask[j + 1])]
    if len(ends) != len(step_rewards):
        raise ValueError(f"{len(ends)} action(s) in the loss mask but {len(step_rewards)} step reward(s)")
    out = [0.0] * len(loss_mask)
    for j, r in zip(ends, step_rewards):
        out[j] = float(r)
    return out
