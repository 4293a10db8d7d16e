"""Greedy evaluation of a policy on a split: what an RL run reports every ``eval_interval`` and what the
``evaluate`` flow measures for a registered model version.

One function for both, so a number in an RL run's history and a number the evaluate flow logs for the
same weights and split are the same number.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

__all__ = ["EVAL_SAMPLES", "Judged", "benchmark_metrics", "compare", "greedy_eval", "pass_at_k"]

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


# -- benchmark metrics (the evaluation suite: rlpipe.eval_suite) ------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from ``n`` samples of which ``c`` are correct (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code", eq. 1): ``1 - C(n-c, k) / C(n, k)``, the chance that
    k samples drawn without replacement from the n hold at least one correct one.

    Computed as the paper's numpy form, ``1 - prod(1 - k / arange(n-c+1, n+1))``: the binomials themselves
    overflow a float for n in the hundreds. ``k > n`` is an error: k samples cannot be drawn from fewer."""
    import numpy as np

    if not 0 <= c <= n:
        raise ValueError(f"pass@k: c={c} correct samples out of n={n}; c must be between 0 and n")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k: k={k} with n={n} samples; k must be between 1 and n (raise sampling.n or drop k={k})")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


@dataclass(frozen=True)
class Judged:
    """One response and its verdict: what the benchmark metrics are computed from."""

    status: str  # the verifier's status (ok, unparseable, timeout, error, skipped)
    reward: float | None
    n_tokens: int  # tokens the engine generated
    truncated: bool  # stopped by max_new_tokens (neither an end token nor a stop string)

    @property
    def correct(self) -> bool:
        """Reward 1 with status ok. Any other status (a verifier error, a timeout) is wrong, never dropped:
        leaving such rows out would score a model on the problems its verifier happened to handle."""
        return self.status == "ok" and self.reward == 1.0


def benchmark_metrics(greedy: list[Judged] | None, samples: list[list[Judged]] | None, ks: list[int]) -> dict[str, float]:
    """A benchmark's numbers, over its P problems.

    ``greedy``: one response per problem (or None); ``samples``: n responses per problem (or None).
    Returns ``n`` (P), ``greedy_acc`` (share of problems answered correctly greedily), ``pass_at_<k>`` for each
    k (the mean over problems of :func:`pass_at_k`), ``mean_len`` (mean generated tokens) and ``truncated``
    (share that hit max_new_tokens), both over every response greedy and sampled, and ``n_<status>`` (how
    many verdicts of each status, over every response)."""
    every = (greedy or []) + [j for per in samples or [] for j in per]
    if not every:
        raise ValueError("benchmark_metrics: no responses (neither greedy nor sampled)")
    problems = len(greedy) if greedy is not None else len(samples or [])
    out: dict[str, float] = {"n": float(problems)}
    if greedy is not None:
        out["greedy_acc"] = sum(j.correct for j in greedy) / len(greedy)
    for k in ks if samples is not None else []:
        out[f"pass_at_{k}"] = sum(pass_at_k(len(per), sum(j.correct for j in per), k) for per in samples) / len(samples)
    out["mean_len"] = sum(j.n_tokens for j in every) / len(every)
    out["truncated"] = sum(j.truncated for j in every) / len(every)
    from rlpipe.storage.schemas import REWARD_STATUSES

    # Every known status, 0 included: runs compared side by side in MLflow have the same columns.
    statuses = REWARD_STATUSES + tuple(sorted({j.status for j in every} - set(REWARD_STATUSES)))
    out |= {f"n_{s}": float(sum(j.status == s for j in every)) for s in statuses}
    return out
