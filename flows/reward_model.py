"""The reward-model flow (``rm-train``): preference pairs → Bradley–Terry fit → registered as ``<task>-rm``."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow

from rlpipe.config import RunConfig, settings
from rlpipe.runs import write_summary
from tasks._log import run_logger
from tasks.reward_model import prepare_preferences, train_reward_model
from flows._tracked import tracked_fit
from tasks.tracking import register_checkpoint, version_summary


@flow(name="rm-train", flow_run_name="{run_id}")
def rm_train(config: RunConfig = RunConfig(), run_id: str = "") -> str:
    """Train a reward model on preference pairs; ``best`` follows validation pair accuracy, ``latest`` the
    newest. Returns the path of the run's summary.json.

    Args:
        config: The run config; the rm section (base model, preference data, loss, steps) is used.
        run_id: Id of this run (its summary.json and MLflow run); empty: a new one.
    """
    start = time.perf_counter()
    run_id, data, result, version, mlflow_run = tracked_fit(
        config, run_id, "rm", lambda: prepare_preferences(config),
        lambda data, rid, run: train_reward_model(config, data, rid, run),
        lambda data, result, rid, run: _register(config, rid, run, result, data["version"]))
    stats = result["reward_stats"]
    path = write_summary(settings(), run_id, {
        "kind": "rm", "config_fingerprint": config.fingerprint(), "preference_version": data["version"],
        "preference_uri": data["uri"], "pairs": {k: data[f"{k}_pairs"] for k in ("train", "validation", "test")},
        "registered_model": version_summary(version),
        "checkpoint_uri": result["checkpoint_uri"], "weights_sha256": result["weights_sha256"],
        "base_model": result["base_model"], "rm_steps": result["steps"], "rm_best_step": result["best_step"],
        "rm_train_s": round(result["train_wall_s"], 2), "rm_validation_pair_accuracy": result["validation_pair_accuracy"],
        "rm_pair_accuracy": result["test_pair_accuracy"], "rm_test_pairs": result["test_pairs"],
        "reward_stats": stats, "mlflow_run_id": mlflow_run, "wall_s": round(time.perf_counter() - start, 2),
    })
    run_logger().info("summary: %s", path)
    return str(Path(path))


def _register(config: RunConfig, run_id: str, mlflow_run: str, result: dict, data_version: str) -> dict | None:
    """The fitted reward model as a version of ``<task>-rm``: ``latest`` moves, ``best`` follows validation pair
    accuracy; its reward statistics are tags (the RL run's normaliser starts from them)."""
    stats = result["reward_stats"]
    return register_checkpoint(
        config, run_id, mlflow_run, result, data_version, iteration=0, aliases=("latest",),
        accuracy=result["validation_pair_accuracy"], test_accuracy=result["test_pair_accuracy"],
        model_name=config.registered_reward_model,
        extra_tags={"base_model": result["base_model"], "kind": "reward_model", "reward_mean": f"{stats['mean']:.6f}",
                    "reward_std": f"{stats['std']:.6f}", "reward_count": str(int(stats["count"]))},
        promote_best=True,
    )
