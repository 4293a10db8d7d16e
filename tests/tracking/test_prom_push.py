"""The Pushgateway exporter against a real ``prometheus-pushgateway``: an iteration's metrics come back from the
gateway's /metrics with their labels and values (NaN and infinities included), a push replaces the run's last
one without touching another run's, and a gateway that is down or hangs costs a warning and at most the
timeout, once per back-off window."""

from __future__ import annotations

import logging
import math
import socket
import time

import pytest

from rlpipe.config import settings
from rlpipe.net import free_port
from rlpipe.tracking.prom_push import ITERATION, JOB, LAST_PUSH, METRIC, MetricsPusher, metrics_pusher
from tests.helpers.pushgateway import needs_pushgateway, same, start_pushgateway


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    gw = start_pushgateway(tmp_path_factory.mktemp("pushgateway"))
    yield gw
    gw.stop()


ITERATION_3 = {
    "reward_mean": 0.625, "accuracy": 0.5, "time/generate_s": 1.25, "alerts/kl_rise": 1.0, "optimizer_steps": 2,
    "loss": float("nan"), "kl": float("inf"), "grad_norm": float("-inf"),
    "reward_by_task/rm+exact": 0.25,  # MLflow's key: rm_exact (the exporter labels with the same key)
    "sync/adapter_only": False, "note": "not a number",  # neither is logged to MLflow, neither is pushed
}


@needs_pushgateway
def test_an_iteration_comes_back_from_the_gateway_with_its_labels(gateway):
    before = time.time()
    assert MetricsPusher(gateway.url, "rl-a", "arith").push(3, ITERATION_3)
    got = gateway.samples(METRIC, job=JOB, run_id="rl-a", experiment="arith")
    expected = {"reward_mean": 0.625, "accuracy": 0.5, "time/generate_s": 1.25, "alerts/kl_rise": 1.0,
                "optimizer_steps": 2.0, "loss": math.nan, "kl": math.inf, "grad_norm": -math.inf,
                "reward_by_task/rm_exact": 0.25}
    assert set(got) == set(expected) and all(same(got[k], v) for k, v in expected.items()), got
    assert gateway.samples(ITERATION, job=JOB, run_id="rl-a") == {"": 3.0}
    assert before - 1 <= gateway.samples(LAST_PUSH, job=JOB, run_id="rl-a")[""] <= time.time() + 1
    assert list(gateway.samples("push_time_seconds", job=JOB, run_id="rl-a").values())[0] >= before - 1


@needs_pushgateway
def test_a_push_replaces_the_run_s_last_one_and_leaves_other_runs_alone(gateway):
    pusher = MetricsPusher(gateway.url, "rl-b", "arith")
    assert pusher.push(0, {"reward_mean": 0.1, "heldout_accuracy": 0.3})
    assert MetricsPusher(gateway.url, "rl-c", "other").push(7, {"reward_mean": 0.9})
    assert pusher.push(1, {"reward_mean": 0.2})
    assert gateway.samples(METRIC, run_id="rl-b") == {"reward_mean": 0.2}  # the eval-only key went with its push
    assert gateway.samples(ITERATION, run_id="rl-b") == {"": 1.0}
    assert gateway.samples(METRIC, run_id="rl-c", experiment="other") == {"reward_mean": 0.9}


def _hanging_listener() -> tuple[socket.socket, str]:
    """A TCP port that accepts connections (the kernel's backlog) and never answers: a hung gateway."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_a_hung_gateway_costs_the_timeout_once_then_the_run_skips_pushes(caplog):
    sock, url = _hanging_listener()
    try:
        pusher = MetricsPusher(url, "rl-d", "arith", timeout_s=0.5, backoff_s=30)
        with caplog.at_level(logging.WARNING, logger="rlpipe.tracking"):
            t = time.monotonic()
            assert pusher.push(0, {"reward_mean": 0.5}) is False
            took = time.monotonic() - t
            t = time.monotonic()
            assert pusher.push(1, {"reward_mean": 0.5}) is False  # inside the back-off: not tried
            skipped = time.monotonic() - t
    finally:
        sock.close()
    assert 0.4 <= took < 1.5 and skipped < 0.05, (took, skipped)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and url in warnings[0] and "iteration 0" in warnings[0] and "MLflow" in warnings[0]


def test_a_gateway_that_is_down_is_a_warning_and_tried_again_after_the_back_off(caplog):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    pusher = MetricsPusher(url, "rl-e", "arith", timeout_s=2, backoff_s=0.2)
    with caplog.at_level(logging.WARNING, logger="rlpipe.tracking"):
        t = time.monotonic()
        assert pusher.push(0, {"reward_mean": 0.5}) is False
        assert time.monotonic() - t < 1.0
        time.sleep(0.25)
        assert pusher.push(1, {"reward_mean": 0.5}) is False  # tried again: a second warning
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [("iteration 0" in w, "iteration 1" in w) for w in warnings] == [(True, False), (False, True)], warnings
    assert "RLPIPE_PUSHGATEWAY_URL" in warnings[0]


def test_the_gateway_is_a_setting_and_off_by_default():
    assert settings({"RLPIPE_HOME": "/tmp/x"}).pushgateway_url is None
    assert metrics_pusher(settings({"RLPIPE_HOME": "/tmp/x", "RLPIPE_PUSHGATEWAY_URL": ""}).pushgateway_url, "r", "e") is None
    url = settings({"RLPIPE_HOME": "/tmp/x", "RLPIPE_PUSHGATEWAY_URL": "http://pushgateway:9091"}).pushgateway_url
    assert metrics_pusher(url, "r", "e") == MetricsPusher("http://pushgateway:9091", "r", "e")
