"""The SFT flow: dataset → supervised warm-up → register as ``base`` → summary.json."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow, get_run_logger

from rlpipe.config import RunConfig, settings
from rlpipe.runs import write_summary
from tasks.data import prepare_dataset
from tasks.sft import train_sft_task
from flows._tracked import tracked_fit
from tasks.tracking import register_checkpoint, version_summary


@flow(name="sft", log_prints=True)
def sft(config: RunConfig = RunConfig(), run_id: str | None = None) -> str:
    """Train the policy's starting point; returns the path of the run's summary.json.

    Args:
        config: The run config; the sft section and the task's prompt set are used. Registers
            models:/rlpipe-<task.name>@base.
        run_id: Id of this run (its summary.json and MLflow run); empty: a new one.
    """
    start = time.perf_counter()
    run_id, dataset, result, version, mlflow_run = tracked_fit(
        config, run_id, "sft", lambda: prepare_dataset(config), lambda data, rid, run: train_sft_task(config, data, rid, run),
        lambda data, result, rid, run: register_checkpoint(
            config, rid, run, result, data["version"], iteration=0, aliases=("base", "latest"),
            accuracy=result["validation_accuracy_after"], test_accuracy=result["heldout_accuracy_after"]))
    path = write_summary(
        settings(),
        run_id,
        {
            "kind": "sft",
            "config_fingerprint": config.fingerprint(),
            "dataset_version": dataset["version"],
            "dataset_uri": dataset["uri"],
            "registered_model": version_summary(version),
            "checkpoint_uri": result["checkpoint_uri"],
            "weights_sha256": result["weights_sha256"],
            "model_parameters": result["parameters"],
            "sft_steps": result["steps"],
            "sft_train_s": round(result["train_wall_s"], 2),
            "heldout_accuracy_before": result["heldout_accuracy_before"],
            "heldout_accuracy_after": result["heldout_accuracy_after"],
            "heldout_n": result["heldout_n"],
            **({"mean_steps_after": result["mean_steps_after"], "tool_calls_per_episode_after": result["tool_calls_per_episode_after"]}
               if config.agent is not None else {}),
            "mlflow_run_id": mlflow_run,
            "wall_s": round(time.perf_counter() - start, 2),
        },
    )
    get_run_logger().info("summary: %s", path)
    return str(Path(path))
