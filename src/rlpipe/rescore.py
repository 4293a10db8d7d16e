"""Re-score a run's stored trajectories with another verifier version, into a stage of their own.

``rescore_run`` reads each chosen iteration's ``verify`` stage (and its dynamic-sampling draws), scores the rows
the named verifier scored through a verifier pool (the same worker pool, sandbox and options as the run's verify
stage) and writes the result beside it as ``rescore-<name>-<version>``: the original is never touched. The report
says which verdicts changed (status transitions, rewards) and how the mean reward and the advantages (the run's
own estimator, :func:`rlpipe.algorithms.advantages.compute_advantages`) would move. Rows another verifier scored
are copied as they are and counted as kept.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from rlpipe.config import RunConfig
from rlpipe.progress import Progress
from rlpipe.storage.layout import run_prefix, stage_prefix
from rlpipe.storage.schemas import TRAJECTORY_SCHEMA

__all__ = ["RescoreError", "advantage_change", "format_report", "check_verifier", "parse_iterations", "parse_verifier", "rescore_run",
           "run_config", "verdict_changes"]

_SOURCE = re.compile(r"^verify(?:-draw(\d+))?$")


class RescoreError(ValueError):
    """A rescore that cannot go ahead: the message names what and the fix."""


@dataclass(frozen=True)
class Target:
    name: str
    version: str
    stage: str  # the new stage's name, e.g. rescore-math-2


def parse_verifier(spec: str) -> tuple[str, str | None]:
    """``NAME`` or ``NAME@VERSION``."""
    name, _, version = spec.partition("@")
    if not name:
        raise RescoreError(f"--verifier {spec!r}: give NAME or NAME@VERSION")
    return name, version or None


def parse_iterations(spec: str | None, done: list[int]) -> list[int]:
    """``A:B`` (inclusive), ``A:``, ``:B`` or ``K`` over the iterations that have a verify stage."""
    if not spec:
        return done
    lo, sep, hi = spec.partition(":")
    try:
        a = int(lo) if lo else min(done, default=0)
        b = (int(hi) if hi else max(done, default=-1)) if sep else a
    except ValueError:
        raise RescoreError(f"--iterations {spec!r}: give A:B, A:, :B or K (integers)") from None
    chosen = [k for k in done if a <= k <= b]
    if not chosen:
        raise RescoreError(f"--iterations {spec!r} selects none of the run's scored iterations {done}")
    return chosen


def check_verifier(name: str, version: str | None) -> str:
    """The registered version of ``name`` (import the plugins first); an unknown name or another version is an
    error listing what is registered."""
    from rlpipe.rewards import get_verifier, verifier_names

    known = ", ".join(f"{n}@{get_verifier(n).version}" for n in verifier_names())
    if name not in verifier_names():
        raise RescoreError(f"no verifier {name!r} is registered; registered: {known} (a plugin's verifier: --plugin MODULE)")
    registered = get_verifier(name).version
    if version is not None and version != registered:
        raise RescoreError(f"verifier {name!r} is registered at version {registered!r}, not {version!r}; registered: "
                           f"{known} (load the module with that version: --plugin MODULE)")
    return registered


def run_config(store: Any, folder: Any, run_id: str) -> tuple[RunConfig, Progress]:
    """The run's config and progress: this machine's progress.json, else the store's copy."""
    progress = folder.read_progress()
    if progress is None:
        key = f"{run_prefix(run_id)}/progress.json"
        if not store.exists(key):
            raise RescoreError(f"run {run_id!r}: no progress.json on this machine ({folder.path}) nor at {store.url(key)}; "
                               "check the run id and RLPIPE_STORAGE_URI")
        progress = Progress.from_dict(store.get_json(key), where=store.url(key))
    if not progress.config:
        raise RescoreError(f"run {run_id!r}: its progress.json records no config (a run from an older rlpipe)")
    nested: dict[str, Any] = {}
    for key, value in progress.config.items():
        *parents, leaf = key.split(".")
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return RunConfig.model_validate(nested), progress


def _sources(store: Any, run_id: str) -> dict[int, list[tuple[str, int]]]:
    """iteration → [(verify stage prefix, draw)] of every finished verify stage of the run."""
    found: dict[int, list[tuple[str, int]]] = {}
    for key in store.list(run_prefix(run_id)):
        parts = key.split("/")
        if len(parts) == 5 and parts[2].startswith("iter=") and parts[4] == "_manifest.json" \
                and (m := _SOURCE.match(parts[3])):
            found.setdefault(int(parts[2][5:]), []).append(("/".join(parts[:4]), int(m.group(1) or 0)))
    return {k: sorted(v, key=lambda x: x[1]) for k, v in sorted(found.items())}


def _stage_name(store: Any, run_id: str, base: str, iterations: list[int], force_new: bool) -> str:
    taken = lambda name: any(store.list(stage_prefix(run_id, k, name)) for k in iterations)  # noqa: E731
    if not taken(base):
        return base
    if not force_new:
        raise RescoreError(f"stage {base} already exists for run {run_id!r}: it is never overwritten; pass --force-new "
                           "to write another (numbered) stage")
    n = 2
    while taken(f"{base}-{n}"):
        n += 1
    return f"{base}-{n}"


def score_rows(pool: Any, config: RunConfig, table: pa.Table, name: str, ground_truth: dict[str, Any]) -> pa.Table:
    """``table`` with the rows ``name`` scored re-scored through ``pool`` (the overlong penalty as the run applied
    it); the other rows as they were, in the original order."""
    from rlpipe.rollout.batch import apply_overlong_penalty, score_table

    picked = [i for i, v in enumerate(table.column("verifier").to_pylist()) if v == name]
    if not picked:
        return table
    scored, _ = score_table(pool, table.take(pa.array(picked, pa.int64())), ground_truth)
    if config.reward.overlong_buffer:
        scored, _ = apply_overlong_penalty(scored, config.rollout.max_new_tokens, config.reward.overlong_buffer,
                                           config.reward.overlong_penalty)
    rows, new = table.to_pylist(), scored.to_pylist()
    for i, row in zip(picked, new):
        rows[i] = row
    return pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)


def verdict_changes(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows whose (status, reward) moved; status transitions ``old→new``; rows whose reward moved; the mean
    reward over ok rows before and after."""
    transitions: dict[str, int] = {}
    changed = reward_changed = 0
    for b, a in zip(before, after, strict=True):
        if b["reward_status"] != a["reward_status"]:
            key = f"{b['reward_status']}→{a['reward_status']}"
            transitions[key] = transitions.get(key, 0) + 1
        if b["reward"] != a["reward"]:
            reward_changed += 1
        changed += (b["reward_status"], b["reward"]) != (a["reward_status"], a["reward"])
    return {"rows": len(before), "verdicts_changed": changed, "status_changes": dict(sorted(transitions.items())),
            "reward_changed": reward_changed, "mean_reward_before": _mean(before), "mean_reward_after": _mean(after)}


def _mean(rows: list[dict[str, Any]]) -> float | None:
    ok = [r["reward"] for r in rows if r["reward_status"] == "ok" and r["reward"] is not None]
    return sum(ok) / len(ok) if ok else None


def advantages(rows: list[dict[str, Any]], estimator: str, options: dict[str, object]) -> list[float]:
    """Each row's advantage under ``estimator`` (the trainer's function; no KL penalty in the reward): the mean
    over its response tokens; 0 for rows without a verdict."""
    import torch

    from rlpipe.algorithms.advantages import NEEDS_CRITIC, AdvantageInput, compute_advantages

    if estimator in NEEDS_CRITIC:
        raise RescoreError(f"advantage estimator {estimator!r} needs the run's critic; rescore reports rewards only")
    groups: dict[str, int] = {}
    width = max((len(r["response_token_ids"]) for r in rows), default=0)
    mask = torch.zeros(len(rows), max(width, 1))
    for i, r in enumerate(rows):
        mask[i, : len(r["response_token_ids"])] = 1
    batch = AdvantageInput(
        rewards=torch.tensor([float(r["reward"] or 0.0) for r in rows], dtype=torch.float64),
        group_ids=torch.tensor([groups.setdefault(r["prompt_id"], len(groups)) for r in rows], dtype=torch.long),
        valid=torch.tensor([r["reward_status"] == "ok" and r["reward"] is not None for r in rows]),
        response_mask=mask)
    adv = compute_advantages(estimator, batch, **options).advantages.to(torch.float64)
    return ((adv * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist()


def advantage_change(before: list[float], after: list[float]) -> dict[str, float]:
    """The largest |Δ advantage| and the share of rows whose advantage changes sign (+ to −, or − to +)."""
    deltas = [abs(a - b) for b, a in zip(before, after, strict=True)]
    flips = sum(1 for b, a in zip(before, after) if b * a < 0)
    return {"advantage_max_abs_delta": max(deltas, default=0.0), "advantage_sign_flip_share": flips / max(len(deltas), 1)}


def rescore_run(store: Any, config: RunConfig, run_id: str, pool: Any, ground_truth: dict[str, Any], name: str,
                version: str | None, iterations: str | None = None, force_new: bool = False) -> dict[str, Any]:
    """Re-score ``run_id``'s verify stages (see the module docstring); returns the report, also written as JSON
    to ``runs/<run_id>/<stage>-report.json``."""
    if config.agent is not None or config.reward.source_weights() != {"": 1.0}:
        raise RescoreError(f"run {run_id!r} takes its rewards from an environment or mixes reward sources; rescore "
                           "re-scores plain verifier verdicts only")
    registered = check_verifier(name, version)
    sources = _sources(store, run_id)
    chosen = parse_iterations(iterations, list(sources))
    stage = _stage_name(store, run_id, re.sub(r"[^A-Za-z0-9_.-]", "_", f"rescore-{name}-{registered}"), chosen, force_new)
    estimator = config.train.resolved()["advantage"]
    report: dict[str, Any] = {"run_id": run_id, "verifier": name, "verifier_version": registered, "stage": stage,
                              "advantage": estimator, "iterations": {}}
    for k in chosen:
        before_rows: list[dict[str, Any]] = []
        after_rows: list[dict[str, Any]] = []
        prefixes = []
        for prefix, draw in sources[k]:
            table = store.read_stage(prefix, schema=TRAJECTORY_SCHEMA)
            scored = score_rows(pool, config, table, name, ground_truth)
            out = stage_prefix(run_id, k, stage, draw)
            meta = {"rescored_from": prefix, "source_written_at": store.read_manifest(prefix)["written_at"],
                    "verifier": name, "verifier_version": registered}
            store.write_stage(out, [scored], meta=meta, schema=TRAJECTORY_SCHEMA)
            prefixes.append(out)
            before_rows += table.to_pylist()
            after_rows += scored.to_pylist()
        entry = verdict_changes(before_rows, after_rows) | {"prefixes": prefixes}
        entry["rescored_rows"] = sum(1 for r in before_rows if r["verifier"] == name)
        opts = config.train.advantage_kwargs()
        entry |= advantage_change(advantages(before_rows, estimator, opts), advantages(after_rows, estimator, opts))
        report["iterations"][str(k)] = entry
    report["report_key"] = f"{run_prefix(run_id)}/{stage}-report.json"
    store.put_json(report["report_key"], report)
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as lines: one per iteration."""
    lines = [f"run {report['run_id']}: re-scored with {report['verifier']}@{report['verifier_version']} into stage "
             f"{report['stage']} (advantages: {report['advantage']})"]
    for k, e in report["iterations"].items():
        mean = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
        moves = ", ".join(f"{t} {n}" for t, n in e["status_changes"].items()) or "none"
        lines.append(f"  iteration {k}: {e['rescored_rows']}/{e['rows']} rows re-scored, {e['verdicts_changed']} verdicts "
                     f"changed (status: {moves}; reward changed: {e['reward_changed']}); mean reward "
                     f"{mean(e['mean_reward_before'])} → {mean(e['mean_reward_after'])}; advantage max |Δ| "
                     f"{e['advantage_max_abs_delta']:.4f}, sign flips {e['advantage_sign_flip_share']:.1%}")
    lines.append(f"report: {report['report_key']}")
    return "\n".join(lines)


def report_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=1, ensure_ascii=False)

