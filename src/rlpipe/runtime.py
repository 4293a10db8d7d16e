"""The long-lived services of a run inside this process: engine, trainer, verifier pool, prompts.

The train flow starts them once; the tasks of every iteration look them up by run id. What
passes between tasks stays small (URIs and summaries); the services hold the heavy state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunServices", "register_services", "services", "stop_services"]


@dataclass
class RunServices:
    run_id: str
    engine: Any
    trainer: Any
    pool: Any
    tokenizer: Any
    train_rows: list[dict[str, Any]]
    test_rows: list[dict[str, Any]]
    ground_truth: dict[str, str | None]
    validation_rows: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)  # the weight-sync probe and its last result
    reward_model: Any = None  # RLHF: a RewardModelSource (in-process or the service)
    prompts: dict[str, dict[str, Any]] = field(default_factory=dict)  # prompt id → prompt row
    # Work started ahead on the engine (rollout.prefetch): (iteration, concurrent.futures.Future), or None.
    background: tuple[int, Any] | None = None


_SERVICES: dict[str, RunServices] = {}


def register_services(s: RunServices) -> None:
    _SERVICES[s.run_id] = s


def services(run_id: str) -> RunServices:
    try:
        return _SERVICES[run_id]
    except KeyError:
        raise RuntimeError(
            f"the services of run {run_id!r} are not running in this process; the train flow starts them "
            "(run `rlpipe run`, or the `train` deployment)"
        ) from None


def stop_services(run_id: str) -> None:
    s = _SERVICES.pop(run_id, None)
    if s is None:
        return
    if s.background is not None:  # the process keeps its engine for the next run: never leave it generating
        iteration, future = s.background
        if (err := future.exception()) is not None:
            logging.getLogger("rlpipe").warning("run %s stopped; the batch of iteration %d generated ahead failed "
                                                "(a resume generates it again): %s", run_id, iteration, err)
    if s.pool is not None:
        s.pool.close()
