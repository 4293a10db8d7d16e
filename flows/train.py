"""The RL run: data → services (started once) → one `rl-iteration` flow run per iteration → summary.

Running it again with the same run id resumes after the last completed iteration, with the
optimizer state, RNG and data cursor saved then; stages of the interrupted iteration that were
finished (manifest written) are reused, half-written ones are redone.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow

from flows.iteration import iteration
from rlpipe.config import RunConfig, settings
from rlpipe.runs import new_run_id, write_summary
from rlpipe.runtime import stop_services
from rlpipe.storage.layout import check_run_id
from tasks._log import run_logger
from tasks.data import prepare_dataset
from tasks.rl import evaluate, read_progress, run_dir, start_services, write_progress
from tasks.tracking import end_tracking, log_metrics, start_tracking


def _local_model(spec: str | None, config: RunConfig) -> str | None:
    if spec is None:
        return None
    from rlpipe.training.models import fetch_source, resolve_source

    if spec == "tiny":
        raise ValueError("task.policy_model 'tiny' is an untrained model: run `rlpipe sft` first and use models:/NAME@base")
    return str(fetch_source(resolve_source(spec, settings(), config), settings()))


@flow(name="rl-train", flow_run_name="{run_id}")
def train(config: RunConfig = RunConfig(), run_id: str = "") -> str:
    """Train with RL; returns the path of the run's summary.json."""
    start = time.perf_counter()
    run_id = check_run_id(run_id or new_run_id("rl"))
    log = run_logger()
    dataset = prepare_dataset(config)
    mlflow_run = start_tracking(config, run_id, "rl", dataset["version"])
    progress = read_progress(run_id) or {}
    first = progress.get("completed_iteration", -1) + 1
    resume_dir = progress.get("resume_dir")
    if resume_dir:
        log.info("resuming run %s at iteration %d from %s", run_id, first, resume_dir)
    model_dir = _local_model(config.task.policy_model, config)
    ref_spec, critic_spec = config.task.ref_model, config.train.critic.model
    if ref_spec or critic_spec:
        config = config.model_copy(deep=True)
        if ref_spec:
            config.task.ref_model = _local_model(ref_spec, config)
        if critic_spec:
            config.train.critic.model = _local_model(critic_spec, config)
    try:
        services = start_services(config, run_id, dataset, model_dir, resume_dir)
        if "base_accuracy" not in progress:
            base = evaluate(config, run_id)
            progress = progress | {"base_accuracy": base["accuracy"], "base_policy": base["policy_version"],
                                   "heldout_n": base["n"], "dataset_version": dataset["version"],
                                   "config_fingerprint": config.fingerprint()}
            write_progress(run_id, progress)
            log_metrics(config, mlflow_run, {"heldout_accuracy": base["accuracy"]}, -1)
            log.info("base policy: held-out accuracy %.3f (n=%d)", base["accuracy"], base["n"])
        for k in range(first, config.train.total_iterations):
            t0 = time.perf_counter()
            out = iteration(config, run_id, k, mlflow_run, dataset["version"])
            _account_outer_time(config, run_id, k, mlflow_run, out["metrics"], time.perf_counter() - t0)
    except BaseException:
        end_tracking(config, mlflow_run, "FAILED")
        raise
    finally:
        stop_services(run_id)
    progress = read_progress(run_id) or {}
    summary = _summary(config, run_id, dataset, mlflow_run, progress, services, time.perf_counter() - start)
    end_tracking(config, mlflow_run)
    path = write_summary(settings(), run_id, summary)
    log.info("summary: %s", path)
    return str(path)


def _account_outer_time(config: RunConfig, run_id: str, k: int, mlflow_run: str, m: dict[str, float], total: float) -> None:
    """Overhead as the parent sees it: the iteration flow run's own start/finish included."""
    from rlpipe.tracking.mlflow_utils import Tracker

    compute = m["time/generate_s"] + m["time/verify_s"] + m["time/update_s"]
    extra = {"time/iteration_total_s": total, "time/overhead_total_s": total - compute - m["time/eval_s"],
             "time/overhead_total_share": (total - compute - m["time/eval_s"]) / max(total - m["time/eval_s"], 1e-9)}
    Tracker(settings(), config).log_metrics(mlflow_run, extra, k)
    progress = read_progress(run_id) or {}
    for h in progress.get("history", []):
        if h["iteration"] == k:
            h.update(extra)
    write_progress(run_id, progress)


def _summary(config: RunConfig, run_id: str, dataset: dict[str, Any], mlflow_run: str, progress: dict[str, Any],
             services: dict[str, Any], wall_s: float) -> dict[str, Any]:
    from rlpipe.tracking.plots import reward_curve

    history = progress.get("history", [])
    stage_keys = ["generate_s", "verify_s", "update_s", "sync_s", "eval_s", "save_s"]
    breakdown = {k: round(sum(h.get(f"time/{k}", 0.0) for h in history), 3) for k in stage_keys}
    # Totals as the parent flow saw them (the iteration flow run's own start/finish included).
    iter_total = sum(h.get("time/iteration_total_s", h.get("time/iteration_s", 0.0)) for h in history)
    breakdown["overhead_s"] = round(iter_total - sum(breakdown[k] for k in ("generate_s", "verify_s", "update_s", "eval_s")), 3)
    plot = reward_curve(history, run_dir(run_id) / "reward_curve.png",
                        f"{config.train.algorithm} on {config.task.name} ({run_id})", progress.get("base_accuracy"))
    from tasks.tracking import log_artifact

    log_artifact(config, mlflow_run, str(plot))
    return {
        "kind": "rl",
        "algorithm": config.train.algorithm,
        "config_fingerprint": config.fingerprint(),
        "dataset_version": dataset["version"],
        "iterations_done": progress.get("completed_iteration", -1) + 1,
        "heldout_accuracy_base": progress.get("base_accuracy"),
        "heldout_accuracy_final": progress.get("final_accuracy"),
        "heldout_n": progress.get("heldout_n"),
        "registered_model": {"name": config.registered_model, "version": progress.get("last_registered")},
        "final_policy_version": progress.get("weights_sha256"),
        "engine": services.get("engine"),
        "sandbox_level": services.get("sandbox_level"),
        "stage_seconds": breakdown,
        "iteration_seconds_mean": round(iter_total / max(len(history), 1), 3),
        "overhead_share": round(breakdown["overhead_s"] / max(iter_total - breakdown["eval_s"], 1e-9), 4),
        "reward_curve_png": str(plot),
        "mlflow_run_id": mlflow_run,
        "wall_s": round(wall_s, 2),
    }

