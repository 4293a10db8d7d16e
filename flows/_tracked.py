"""A fit as the SFT and reward-model flows run it: checks, data, then an MLflow run around training and
registration."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlpipe.config import RunConfig
from rlpipe.runs import new_run_id
from tasks.preflight import preflight_task
from tasks.tracking import end_tracking, start_tracking

Result = dict[str, Any]


def tracked_fit(config: RunConfig, run_id: str | None, kind: str, prepare: Callable[[], Result],
                train: Callable[[Result, str, str], Result], register: Callable[[Result, Result, str, str], Result | None],
                ) -> tuple[str, Result, Result, Result | None, str]:
    """Preflight, ``prepare()`` the data, then ``train(data, run_id, mlflow_run)`` and ``register(data, result,
    run_id, mlflow_run)`` inside an MLflow run of ``kind``: marked FAILED if either raises, FINISHED after both.
    Returns (run id, data, result, registered version, MLflow run id)."""
    run_id = run_id or new_run_id(kind)
    preflight_task(config)  # fail fast, naming the component that is down
    data = prepare()
    mlflow_run = start_tracking(config, run_id, kind, data["version"])
    try:
        result = train(data, run_id, mlflow_run)
        version = register(data, result, run_id, mlflow_run)
    except BaseException:
        end_tracking(config, mlflow_run, "FAILED")
        raise
    end_tracking(config, mlflow_run)
    return run_id, data, result, version, mlflow_run
