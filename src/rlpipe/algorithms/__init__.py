"""RL maths as pure tensor functions registered by name: advantages, policy losses, KL estimators.

An *algorithm* (``train.algorithm``) names an advantage estimator, a policy loss and the loss
aggregation it is defined with; ``train.advantage`` / ``train.policy_loss`` / ``train.loss_agg_mode``
override any of the three. The presets in ``configs/`` add each method's published settings
(clip ranges, KL placement, sampling rules).
"""

from typing import Any

from rlpipe.registry import Registry

from rlpipe.algorithms.advantages import (
    ADVANTAGES, NEEDS_CRITIC, AdvantageInput, AdvantageOutput, compute_advantages, register_advantage,
)
from rlpipe.algorithms.kl import (
    KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_controller, kl_penalty, register_kl,
)
from rlpipe.algorithms.losses import (
    AGG_MODES, POLICY_LOSSES, LossAgg, aggregate, explained_variance, policy_loss, register_policy_loss, value_loss,
)

# An algorithm: which advantage estimator, policy loss and loss aggregation it is defined with, and "clip": the
# method's published (ε_low, ε_high), used unless the config sets a clip range (without it, PPO's 0.2).
ALGORITHMS: Registry[dict[str, Any]] = Registry("algorithm", fix="check the spelling, or add one to ALGORITHMS")
for _name, _spec in {
    "grpo": {"advantage": "grpo", "policy_loss": "ppo_clip", "loss_agg_mode": "token_mean"},
    "dr_grpo": {"advantage": "dr_grpo", "policy_loss": "ppo_clip", "loss_agg_mode": "constant"},
    "dapo": {"advantage": "grpo", "policy_loss": "ppo_clip", "loss_agg_mode": "token_mean", "clip": (0.2, 0.28)},
    "gspo": {"advantage": "grpo", "policy_loss": "gspo", "loss_agg_mode": "seq_mean_token_mean", "clip": (3e-4, 4e-4)},
    "rloo": {"advantage": "rloo", "policy_loss": "ppo_clip", "loss_agg_mode": "token_mean"},
    "reinforce_pp": {"advantage": "reinforce_pp", "policy_loss": "ppo_clip", "loss_agg_mode": "token_mean"},
    "reinforce_pp_baseline": {"advantage": "reinforce_pp_baseline", "policy_loss": "ppo_clip", "loss_agg_mode": "token_mean"},
    "ppo": {"advantage": "gae", "policy_loss": "ppo_clip", "loss_agg_mode": "token_mean"},
}.items():
    ALGORITHMS.add(_name, _spec)
del _name, _spec


def algorithm(name: str) -> dict[str, Any]:
    """The parts of algorithm ``name``; an unknown name is a KeyError listing the valid ones."""
    return ALGORITHMS.get(name)


__all__ = [
    "ADVANTAGES", "AGG_MODES", "ALGORITHMS", "AdaptiveKLController", "AdvantageInput", "AdvantageOutput",
    "FixedKLController", "KL_ESTIMATORS", "LossAgg", "NEEDS_CRITIC", "POLICY_LOSSES", "aggregate", "algorithm",
    "compute_advantages", "explained_variance", "kl_controller", "kl_penalty", "policy_loss", "register_advantage",
    "register_kl", "register_policy_loss", "value_loss",
]
