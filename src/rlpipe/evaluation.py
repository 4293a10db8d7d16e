"""Greedy evaluation of a policy on a split: what an RL run reports every ``eval_interval`` and what the
``evaluate`` flow measures for a registered model version.

One function for both, so a number in an RL run's history and a number the evaluate flow logs for the
same weights and split are the same number.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["EVAL_SAMPLES", "greedy_eval", "compare"]

EVAL_SAMPLES = 8  # (prompt, response, verdict) rows kept for MLflow's table view


def greedy_eval(engine: Any, tokenizer: Any, pool: Any, rows: list[dict[str, Any]], ground_truth: dict[str, Any], *,
                max_new_tokens: int, reward_model: Any = None, agent: Any = None, env_url: str | None = None) -> dict[str, Any]:
    """Greedy answers of the policy ``engine`` holds, judged by each row's verifier.

    Returns ``accuracy`` (share of rows with reward 1; a verifier error counts as wrong, never dropped),
    ``true_score`` (mean reward over the rows scored ok), ``rm_score`` (the reward model's mean, when one
    is given), ``n``, ``samples`` (the first EVAL_SAMPLES rows), ``eval_s`` and ``policy_version`` (the
    engine's weights sha256). Agent configs run whole greedy episodes instead."""
    from rlpipe.rewards.pool import VerifyItem
    from rlpipe.rollout.base import SamplingConfig
    from rlpipe.tokens import encode_prompt

    start = time.perf_counter()
    if not rows:
        return {"accuracy": None, "true_score": None, "rm_score": None, "n": 0, "eval_s": 0.0,
                "policy_version": engine.weights_sha256()}
    if agent is not None:
        from rlpipe.rollout.agent import agent_evaluate

        out = agent_evaluate(engine, tokenizer, agent, rows, max_new_tokens, env_url)
        return out | {"eval_s": time.perf_counter() - start, "policy_version": engine.weights_sha256()}
    prompts = [encode_prompt(tokenizer, r["prompt"], r["chat"]) for r in rows]
    outs = engine.generate(prompts, SamplingConfig(n=1, temperature=0.0, max_new_tokens=max_new_tokens))
    texts = [o[0].text for o in outs]
    verdicts = pool.score([VerifyItem(r["task"], t, ground_truth[r["id"]]) for r, t in zip(rows, texts)])
    ok = [v.reward for v in verdicts if v.status == "ok"]
    out = {"accuracy": sum(1 for x in ok if x == 1.0) / len(rows), "true_score": sum(ok) / len(ok) if ok else None,
           "rm_score": None, "n": len(rows),
           "statuses": {s: sum(1 for v in verdicts if v.status == s) for s in sorted({v.status for v in verdicts})},
           "samples": [{"prompt": r["prompt"], "response": t, "ground_truth": ground_truth[r["id"]],
                        "status": v.status, "reward": v.reward} for r, t, v in list(zip(rows, texts, verdicts))[:EVAL_SAMPLES]]}
    if reward_model is not None:
        from rlpipe.rewards.model import RMItem

        rm = reward_model.score([RMItem(r["prompt"], t, r["chat"]) for r, t in zip(rows, texts)])
        scores = [v.reward for v in rm if v.status == "ok"]
        out["rm_score"] = sum(scores) / len(scores) if scores else None
    return out | {"eval_s": time.perf_counter() - start, "policy_version": engine.weights_sha256()}


def compare(candidate: float | None, baseline: float | None) -> tuple[bool, str]:
    """Whether a candidate's accuracy beats the baseline's (strictly: a tie keeps the alias where it is),
    and why, in words for the log and the MLflow run."""
    if candidate is None:
        return False, "the candidate has no accuracy on this split (no rows)"
    if baseline is None:
        return True, f"no baseline: the candidate's {candidate:.3f} is the first"
    if candidate > baseline:
        return True, f"{candidate:.3f} beats the baseline's {baseline:.3f}"
    return False, f"{candidate:.3f} does not beat the baseline's {baseline:.3f}"
