"""One reward per sample from every source a run names: verifiers and the reward model, mixed by weight.

RLHF scores each sample with the reward model (its score normalised by a running normaliser when
``reward.normalize``), optionally beside verifiers (``reward.weights``); the verifier of each row is run
too, as the hidden *true* score that shows reward hacking. The result is a verdict per sample, its
label (``rm+verifier``) and the reward model's version, ready to be written into the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlpipe.rewards.base import VerifyResult
from rlpipe.rewards.pool import VerifyItem

__all__ = ["MixedVerdicts", "mix_sources", "seed_norm"]


@dataclass
class MixedVerdicts:
    verdicts: list[VerifyResult]
    label: str  # which sources, "+"-joined: "rm", "rm+verifier", "math+format"
    version: str | None  # the reward model's version when it is a source
    stats: dict[str, Any] = field(default_factory=dict)  # true_reward_mean, true_accuracy, rm_score_mean, reward_norm


def mix_sources(rows: list[dict[str, Any]], weights: dict[str, float], pool: Any, ground_truth: dict[str, Any], *,
                reward_model: Any = None, prompts: dict[str, dict[str, Any]] | None = None, norm: Any = None,
                clip: float | None = None) -> MixedVerdicts:
    """Score ``rows`` (trajectory rows) by each source of ``weights`` and mix them.

    ``weights``: source → weight, ``model`` for the reward model, ``""`` for each row's own verifier, any
    other name a verifier. ``norm``: a running normaliser for the reward model's scores, updated in place
    (None: raw scores). ``prompts``: prompt id → prompt row, for the reward model's input."""
    from rlpipe.rewards.model import RMItem, mix_rewards, normalise_results

    own = pool.score([VerifyItem(r["verifier"], r["response_text"] or "", ground_truth.get(r["prompt_id"])) for r in rows])
    true_ok = [v.reward for v in own if v.status == "ok"]
    stats: dict[str, Any] = {"true_reward_mean": sum(true_ok) / len(true_ok) if true_ok else float("nan"),
                             "true_accuracy": sum(x == 1.0 for x in true_ok) / max(len(rows), 1)}
    results: dict[str, list[VerifyResult]] = {}
    for name in weights:
        if name == "model":
            items = [RMItem(prompts[r["prompt_id"]]["prompt"], r["response_text"] or "", prompts[r["prompt_id"]]["chat"])
                     for r in rows]
            res = reward_model.score(items)
            raw = [v.reward for v in res if v.status == "ok"]
            stats["rm_score_mean"] = sum(raw) / len(raw) if raw else float("nan")
            if norm is not None:
                res = normalise_results(res, norm, clip)
                stats["reward_norm"] = norm.state_dict()
            results[name] = res
        else:
            results[name] = own if name == "" else pool.score(
                [VerifyItem(name, r["response_text"] or "", ground_truth.get(r["prompt_id"])) for r in rows])
    label = "+".join("rm" if n == "model" else (n or "verifier") for n in weights)
    version = reward_model.version if "model" in weights else None
    return MixedVerdicts(mix_rewards(results, weights), label, version, stats)


def seed_norm(stats: dict[str, Any] | None, batch: int) -> Any:
    """The normaliser's start: the reward model's registered statistics (``mean``, ``std``, ``count``),
    weighted as at most one iteration's batch of ``batch`` samples; an empty normaliser without them."""
    from rlpipe.algorithms.preference import RunningNorm

    st = stats or {}
    if "mean" not in st:
        return RunningNorm()
    return RunningNorm.seeded(float(st["mean"]), float(st["std"]), min(float(st.get("count", 1.0)), float(batch)))
