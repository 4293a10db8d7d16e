"""Per-iteration statistics of a batch of episodes, flat ``name → number`` for MLflow.

Success means the environment ended the episode itself (``done``) and solved it: ``info["solved"]`` of
the last step where the environment reports it, else a positive reward; a truncated episode never
counts as one. Shares are over all episodes; step statistics are over the
episodes that did not end in ``error`` (an environment fault says nothing about the policy)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from rlpipe.envs.episode import Episode


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def _solved(e: Episode) -> bool:
    """Ended by the environment and solved: its last step's ``info["solved"]`` where the environment says
    (shaped rewards can be positive without a solution), else a positive reward."""
    if not e.done or not e.steps:
        return False
    solved = e.steps[-1].info.get("solved")
    return bool(solved) if solved is not None else (e.reward or 0.0) > 0


def episode_metrics(episodes: Sequence[Episode], prefix: str = "episode/") -> dict[str, float]:
    n = len(episodes)
    if n == 0:
        return {f"{prefix}count": 0.0}
    judged = [e for e in episodes if e.status == "ok"]
    steps = [len(e.steps) for e in judged]
    env_s = [s.env_s for e in judged for s in e.steps]
    out = {
        f"{prefix}count": float(n),
        f"{prefix}error_share": (n - len(judged)) / n,
        f"{prefix}truncated_share": sum(e.truncated for e in judged) / n,
        f"{prefix}success_share": sum(_solved(e) for e in judged) / n,
        f"{prefix}reward_mean": sum(e.reward for e in judged) / len(judged) if judged else 0.0,
        f"{prefix}steps_mean": sum(steps) / len(steps) if steps else 0.0,
        f"{prefix}steps_max": float(max(steps, default=0)),
        f"{prefix}tool_calls_per_episode": sum(e.tool_calls for e in judged) / len(judged) if judged else 0.0,
        f"{prefix}tool_use_share": sum(e.tool_calls > 0 for e in judged) / len(judged) if judged else 0.0,
        f"{prefix}tool_error_rate": sum(e.tool_errors for e in judged) / max(sum(steps), 1),
        f"{prefix}env_step_p50_s": _quantile(env_s, 0.5),
        f"{prefix}env_step_p99_s": _quantile(env_s, 0.99),
    }
    for k, count in sorted(Counter(steps).items()):  # the length distribution
        out[f"{prefix}length/{k}"] = count / n
    return out
