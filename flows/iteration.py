"""One RL iteration as its own Prefect flow run: rollout → verify → update → register → sync."""

from __future__ import annotations

import time
from concurrent.futures import wait
from typing import Any

from prefect import flow

from rlpipe import http_client
from rlpipe.config import RunConfig, settings
from rlpipe.runtime import services
from rlpipe.tracking.mlflow_utils import Tracker
from rlpipe.tracking.resources import monitor
from tasks._log import run_logger
from tasks.rl import (
    evaluate, fault_point, prefetch_rollout, read_progress, rollout, run_history, run_state, sync_weights, update,
    upload_checkpoint, verify, write_progress,
)
from tasks.tracking import lora_tags, register_checkpoint

# Earlier iterations the alert rules see: enough for every rule's window (throughput's median, memory
# growth, reward hacking), and a constant, so an alert check late in a run costs what an early one costs.
ALERT_HISTORY = 200

_UPDATE_METRICS = frozenset({
    "loss", "pg_loss", "kl", "kl_loss", "kl_coef", "entropy", "clip_frac", "approx_kl_old", "grad_norm",
    "samples_excluded", "samples_generated", "optimizer_steps", "nonfinite_steps", "vf_loss", "vf_clip_frac",
    "value_mse", "explained_variance", "critic_grad_norm",
})
_UPDATE_PREFIXES = ("dynamic/", "mismatch/", "ratio/", "advantage/", "tis/", "trainer/")


def _due(iteration: int, every: int, last: int) -> bool:
    return (iteration + 1) % every == 0 or iteration == last


# Its parameters come from the rl-train flow, already typed and validated (RunConfig is validated once, at the
# run's start): Prefect's validation of them redid that work at every call (2.5 ms per call, measured).
@flow(name="rl-iteration", flow_run_name="{run_id}-iter-{iteration}", validate_parameters=False)
def iteration(config: RunConfig, run_id: str, iteration: int, mlflow_run_id: str, dataset_version: str) -> dict[str, Any]:
    start, mon = time.perf_counter(), monitor()
    mark = mon.begin()
    if not _prefetched(run_id, iteration):  # a batch generated ahead made this iteration's first calls
        http_client.drain()  # the services' calls of this iteration only
    last = config.train.total_iterations - 1
    draws = _draws(config, run_id, iteration)
    ahead = _generate_ahead(config, run_id, iteration, last)
    try:
        with mon.stage("update"):
            u = update(config, run_id, iteration, [dv for _, dv in draws])
    except BaseException:
        if ahead:
            wait([ahead])  # never leave the engine generating behind a failed iteration
        raise
    waited = time.perf_counter()
    nxt = ahead.result() if ahead else None  # the engine is reloaded only once the batch ahead is written
    waited = time.perf_counter() - waited
    with mon.stage("sync"):
        s = sync_weights(config, run_id, iteration, u)
    ev, val = None, None
    if _due(iteration, config.train.eval_interval, last):
        with mon.stage("eval"):
            ev, val = evaluate(config, run_id, "test"), evaluate(config, run_id, "validation")
    registered = None
    save_point = _due(iteration, config.train.save_interval, last)
    if save_point:
        with mon.stage("save"):
            ck = upload_checkpoint(config, run_id, iteration, u)
            registered = register_checkpoint(config, run_id, mlflow_run_id, ck, dataset_version, iteration,
                                             aliases=("latest",), accuracy=val["accuracy"] if val else None,
                                             test_accuracy=ev["accuracy"] if ev else None, extra_tags=lora_tags(config, ck))
        fault_point(iteration, "register")
    metrics = _metrics(draws, u, s, ev, val, time.perf_counter() - start, nxt, waited)
    metrics |= mon.metrics(mark) | http_client.drain()
    if config.rollout.prefetch and iteration < last:  # the next batch, on-policy, while this flow run ends
        prefetch_rollout(config, run_id, iteration + 1)
    fired = _alerts(config, run_id, iteration, metrics)
    # A direct call, not a task: per-iteration logging should not pay for a task run of its own.
    tracker = Tracker(settings(), config)
    tracker.log_metrics(mlflow_run_id, metrics, iteration)
    if fired:
        tracker.log_table(mlflow_run_id, [{"iteration": iteration} | a.as_dict() for a in fired], "alerts.json")
    if ev and ev.get("samples"):  # what the policy wrote, next to the numbers: MLflow's Evaluation view
        tracker.log_table(mlflow_run_id, [{"iteration": iteration} | x for x in ev["samples"]], "generations.json")
    _record(config, run_id, iteration, draws, metrics, u, ev, val, registered, save_point)
    run_logger().info(
        "iteration %d: reward %.3f, accuracy %.3f%s, loss %.4f, %.2f s (generate %.2f, verify %.2f, update %.2f, "
        "sync %.2f; overhead %.0f%%)",
        iteration, metrics["reward_mean"], metrics["accuracy"],
        f", held-out {ev['accuracy']:.3f}" if ev else "", metrics.get("loss", float("nan")), metrics["time/iteration_s"],
        metrics["time/generate_s"], metrics["time/verify_s"], metrics["time/update_s"], metrics["time/sync_s"],
        100 * metrics["time/overhead_share"],
    )
    return {"iteration": iteration, "metrics": metrics, "registered": registered, "alerts": [a.as_dict() for a in fired]}


def _draws(config: RunConfig, run_id: str, iteration: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Rollout + verify; with DAPO dynamic sampling, more draws until enough groups carry a signal."""
    draws = []
    with_signal = 0.0
    norm = (read_progress(run_id) or {}).get("reward_norm")  # RLHF: the normaliser after the last iteration
    for draw in range(1 + (config.rollout.max_extra_draws if config.rollout.dynamic_sampling else 0)):
        with monitor().stage("generate"):
            r = rollout(config, run_id, iteration, draw)
        with monitor().stage("verify"):
            v = verify(config, run_id, iteration, r, draw, reward_norm=norm)
        norm = v.get("reward_norm", norm)
        draws.append((r, v))
        with_signal += v.get("groups_with_signal", 0.0)
        if with_signal >= config.rollout.batch_size:
            break
    return draws


def _prefetched(run_id: str, iteration: int) -> bool:
    background = services(run_id).background
    return background is not None and background[0] == iteration


def _generate_ahead(config: RunConfig, run_id: str, iteration: int, last: int) -> Any:
    """rollout.async_steps: 1 — iteration k+1's batch, generated by the policy the engine holds now (before
    update k) while update k runs; a future, joined before the weight sync. None when off or at the last."""
    if config.rollout.async_steps == 0 or iteration >= last:
        return None
    return rollout.submit(config, run_id, iteration + 1, 0)


def _metrics(draws: list, u: dict[str, Any], s: dict[str, Any], ev: dict[str, Any] | None, val: dict[str, Any] | None,
             wall: float, ahead: dict[str, Any] | None = None, ahead_wait: float = 0.0) -> dict[str, float]:
    r, v = draws[0]  # reward metrics: the first draw, an unfiltered on-policy sample like any iteration's
    stages = {
        # Generation the iteration waited for: its own batch unless generated ahead, and the wait for the
        # next one (the rest of that ran during the update, and is rollout/ahead_generate_s).
        # A batch prefetched while the last flow run ended counts only the wait for it.
        "generate_s": sum(dr.get("prefetch_wait_s", 0.0) if dr["reused"] else dr["generate_s"] for dr, _ in draws)
        + ahead_wait,
        "verify_s": sum(0.0 if dv["reused"] else dv["verify_s"] for _, dv in draws),
        "update_s": u["update_s"],
        "sync_s": s["sync_s"],
        "eval_s": ev["eval_s"] + val["eval_s"] if ev else 0.0,
    }
    # What is not generation, scoring or the optimizer (or the optional evaluation): orchestration,
    # storage, checkpoint saves, sync, logging.
    overhead = wall - stages["generate_s"] - stages["verify_s"] - stages["update_s"] - stages["eval_s"]
    metrics = (
        {k: v[k] for k in ("reward_mean", "reward_std", "accuracy", "response_length_mean", "truncated_share")}
        | {k: v[k] for k in v if k.startswith(("status_", "sandbox/", "verifier/", "reward_by_task/"))}
        | {"reward_length_corr": v.get("reward_length_corr", 0.0)}
        | {k: x for k, x in u["metrics"].items() if k in _UPDATE_METRICS or k.startswith(_UPDATE_PREFIXES)}
        | {f"time/{k}": x for k, x in stages.items()}
        | {"time/iteration_s": wall, "time/overhead_s": overhead, "time/overhead_share": overhead / max(wall - stages["eval_s"], 1e-9),
           "time/save_s": u["save_s"],
           "sync/probe_max_abs_diff": s["probe_max_abs_diff"], "sync/probe_policy_change": s["probe_policy_change"],
           "sync/readback_tensors": s["readback_tensors"], "sync/adapter_only": s.get("adapter_only", 0.0),
           "throughput/generate_tokens_per_s": r.get("generate_tokens_per_s", 0.0),
           "throughput/verify_per_s": v.get("verify_per_s", 0.0),
           "throughput/train_tokens_per_s": u["train_tokens_per_s"],
           "alerts": float(len(v.get("alerts", []))),
           "invalid_share": 1.0 - v["status_ok"]}  # what the circuit breaker counts
    )
    metrics |= {k: v[k] for k in ("rm_score_mean", "true_reward_mean") if k in v}
    metrics |= {k: x for src in (r, v) for k, x in src.items() if k.startswith("episode/")}  # agent runs
    metrics |= {k: x for k, x in r.items() if k.startswith("rollout/")}  # rollout replicas
    metrics["rollout/staleness"] = float(max(dr.get("staleness", 0) for dr, _ in draws))
    if ahead is not None:
        metrics["rollout/ahead_generate_s"] = 0.0 if ahead["reused"] else ahead["generate_s"]
    if draws[0][0].get("prefetched"):
        metrics["rollout/prefetch_generate_s"] = draws[0][0]["generate_s"]
    if ev:
        metrics["heldout_accuracy"] = ev["accuracy"]
        if val["accuracy"] is not None:
            metrics["validation_accuracy"] = val["accuracy"]
        for key, src in (("heldout", ev), ("validation", val)):
            for what in ("true_score", "rm_score", "mean_steps", "tool_calls_per_episode"):
                if src.get(what) is not None:
                    metrics[f"{key}_{what}"] = src[what]
    return metrics


def _alerts(config: RunConfig, run_id: str, iteration: int, metrics: dict[str, float]) -> list:
    """The config's alert rules on this iteration (``alerts/<rule>`` metrics, an ALERT line each); the
    batch's own alerts (a flat batch, unscorable samples) are already counted in ``alerts``."""
    from rlpipe.alerts import evaluate

    history = [h for h in run_history(run_id).tail(ALERT_HISTORY + 1) if h["iteration"] < iteration][-ALERT_HISTORY:]
    fired, flags = evaluate(config, metrics, history)
    metrics |= flags
    metrics["alerts"] = metrics.get("alerts", 0.0) + len(fired)
    for a in fired:
        run_logger().warning("ALERT iteration %d [%s %s]: %s", iteration, a.severity, a.rule, a.message)
    return fired


def _record(config: RunConfig, run_id: str, iteration: int, draws: list, metrics: dict[str, float], u: dict[str, Any],
            ev: dict[str, Any] | None, val: dict[str, Any] | None, registered: dict[str, Any] | None, save_point: bool) -> None:
    """The iteration's line in the progress; at a save point the store's record first, then this machine's."""
    progress = read_progress(run_id) or {}
    run_history(run_id).add(iteration, metrics)  # appended: the cost does not grow with the run
    norm = next((dv["reward_norm"] for _, dv in reversed(draws) if "reward_norm" in dv), progress.get("reward_norm"))
    progress = progress | {
        "reward_norm": norm, "completed_iteration": iteration, "resume_dir": u["state_dir"], "weights_sha256": u["weights_sha256"],
        "last_registered": registered["version"] if registered else progress.get("last_registered"),
        "final_accuracy": ev["accuracy"] if ev else progress.get("final_accuracy"),
        "final_true_score": ev["true_score"] if ev else progress.get("final_true_score"),
        "final_rm_score": ev["rm_score"] if ev else progress.get("final_rm_score"),
        "final_mean_steps": ev.get("mean_steps") if ev else progress.get("final_mean_steps"),
        "final_tool_calls_per_episode": ev.get("tool_calls_per_episode") if ev else progress.get("final_tool_calls_per_episode"),
        "final_validation_accuracy": val["accuracy"] if val else progress.get("final_validation_accuracy"),
    }
    if save_point:
        progress = run_state(config, run_id).save_point(progress)
    write_progress(run_id, progress)
    _prune_states(run_id, keep=u["state_dir"])


def _prune_states(run_id: str, keep: str) -> None:
    """Only ``keep`` stays a save point; the newest other one becomes the spare that the next save writes over
    (its pages reused, see RecyclingWrites), the rest are deleted."""
    import os
    import shutil

    from tasks.rl import run_dir, spare_state_dir

    old = sorted((d for d in (run_dir(run_id) / "state").glob("iter=*") if str(d) != keep),
                 key=lambda d: int(d.name.partition("=")[2]))
    if not old:
        return
    spare = spare_state_dir(run_id)
    shutil.rmtree(spare, ignore_errors=True)
    try:
        os.replace(old[-1], spare)
    except OSError:  # a spare that could not be removed: no recycling next time, the old point still goes
        shutil.rmtree(old[-1], ignore_errors=True)
    for d in old[:-1]:
        shutil.rmtree(d, ignore_errors=True)
