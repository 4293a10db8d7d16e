"""A rollout batch scored: its verdicts, the reward guards, its metrics and alerts.

The rewards come from each row's verifier, or from every source the config mixes (RLHF:
:func:`rlpipe.rewards.mix.mix_sources`), or — agent runs — from the environment, checked episode by episode.
Before anything is stored the guards run: the isolation each verdict was produced under, and the circuit
breaker over the recent iterations' invalid shares. Then the overlong penalty (DAPO) and the batch's metrics.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pyarrow as pa

from rlpipe.rewards.guards import check_circuit, check_rows_isolation, invalid_share
from rlpipe.rollout.batch import apply_overlong_penalty, apply_verdicts, batch_metrics, score_table

__all__ = ["score_batch", "score_sources"]

_LOG = logging.getLogger("rlpipe")


def score_batch(config: Any, svc: Any, history: Any, table: pa.Table, iteration: int,
                reward_norm: dict[str, float] | None, log: Any = _LOG) -> tuple[pa.Table, dict[str, Any], list[str]]:
    """Score ``table`` (a rollout stage) with the run's services ``svc``; ``history``: the run's RunHistory
    (the circuit breaker reads its tail). Returns the scored table, its stats and metrics, and its alerts."""
    start = time.perf_counter()
    healthy = svc.pool.healthy()  # every iteration, not only at start
    if not healthy:
        log.warning("ALERT iteration %d: verifier pool/service not healthy; unscorable samples are counted", iteration)
    if config.agent is not None:  # the environment gave the rewards; check every episode before training
        from rlpipe.rollout.agent import check_episodes

        scored, stats = check_episodes(table, config.agent.spec().limits.max_steps)
        check_s = time.perf_counter() - start
        stats |= {"verify_s": check_s, "verify_per_s": table.num_rows / max(check_s, 1e-9)}
    else:
        scored, stats = score_sources(config, svc, table, reward_norm)
    rows = scored.to_pylist()
    stats |= check_rows_isolation(rows, config.reward.required_sandbox_components())
    stats |= {"verifier/healthy": float(healthy), "verifier/restarts": float(getattr(svc.pool, "restarts", 0))}
    recent = history.tail(config.reward.max_invalid_iterations + 1)
    previous = [h.get("invalid_share", 0.0) for h in recent if h["iteration"] < iteration]
    check_circuit(previous, invalid_share(rows), rows, config.reward.max_invalid_share,
                  config.reward.max_invalid_iterations, iteration)
    if config.reward.overlong_buffer:
        scored, pen = apply_overlong_penalty(scored, config.rollout.max_new_tokens, config.reward.overlong_buffer,
                                             config.reward.overlong_penalty)
        stats |= pen
    # With dynamic sampling an all-equal batch is expected: its groups are dropped, not an alert.
    metrics, alerts = batch_metrics(scored, flat_batch_alert=not config.rollout.dynamic_sampling)
    if "true_accuracy" in stats:  # RLHF: accuracy is the hidden verifier's, not "reward == 1"
        metrics["accuracy"] = stats.pop("true_accuracy")
    for source in (svc.pool, svc.reward_model):  # a verifier or reward-model service was down, refused or slow
        if getattr(source, "last_problem", None):
            alerts.append(source.last_problem)
    for a in alerts:
        log.warning("ALERT iteration %d: %s", iteration, a)
    return scored, stats | metrics, alerts


def score_sources(config: Any, svc: Any, table: pa.Table, norm_state: dict[str, float] | None
                  ) -> tuple[pa.Table, dict[str, Any]]:
    """Verdicts of every reward source the config names, mixed by weight (RLHF: the reward model, its score
    normalised when asked, and any verifiers); the hidden true score of each row is measured beside it."""
    from rlpipe.rewards.mix import mix_sources, seed_norm

    weights = config.reward.source_weights()
    if weights == {"": 1.0}:
        return score_table(svc.pool, table, svc.ground_truth)
    rows, start = table.to_pylist(), time.perf_counter()
    norm = None
    if "model" in weights and config.reward.normalize:
        from rlpipe.algorithms.preference import RunningNorm

        batch = config.rollout.batch_size * config.rollout.samples_per_prompt
        norm = RunningNorm(**norm_state) if norm_state else seed_norm(svc.reward_model.stats, batch)
    mixed = mix_sources(rows, weights, svc.pool, svc.ground_truth, reward_model=svc.reward_model, prompts=svc.prompts,
                        norm=norm, clip=config.reward.clip)
    verify_s = time.perf_counter() - start
    scored = apply_verdicts(rows, mixed.verdicts, [(mixed.label, mixed.version)] * len(rows), verify_s)
    return scored, mixed.stats | {"verify_s": verify_s, "verify_per_s": len(rows) / max(verify_s, 1e-9)}
