"""An iteration's stages: retries, retry conditions, timeouts, and a task run only where the config asks."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from rlpipe.config import RunConfig
from tasks.stage import Stage, StageTimeout, stage


def _config(task_runs: bool) -> RunConfig:
    return RunConfig.model_validate({"tracking": {"stage_task_runs": task_runs}})


def _flaky(failures: int, exc: type[Exception] = OSError):
    calls = []

    def fn(config, x):
        calls.append(x)
        if len(calls) <= failures:
            raise exc(f"failure {len(calls)}")
        return x * 2

    return fn, calls


def test_a_failed_attempt_is_retried_after_its_delay_and_logged(monkeypatch):
    fn, calls = _flaky(1)
    s = Stage(fn, "sync-weights", retries=2, retry_delay_s=0.2)
    lines = []
    monkeypatch.setattr(logging.getLogger("rlpipe"), "warning", lambda msg, *a: lines.append(msg % a))
    start = time.perf_counter()
    assert s(_config(False), 21) == 42
    assert calls == [21, 21] and time.perf_counter() - start >= 0.2
    assert lines == ["stage sync-weights failed (attempt 1 of 3): OSError: failure 1; again in 0.2 s"]


def test_the_last_attempts_error_is_raised_once_retries_are_spent():
    fn, calls = _flaky(5)
    with pytest.raises(OSError, match="failure 3"):
        Stage(fn, "rollout", retries=2)(_config(False), 1)
    assert len(calls) == 3


def test_a_stage_without_retries_runs_once():
    fn, calls = _flaky(1)
    with pytest.raises(OSError, match="failure 1"):
        Stage(fn, "update")(_config(False), 1)
    assert calls == [1]


def test_an_error_the_condition_refuses_is_not_retried():
    class Guard(RuntimeError):
        pass

    fn, calls = _flaky(1, Guard)
    with pytest.raises(Guard):
        Stage(fn, "verify", retries=1, retry_if=lambda e: not isinstance(e, Guard))(_config(False), 1)
    assert calls == [1]
    fn, calls = _flaky(1, OSError)  # the same condition lets another error through to its retry
    assert Stage(fn, "verify", retries=1, retry_if=lambda e: not isinstance(e, Guard))(_config(False), 3) == 6


def test_a_stage_past_its_time_limit_stops_with_a_timeout_then_retries():
    slow = []

    def fn(config):
        slow.append(1)
        if len(slow) == 1:
            time.sleep(5)
        return "done"

    start = time.perf_counter()
    assert Stage(fn, "rollout", retries=1, timeout_s=0.3)(_config(False)) == "done"
    assert len(slow) == 2 and time.perf_counter() - start < 3
    with pytest.raises(StageTimeout):
        Stage(lambda config: time.sleep(5), "rollout", timeout_s=0.3)(_config(False))


def test_a_submitted_stage_runs_on_another_thread_with_its_timeout():
    names = []
    s = Stage(lambda config, x: names.append(threading.current_thread().name) or x + 1, "rollout")
    assert s.submit(_config(False), 1).result(timeout=10) == 2
    assert names and names[0] != threading.current_thread().name

    def steps(config):  # off the main thread a timeout lands between Python lines, not inside one C call
        for _ in range(100):
            time.sleep(0.05)

    slow = Stage(steps, "rollout", timeout_s=0.3).submit(_config(False))
    with pytest.raises(StageTimeout):
        slow.result(timeout=4)


def test_the_decorator_keeps_the_function_callable_as_fn():
    @stage("upload-checkpoint", retries=2, retry_delay_s=2, timeout_s=600)
    def upload(config, k):
        """Doc."""
        return k

    assert isinstance(upload, Stage) and upload.fn(None, 7) == 7 and upload.__doc__ == "Doc."
    assert (upload.name, upload.retries, upload.retry_delay_s, upload.timeout_s) == ("upload-checkpoint", 2, 2, 600)


def test_a_task_run_per_attempt_only_where_the_config_asks(prefect_harness):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.context import TaskRunContext

    seen = []

    def fn(config, x):
        ctx = TaskRunContext.get()
        seen.append(ctx.task_run.name if ctx else None)
        if len(seen) == 1:
            raise OSError("first attempt")
        return x

    s = Stage(fn, "sync-weights", retries=1)

    @flow(name="stage-test")
    def body(task_runs: bool) -> str:
        from prefect.runtime import flow_run

        s(_config(task_runs), 1)
        return flow_run.id

    with_runs = body(True)
    assert len(seen) == 2 and all(name and name.startswith("sync-weights") for name in seen), seen
    seen.clear()
    without = body(False)
    assert seen == [None, None]

    def task_runs(flow_run_id: str, expect: int) -> list:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        deadline = time.time() + 30  # task runs reach the server as events
        with get_client(sync_client=True) as client:
            while True:
                runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
                if len(runs) >= expect or time.time() > deadline:
                    return runs
                time.sleep(0.5)

    states = sorted(r.state_type.value for r in task_runs(with_runs, 2))
    assert states == ["COMPLETED", "FAILED"], states
    assert task_runs(without, 0) == []  # the run with task runs ended later, and its two have arrived
