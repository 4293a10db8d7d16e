"""Build or load, validate and store a prompt set under its content version."""

from __future__ import annotations

from typing import Any

from prefect import flow

from rlpipe.config import RunConfig
from tasks.data import prepare_dataset


@flow(name="prepare-data")
def prepare_data(config: RunConfig = RunConfig()) -> dict[str, Any]:
    """Build or load the config's prompt set, validate every row and store it under its content version.

    Args:
        config: The run config; task.dataset and the data section say which prompt set.
    """
    return prepare_dataset(config)
