"""Each iteration's metrics, as logged to MLflow, pushed to a Prometheus Pushgateway for Grafana and alert rules.

MLflow stays the record of a run (every iteration, every key, kept with the run); Prometheus is a live view
of it (infra/grafana/dashboards/rlpipe-run.json). Grafana has no MLflow datasource in its core, and a run is a
batch job: the process that ran an iteration may be gone before Prometheus next scrapes, so it cannot serve
``/metrics`` itself. The standard answer for batch jobs is the Pushgateway: the run pushes, Prometheus
scrapes the gateway (``honor_labels: true``, so the run's ``job`` and ``run_id`` labels are kept).

What is pushed, once per iteration (``RLPIPE_PUSHGATEWAY_URL``; unset: nothing), under the grouping key
``job="rlpipe-run", run_id=<run id>``, replacing that run's previous push:

- ``rlpipe_run_metric{experiment, key}``: one gauge per numeric metric, ``key`` the MLflow key as MLflow
  stores it (``time/generate_s``, ``alerts/kl_rise``: keys hold ``/``, which a metric name cannot);
- ``rlpipe_run_iteration{experiment}``: the iteration those values belong to;
- ``rlpipe_run_last_push_timestamp_seconds{experiment}``: when (the gateway's own ``push_time_seconds``
  says the same, but only the Pushgateway has it).

Non-finite values (a NaN loss, an infinite KL) are pushed as they are, as MLflow logs them: they are valid
Prometheus samples, and replacing them would hide the very event (``alerts/loss_divergence``,
``nonfinite_steps``) a dashboard should show. Grafana draws NaN as a gap; the stat panels show it as NaN.

Prometheus sees the latest push at each scrape (15 s in the compose stack): an iteration shorter than that
may never be seen, and an eval-only key (``heldout_accuracy``) is present only until the next push. The
gateway keeps a finished run's last push until it is deleted (``DELETE /metrics/job/rlpipe-run/run_id/ID``)
or restarted. For every iteration of a run, and for comparing runs, open MLflow.

A push that fails (gateway down, refused, slow) is a warning, never an error of the run: it waits at most
``timeout_s`` (connect and read; a host name that cannot be resolved fails fast), and after a failure the
pusher skips pushes for ``backoff_s`` seconds, so a gateway that hangs costs a long run one timeout per
back-off window, not one per iteration.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from rlpipe.tracking.mlflow_utils import metric_key

JOB = "rlpipe-run"
METRIC = "rlpipe_run_metric"
ITERATION = "rlpipe_run_iteration"
LAST_PUSH = "rlpipe_run_last_push_timestamp_seconds"
EXPORTED = (METRIC, ITERATION, LAST_PUSH)  # the metric names a dashboard or rule may read (tests/infra)

log = logging.getLogger("rlpipe.tracking")


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """``metrics`` as MLflow logs them: numbers only (no bools), keys with MLflow's characters only."""
    return {metric_key(k): float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def iteration_registry(experiment: str, iteration: int, metrics: dict[str, Any], now: float | None = None) -> Any:
    """A registry holding one iteration's push (the module docstring lists its families)."""
    from prometheus_client import CollectorRegistry, Gauge

    registry = CollectorRegistry()
    gauge = Gauge(METRIC, "A run's metric at its latest iteration; key = the MLflow metric key",
                  ["experiment", "key"], registry=registry)
    for key, value in numeric_metrics(metrics).items():
        gauge.labels(experiment, key).set(value)
    Gauge(ITERATION, "The iteration of the run's latest push", ["experiment"], registry=registry).labels(
        experiment).set(iteration)
    Gauge(LAST_PUSH, "When the run last pushed its metrics (unix seconds)", ["experiment"], registry=registry).labels(
        experiment).set(time.time() if now is None else now)
    return registry


@dataclass
class MetricsPusher:
    """Pushes a run's iterations to the Pushgateway at ``url`` (http://host:9091); one per run, kept on the run's
    context so that its back-off outlives an iteration."""

    url: str
    run_id: str
    experiment: str
    timeout_s: float = 3.0
    backoff_s: float = 60.0
    _quiet_until: float = field(default=0.0, repr=False)

    def push(self, iteration: int, metrics: dict[str, Any], logger: Any = None) -> bool:
        """Push ``metrics`` as iteration ``iteration``'s, replacing the run's last push. False when it failed (a
        warning on ``logger``, the flow run's, else this module's) or was skipped after a recent failure; never
        raises."""
        from prometheus_client import push_to_gateway

        if time.monotonic() < self._quiet_until:
            return False
        try:
            push_to_gateway(self.url, job=JOB, grouping_key={"run_id": self.run_id},
                            registry=iteration_registry(self.experiment, iteration, metrics), timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - a view of the run must never fail it: URLError, timeouts, HTTP 4xx/5xx
            self._quiet_until = time.monotonic() + self.backoff_s
            (logger or log).warning(
                "run %s iteration %d: metrics not pushed to the Pushgateway %s (%s: %s); next try in %.0f s. They are "
                "in MLflow; check RLPIPE_PUSHGATEWAY_URL and that the gateway is up",
                self.run_id, iteration, self.url, type(e).__name__, e, self.backoff_s)
            return False
        return True


def metrics_pusher(url: str | None, run_id: str, experiment: str) -> MetricsPusher | None:
    """The run's pusher, or None when no gateway is set (``RLPIPE_PUSHGATEWAY_URL`` unset or empty)."""
    return MetricsPusher(url, run_id, experiment) if url else None

