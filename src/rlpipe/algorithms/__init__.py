"""RL maths as pure tensor functions registered by name: advantages, policy losses, KL estimators.

An *algorithm* (``train.algorithm``) names an advantage estimator and a policy loss.
"""

from rlpipe.algorithms.advantages import ADVANTAGES, AdvantageInput, compute_advantages, register_advantage
from rlpipe.algorithms.kl import KL_ESTIMATORS, kl_penalty, register_kl
from rlpipe.algorithms.losses import POLICY_LOSSES, policy_loss, register_policy_loss

ALGORITHMS: dict[str, dict[str, str]] = {
    "grpo": {"advantage": "grpo", "policy_loss": "ppo_clip"},
}


def algorithm(name: str) -> dict[str, str]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise KeyError(f"unknown algorithm {name!r}; valid: {', '.join(sorted(ALGORITHMS))}") from None


__all__ = [
    "ADVANTAGES", "ALGORITHMS", "AdvantageInput", "KL_ESTIMATORS", "POLICY_LOSSES", "algorithm",
    "compute_advantages", "kl_penalty", "policy_loss", "register_advantage", "register_kl", "register_policy_loss",
]
