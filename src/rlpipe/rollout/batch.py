"""Rollout batches as trajectory tables: prompt selection (the data cursor), sampling, scoring, metrics."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from rlpipe.rewards.base import VerifyResult
from rlpipe.rewards.pool import VerifierPool, VerifyItem
from rlpipe.rollout.base import RolloutEngine, SamplingConfig
from rlpipe.storage.schemas import REWARD_STATUSES, TRAJECTORY_SCHEMA
from rlpipe.tokens import encode_prompt
from rlpipe.storage.samples import Sample, step_reward_tokens

__all__ = [
    "apply_overlong_penalty", "apply_verdicts", "batch_metrics", "draw_sampling", "filter_groups", "generate_table", "group_signal",
    "prompt_slot", "reuse_expectation", "score_table", "select_prompts", "table_to_samples", "with_column",
]


def select_prompts(rows: Sequence[dict[str, Any]], iteration: int, batch_size: int, seed: int) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The prompts of an iteration: consecutive slices of a seeded per-epoch permutation.

    The cursor is a function of the iteration, so a resumed run draws exactly what the
    uninterrupted run would have drawn. Returns (rows, cursor).
    """
    if not rows:
        raise ValueError("no training prompts (split 'train')")
    n = len(rows)
    start = iteration * batch_size
    picked: list[dict[str, Any]] = []
    epoch, offset = divmod(start, n)
    while len(picked) < batch_size:
        order = list(range(n))
        random.Random(seed * 7919 + epoch).shuffle(order)
        take = order[offset : offset + batch_size - len(picked)]
        picked += [rows[i] for i in take]
        epoch, offset = epoch + 1, 0
    e, o = divmod(start, n)
    return picked, {"epoch": e, "offset": o}


def generate_table(
    engine: RolloutEngine,
    tokenizer: Any,
    prompts: Sequence[dict[str, Any]],
    sampling: SamplingConfig,
    run_id: str,
    iteration: int,
) -> tuple[pa.Table, dict[str, float]]:
    """Sample ``sampling.n`` completions per prompt; rows carry the policy version that sampled them."""
    token_prompts = [encode_prompt(tokenizer, p["prompt"], p["chat"]) for p in prompts]
    start = time.perf_counter()
    outs = engine.generate(token_prompts, sampling)
    gen_s = time.perf_counter() - start
    version = engine.weights_sha256()
    rows = []
    per_sample = gen_s / max(1, len(prompts) * sampling.n)
    for p, ids, comps in zip(prompts, token_prompts, outs):
        for j, c in enumerate(comps):
            rows.append({
                "run_id": run_id, "iteration": iteration, "prompt_id": p["id"], "sample_index": j,
                "policy_version": version, "prompt_token_ids": ids, "response_token_ids": c.token_ids,
                "response_text": c.text, "logprobs": c.logprobs, "loss_mask": [1] * len(c.token_ids), "steps": None,
                "reward": None, "reward_status": "skipped", "reward_reason": "not scored yet",
                "verifier": p["task"], "verifier_version": None, "isolation": None, "truncated": c.finish_reason == "length",
                "generate_s": per_sample, "verify_s": None,
            })
    table = pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)
    tokens = sum(len(r["response_token_ids"]) for r in rows)
    return table, {"generate_s": gen_s, "response_tokens": tokens, "generate_tokens_per_s": tokens / max(gen_s, 1e-9)}


def score_table(pool: VerifierPool, table: pa.Table, ground_truth: dict[str, str | None]) -> tuple[pa.Table, dict[str, float]]:
    """Fill reward/status/reason with the verifiers' verdicts (non-ok verdicts keep reward null)."""
    from rlpipe.rewards import get_verifier

    rows = table.to_pylist()
    items = [VerifyItem(r["verifier"], r["response_text"] or "", ground_truth.get(r["prompt_id"])) for r in rows]
    start = time.perf_counter()
    verdicts = pool.score(items)
    verify_s = time.perf_counter() - start
    versions = {}
    for name in {r["verifier"] for r in rows}:
        try:
            versions[name] = get_verifier(name).version
        except KeyError:
            versions[name] = None
    labels = [(r["verifier"], versions[r["verifier"]]) for r in rows]
    return apply_verdicts(rows, verdicts, labels, verify_s), {"verify_s": verify_s, "verify_per_s": len(rows) / max(verify_s, 1e-9)}


def apply_verdicts(rows: list[dict[str, Any]], verdicts: Sequence[VerifyResult], labels: Sequence[tuple[str, str | None]],
                   verify_s: float) -> pa.Table:
    """Trajectory rows with each verdict written in: reward (null unless ok), status, reason, the sandbox
    level, and (name, version) of what scored it."""
    per = verify_s / max(1, len(rows))
    for r, v, (name, version) in zip(rows, verdicts, labels):
        r["reward"] = v.reward if v.status == "ok" else None
        r["reward_status"] = v.status
        r["reward_reason"] = v.reason or None
        r["isolation"] = v.isolation
        r["verifier"], r["verifier_version"] = name, version
        r["verify_s"] = per
    return pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to max − buffer tokens, then
    falling linearly to −factor at max_new_tokens."""
    return factor * min(0.0, (max_new_tokens - buffer - length) / buffer)


def apply_overlong_penalty(table: pa.Table, max_new_tokens: int, buffer: int, factor: float = 1.0) -> tuple[pa.Table, dict[str, float]]:
    """Add the soft overlong punishment to every scored (status ok) reward; the reason says so."""
    rows = table.to_pylist()
    hit = 0
    for r in rows:
        pen = overlong_penalty(len(r["response_token_ids"]), max_new_tokens, buffer, factor)
        if r["reward_status"] == "ok" and pen < 0:
            r["reward"] += pen
            r["reward_reason"] = ((r["reward_reason"] or "") + f"; overlong penalty {pen:+.3f}").lstrip("; ")
            hit += 1
    return pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA), {"overlong_penalized_share": hit / max(len(rows), 1)}


def group_signal(rows: Sequence[dict[str, Any]]) -> dict[str, bool]:
    """prompt_id → whether its group carries a learning signal: ≥ 2 scored rewards, not all equal."""
    scored: dict[str, set[float]] = {}
    counts: dict[str, int] = {}
    for r in rows:
        scored.setdefault(r["prompt_id"], set())
        if r["reward_status"] == "ok":
            scored[r["prompt_id"]].add(r["reward"])
            counts[r["prompt_id"]] = counts.get(r["prompt_id"], 0) + 1
    return {k: counts.get(k, 0) >= 2 and len(v) > 1 for k, v in scored.items()}


def filter_groups(tables: Sequence[pa.Table], max_groups: int) -> tuple[pa.Table, dict[str, float]]:
    """DAPO dynamic sampling: keep the groups with signal (first drawn first), at most ``max_groups``."""
    rows = [r for t in tables for r in t.to_pylist()]
    signal = group_signal(rows)
    kept = [k for k, ok in signal.items() if ok][:max_groups]
    keep = set(kept)
    out = [r for r in rows if r["prompt_id"] in keep]
    return pa.Table.from_pylist(out, schema=TRAJECTORY_SCHEMA), {
        "dynamic/draws": float(len(tables)),
        "dynamic/groups_drawn": float(len(signal)),
        "dynamic/groups_kept": float(len(kept)),
        "dynamic/groups_dropped": float(len(signal) - len(kept)),
        "dynamic/samples_kept": float(len(out)),
    }


def table_to_samples(table: pa.Table, step_rewards: bool = False) -> list[Sample]:
    """The update's samples; ``step_rewards``: episodes carry each step's reward at its action (see
    :class:`Sample`), for token-level estimators."""
    groups: dict[str, int] = {}
    out = []
    for r in table.to_pylist():
        g = groups.setdefault(r["prompt_id"], len(groups))
        ok = r["reward_status"] == "ok"
        steps = step_reward_tokens(r["loss_mask"], [s["reward"] for s in r["steps"]]) if step_rewards and ok else None
        out.append(Sample(r["prompt_token_ids"], r["response_token_ids"], r["logprobs"],
                          r["reward"] if ok else None, g, r["loss_mask"], bool(r["truncated"]), steps))
    return out


def reward_by_task(rows: list[dict[str, Any]]) -> dict[str, float]:
    """``reward_by_task/<verifier>``: the mean scored reward of each task (the verifier that judged it)."""
    by: dict[str, list[float]] = {}
    for r in rows:
        if r["reward_status"] == "ok":
            by.setdefault(r["verifier"] or "unknown", []).append(r["reward"])
    return {f"reward_by_task/{k}": statistics.fmean(v) for k, v in sorted(by.items())}


def reward_length_corr(rows: list[dict[str, Any]]) -> float:
    """Pearson correlation of reward and response length over the scored rows (0 when either is constant):
    a reward that grows with length alone is a sign of reward hacking."""
    pairs = [(r["reward"], len(r["response_token_ids"])) for r in rows if r["reward_status"] == "ok"]
    if len(pairs) < 2 or len({p[0] for p in pairs}) < 2 or len({p[1] for p in pairs}) < 2:
        return 0.0
    return statistics.correlation([float(p[0]) for p in pairs], [float(p[1]) for p in pairs])


def batch_metrics(table: pa.Table, flat_batch_alert: bool = True) -> tuple[dict[str, float], list[str]]:
    """Reward statistics, status shares and response lengths of a scored batch, plus alerts.

    ``flat_batch_alert=False`` when all-equal rewards are expected and handled (dynamic sampling
    drops such groups and draws more)."""
    rows = table.to_pylist()
    n = max(len(rows), 1)
    ok = [r["reward"] for r in rows if r["reward_status"] == "ok"]
    metrics: dict[str, float] = {f"status_{s}": sum(r["reward_status"] == s for r in rows) / n for s in REWARD_STATUSES}
    metrics |= {
        "reward_mean": statistics.fmean(ok) if ok else float("nan"),
        "reward_std": statistics.pstdev(ok) if len(ok) > 1 else 0.0,
        "accuracy": sum(1 for x in ok if x == 1.0) / n,
        "response_length_mean": statistics.fmean(len(r["response_token_ids"]) for r in rows) if rows else 0.0,
        "truncated_share": sum(bool(r["truncated"]) for r in rows) / n,
    }
    signal = group_signal(rows)
    metrics |= {"groups": float(len(signal)), "groups_with_signal": float(sum(signal.values()))}
    metrics |= reward_by_task(rows) | {"reward_length_corr": reward_length_corr(rows)}
    alerts = []
    if flat_batch_alert and ok and len(set(ok)) == 1:
        alerts.append(f"all {len(ok)} scored rewards equal {ok[0]:g}: no learning signal in this batch")
    if rows and len(ok) < 0.5 * len(rows):
        alerts.append(f"only {len(ok)}/{len(rows)} samples could be scored (see status_* metrics)")
    return metrics, alerts


# -- which prompts a draw takes, and when a stored batch may be reused -----------------------------
def prompt_slot(rollout: Any, iteration: int, draw: int) -> int:
    """Which slice of the data order a draw takes (``rollout``: the run's rollout section). With dynamic
    sampling every iteration reserves 1 + max_extra_draws slices, so a resumed run draws exactly what the
    uninterrupted one would."""
    if not rollout.dynamic_sampling:
        return iteration
    return iteration * (1 + rollout.max_extra_draws) + draw


def draw_sampling(rollout: Any, seed: int, iteration: int, draw: int) -> SamplingConfig:
    """The sampling of one draw: the rollout section's settings, with a seed of its own per (iteration, draw)."""
    return SamplingConfig(n=rollout.samples_per_prompt, temperature=rollout.temperature, top_p=rollout.top_p,
                          max_new_tokens=rollout.max_new_tokens, seed=seed * 1_000_003 + iteration * 10_007 + draw * 101)


def reuse_expectation(async_steps: int, engine_sha256: str, meta: dict[str, Any], iteration: int) -> dict[str, Any]:
    """What a stored batch must match to be reused. An on-policy batch: the policy the engine holds now
    (``engine_sha256``). A batch generated ahead (rollout.async_steps) by an earlier policy: its staleness
    within the bound."""
    staleness = iteration - 1 - meta.get("policy_iteration", iteration - 1)
    if staleness == 0 or async_steps == 0:
        return {"policy_version": engine_sha256}
    return {"staleness": staleness if staleness <= async_steps else f"at most {async_steps}"}


def with_column(table: pa.Table, name: str, value: int) -> pa.Table:
    """``table`` with an int32 column ``name`` set to ``value`` on every row (replaced if it exists)."""
    column = pa.array([value] * table.num_rows, pa.int32())
    i = table.schema.get_field_index(name)
    return table.set_column(i, name, column) if i >= 0 else table.append_column(name, column)
