"""An RL run's summary (``summary.json``): what it reached, where its time went, and what it cost.

Built once, at the run's end, from the run's progress and its whole history (the one reader of it all).
"""

from __future__ import annotations

from typing import Any

from rlpipe.progress import Progress

__all__ = ["rl_summary", "run_cost", "stage_seconds"]

_STAGES = ("generate_s", "verify_s", "update_s", "sync_s", "eval_s", "save_s")


def rl_summary(config: Any, progress: Progress, history: list[dict[str, Any]], *, fingerprint: str,
               dataset_version: str) -> dict[str, Any]:
    """The summary's numbers (the caller adds its plots, its engine and its MLflow run)."""
    p = progress
    breakdown, iter_total = stage_seconds(history)
    return {
        "kind": "rl", "algorithm": config.train.algorithm, "config_fingerprint": fingerprint,
        "dataset_version": dataset_version, "iterations_done": p.completed_iteration + 1,
        "heldout_accuracy_base": p.base_accuracy, "heldout_accuracy_final": p.final_accuracy, "heldout_n": p.heldout_n,
        "reward_type": config.reward.type, "reward_model_version": p.reward_model_version,
        "heldout_true_score_base": p.base_true_score, "heldout_true_score_final": p.final_true_score,
        "heldout_rm_score_base": p.base_rm_score, "heldout_rm_score_final": p.final_rm_score,
        "reward_hacking_alerts": int(sum(h.get("alerts/reward_hacking", 0.0) for h in history)),
        "alerts_fired": alerts_fired(history),
        "registered_model": {"name": config.registered_model, "version": p.last_registered},
        "final_policy_version": p.weights_sha256,
        **(agent_summary(config, p, history) if config.agent is not None else {}),
        **run_cost(history, p),
        "stage_seconds": breakdown,
        "iteration_seconds_mean": round(iter_total / max(len(history), 1), 3),
        "overhead_share": round(breakdown["overhead_s"] / max(iter_total - breakdown["eval_s"], 1e-9), 4),
    }


def stage_seconds(history: list[dict[str, Any]]) -> tuple[dict[str, float], float]:
    """Seconds per stage over the run, with ``overhead_s``; and the iterations' total as the parent flow saw
    them (the iteration flow runs' own start/finish and the parent's work between iterations included: they
    add up to the loop's wall up to the last mark)."""
    breakdown = {k: round(sum(h.get(f"time/{k}", 0.0) for h in history), 3) for k in _STAGES}
    iter_total = sum(h.get("time/iteration_total_s", h.get("time/iteration_s", 0.0)) for h in history)
    breakdown["overhead_s"] = round(iter_total - sum(breakdown[k] for k in ("generate_s", "verify_s", "update_s", "eval_s")), 3)
    return breakdown, iter_total


def alerts_fired(history: list[dict[str, Any]]) -> dict[str, int]:
    """Rule → how many times it fired over the run (rules that never fired left out)."""
    rules = sorted({k for h in history for k in h if k.startswith("alerts/")})
    return {k.split("/", 1)[1]: n for k in rules if (n := int(sum(h.get(k, 0.0) for h in history)))}


def run_cost(history: list[dict[str, Any]], progress: Progress) -> dict[str, Any]:
    """What the iterations cost: CPU-seconds (GPU-seconds where present) in all, per iteration and per held-out
    point gained (None when nothing was gained), and bytes written to the object store."""
    cpu = sum(h.get("resource/cpu_s", 0.0) for h in history)
    gpu = sum(h.get("resource/gpu_s", 0.0) for h in history)
    base, final = progress.base_accuracy, progress.final_accuracy
    points = (final - base) * 100 if base is not None and final is not None else None
    out = {"cpu_s_total": round(cpu, 1), "cpu_s_per_iteration": round(cpu / max(len(history), 1), 2),
           "cpu_s_per_heldout_point": round(cpu / points, 1) if points and points > 0 else None,
           "store_bytes_written": int(sum(h.get("store/bytes_written", 0.0) for h in history)),
           "peak_rss_bytes": int(max((h.get("resource/rss_bytes", 0.0) for h in history), default=0.0))}
    if gpu:
        out |= {"gpu_s_total": round(gpu, 1), "gpu_s_per_heldout_point": round(gpu / points, 1) if points and points > 0 else None}
    return out


def agent_summary(config: Any, progress: Progress, history: list[dict[str, Any]]) -> dict[str, Any]:
    """Agent runs: greedy episode success on the held-out tasks before and after, with steps and tool calls."""
    last = history[-1] if history else {}
    return {
        "env": config.agent.spec().env,
        "episode_success_base": progress.base_accuracy,
        "episode_success_final": progress.final_accuracy,
        "mean_steps": progress.final_mean_steps,
        "mean_steps_base": progress.base_mean_steps,
        "tool_calls_per_episode": progress.final_tool_calls_per_episode,
        "tool_calls_per_episode_base": progress.base_tool_calls_per_episode,
        "episodes_error_total": int(sum(h.get("episode/error_share", 0.0) * h.get("episode/count", 0.0) for h in history)),
        "episodes_truncated_share_last": last.get("episode/truncated_share"),
    }
