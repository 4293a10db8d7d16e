"""Where things live inside the store: ``runs/<run_id>/iter=<k>/<stage>/`` and friends."""

from __future__ import annotations

import re

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_run_id(run_id: str) -> str:
    if not _RUN_ID.match(run_id):
        raise ValueError(
            f"run id {run_id!r} is not usable as a path: use letters, digits, '_', '-', '.' (at most 128)"
        )
    return run_id


def run_prefix(run_id: str) -> str:
    return f"runs/{check_run_id(run_id)}"


def stage_prefix(run_id: str, iteration: int, stage: str, draw: int = 0) -> str:
    """An iteration's stage; a dynamic-sampling draw after the first is a stage of its own (``rollout-draw1``)."""
    return f"{run_prefix(run_id)}/iter={iteration}/{stage}" + (f"-draw{draw}" if draw else "")


def checkpoint_prefix(run_id: str, tag: str) -> str:
    return f"{run_prefix(run_id)}/checkpoints/{tag}"


def dataset_prefix(name: str, version: str) -> str:
    return f"datasets/{name}/{version[:16]}"
