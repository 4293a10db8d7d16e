"""An iteration's stages (rollout, verify, update, sync-weights, upload-checkpoint): retries and timeouts of
their own, and a Prefect task run each only where ``tracking.stage_task_runs`` asks for one.

A task run has a cost of its own (benchmarks/README.md): its events are stored by the Prefect server, on the
same cores at the demo's size. A stage keeps the retries, timeout and retry condition it had as a task
either way; with task runs on, each attempt is a task run of its own (a failed attempt shows as Failed, the
next one beside it).
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from prefect.utilities.timeout import timeout

from rlpipe.config import RunConfig
from tasks._log import run_logger

_AHEAD = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rlpipe-stage")


class StageTimeout(TimeoutError):
    """A stage ran past its time limit."""


class Stage:
    """``fn`` as a stage of an iteration; ``fn`` itself stays callable as ``.fn`` (tests, other flows)."""

    def __init__(self, fn: Callable[..., Any], name: str, retries: int = 0, retry_delay_s: float = 0.0,
                 timeout_s: float | None = None, retry_if: Callable[[BaseException], bool] | None = None):
        self.fn, self.name, self.retries, self.retry_delay_s = fn, name, retries, retry_delay_s
        self.timeout_s, self.retry_if = timeout_s, retry_if
        self.__doc__, self.__name__, self.__wrapped__ = fn.__doc__, fn.__name__, fn
        self._task: Any = None

    def __call__(self, config: RunConfig, *args: Any, **kwargs: Any) -> Any:
        call = self._as_task() if _task_runs(config) else self.fn
        for attempt in range(1, self.retries + 2):
            try:
                with timeout(self.timeout_s, StageTimeout):
                    return call(config, *args, **kwargs)
            except Exception as e:
                if attempt > self.retries or (self.retry_if is not None and not self.retry_if(e)):
                    raise
                run_logger().warning("stage %s failed (attempt %d of %d): %s: %s; again in %g s", self.name, attempt,
                                     self.retries + 1, type(e).__name__, e, self.retry_delay_s)
                time.sleep(self.retry_delay_s)
        raise AssertionError("unreachable")

    def submit(self, config: RunConfig, *args: Any, **kwargs: Any) -> Future:
        """The stage on a thread, in the caller's context (its flow run: logs and task runs land there)."""
        ctx = contextvars.copy_context()
        return _AHEAD.submit(ctx.run, self, config, *args, **kwargs)

    def _as_task(self) -> Any:
        if self._task is None:
            from prefect import task
            from prefect.cache_policies import NO_CACHE

            self._task = task(self.fn, name=self.name, cache_policy=NO_CACHE)
        return self._task


def stage(name: str, retries: int = 0, retry_delay_s: float = 0.0, timeout_s: float | None = None,
          retry_if: Callable[[BaseException], bool] | None = None) -> Callable[[Callable[..., Any]], Stage]:
    """Decorator: ``@stage("rollout", retries=1, retry_delay_s=1, timeout_s=3600)``."""
    return lambda fn: Stage(fn, name, retries, retry_delay_s, timeout_s, retry_if)


def _task_runs(config: Any) -> bool:
    return isinstance(config, RunConfig) and config.tracking.stage_task_runs
