"""The long-lived services of a run inside this process: engine, trainer, verifier pool, prompts.

The train flow starts them once; the tasks of every iteration look them up by run id. What
passes between tasks stays small (URIs and summaries); the services hold the heavy state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rlpipe.threads import on_thread

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
    proof: Any = None  # the weight-sync proof: probe batch, tolerance, last result (rlpipe.rollout.probe.SyncProof)
    policy_iteration: int = -1  # the last update the engine's policy holds (-1: the run's start policy)
    reward_model: Any = None  # RLHF: a RewardModelSource (in-process or the service)
    prompts: dict[str, dict[str, Any]] = field(default_factory=dict)  # prompt id → prompt row
    # Work started ahead on the engine (rollout.prefetch): (iteration, concurrent.futures.Future), or None.
    background: tuple[int, Any] | None = None
    # A save point's state being written (train.async_save): (iteration, its folder, Future), or None.
    saving: tuple[int, str, Any] | None = None
    # A save point's state to write once the sync has proven the engine's weights: (iteration, folder, write), or None.
    deferred: tuple[int, str, Callable[[], None]] | None = None
    # A save point being uploaded to the store behind the run (train.async_save): (what the flow records once it
    # is whole, Future of the upload), or None. Recorded by a later iteration (:meth:`join_upload`).
    uploading: tuple[Any, Any] | None = None

    def save_in_background(self, iteration: int, folder: str, write: Callable[[], None]) -> None:
        """Write save point ``iteration``'s state on a thread (train.async_save); :meth:`join_save` waits for it.
        Nothing may change the trainer's weights or optimizer until then."""
        self.join_save()
        self.saving = (iteration, folder, on_thread(write, f"rlpipe-save-{iteration}"))

    def defer_save(self, iteration: int, folder: str, write: Callable[[], None]) -> None:
        """Save point ``iteration``'s state, taken (``plan_save``), written on a thread once :meth:`start_deferred_save`
        is called: after the weight sync's proof, so that the writing runs beside the evaluation and the next batch's
        generation, not beside the sync, and the update does not wait for the weights' hash."""
        self.join_save()
        self.deferred = (iteration, folder, write)

    def start_deferred_save(self) -> None:
        """Start writing the deferred save point's state on a thread (nothing to do without one)."""
        if self.deferred is not None:
            iteration, folder, write = self.deferred
            self.deferred = None
            self.save_in_background(iteration, folder, write)

    def join_save(self) -> float:
        """Wait for the save being written, if any (seconds waited); its error is raised here. A deferred one not
        started yet is started first: nothing may change the weights before it is written."""
        self.start_deferred_save()
        if self.saving is None:
            return 0.0
        iteration, folder, future = self.saving
        self.saving = None
        return _waited(future, f"writing save point {iteration} ({folder}) in the background")

    def upload_in_background(self, point: Any, work: Callable[[], Any]) -> None:
        """Upload a save point's state on a thread (``work``: it waits for the state to be written first);
        ``point``: what the flow records once the upload is whole (:meth:`join_upload`). One at a time."""
        if self.uploading is not None:
            raise RuntimeError("a save point is still being uploaded; record it (join_upload) first")
        self.uploading = (point, on_thread(work, "rlpipe-upload"))

    def join_upload(self) -> tuple[Any, Any] | None:
        """The save point uploaded in the background, once whole: (its point, the upload's result); None when
        there is none. Its error is raised here (the save point is not recorded: a resume starts before it)."""
        if self.uploading is None:
            return None
        point, future = self.uploading
        self.uploading = None
        _waited(future, f"uploading save point {getattr(point, 'iteration', '?')} in the background")
        return point, future.result()

    def generate_ahead(self, iteration: int, work: Callable[[], Any]) -> None:
        """Run ``work`` (iteration ``iteration``'s first batch) on a thread now; the rollout of that iteration
        joins it (:meth:`join_ahead`). One batch ahead at a time."""
        if self.background is not None:
            raise RuntimeError(f"iteration {self.background[0]}'s batch is still being generated ahead; join it first")
        self.background = (iteration, on_thread(work, f"rlpipe-prefetch-{iteration}"))

    def join_ahead(self, iteration: int, draw: int) -> float | None:
        """Wait for the batch generated ahead for this rollout (seconds waited), None when there is none. Its
        error is the rollout's (a retry generates the batch itself)."""
        if self.background is None or (self.background[0], draw) != (iteration, 0):
            return None
        _, future = self.background
        self.background = None
        return _waited(future, f"iteration {iteration}: generating its batch ahead (rollout.prefetch)")


def _waited(future: Future, what: str) -> float:
    """Seconds waited for ``future``; its error as a RuntimeError saying ``what`` failed."""
    start = time.perf_counter()
    try:
        future.result()
    except Exception as e:
        raise RuntimeError(f"{what} failed: {e}") from e
    return time.perf_counter() - start


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
    from rlpipe.runtime.context import forget_context

    forget_context(run_id)
    s = _SERVICES.pop(run_id, None)
    if s is None:
        return
    s.deferred = None  # a save point whose sync never came is no save point: not written
    if s.saving is not None:  # never leave a save half-written behind a stopped run (a failed one is not recorded)
        try:
            s.join_save()
        except RuntimeError as e:
            logging.getLogger("rlpipe").warning("run %s stopped; %s (a resume starts from the save point before)", run_id, e)
    if s.uploading is not None:  # never leave an upload going behind a stopped run (it was not recorded)
        try:
            s.join_upload()
        except RuntimeError as e:
            logging.getLogger("rlpipe").warning("run %s stopped; %s (a resume starts from the save point before)", run_id, e)
    if s.background is not None:  # the process keeps its engine for the next run: never leave it generating
        iteration, future = s.background
        if (err := future.exception()) is not None:
            logging.getLogger("rlpipe").warning("run %s stopped; the batch of iteration %d generated ahead failed "
                                                "(a resume generates it again): %s", run_id, iteration, err)
    if s.pool is not None:
        s.pool.close()
