"""The guards that stop a run, called as plain functions (no orchestrator)."""

import logging

import pytest

from rlpipe.guards import (
    NonFiniteUpdate, StaleBatchError, check_dynamic, check_nonfinite, check_staleness,
)


def test_nonfinite_steps_alert_below_the_limit_and_stop_the_run_at_it(caplog):
    log = logging.getLogger("test-guards")
    check_nonfinite(3, 4, {"optimizer_steps": 9.0}, log)  # none skipped: silent
    assert not caplog.records
    with caplog.at_level(logging.WARNING, "test-guards"):
        check_nonfinite(3, 4, {"nonfinite_steps": 2.0, "optimizer_steps": 8.0, "mismatch/abs_max": 0.5}, log)
    assert "ALERT iteration 4: 2/10 optimizer step(s) skipped" in caplog.text and "0.5" in caplog.text
    with pytest.raises(NonFiniteUpdate, match=r"iteration 4: 3/9 optimizer steps .*max_nonfinite_steps=3.*same --run-id"):
        check_nonfinite(3, 4, {"nonfinite_steps": 3.0, "optimizer_steps": 6.0}, log)


def test_staleness_must_lie_within_the_async_bound():
    check_staleness(0, 2, 0, "b")
    check_staleness(2, 2, 2, "b")
    for bound, staleness in ((0, 1), (1, 2), (1, -1)):
        with pytest.raises(StaleBatchError, match=f"{staleness} update\\(s\\) behind.*async_steps={bound}"):
            check_staleness(bound, 7, staleness, "rollout x")


def test_dynamic_sampling_short_of_the_batch_is_an_alert_not_a_stop(caplog):
    log = logging.getLogger("test-guards")
    assert check_dynamic(4, 1, {"dynamic/groups_kept": 4.0}, 2, log) is False
    with caplog.at_level(logging.WARNING, "test-guards"):
        assert check_dynamic(4, 1, {"dynamic/groups_kept": 3.0}, 3, log) is True
    assert "kept 3/4 groups after 3 draws" in caplog.text

