"""What rlpipe's HTTP services share: counters with latency percentiles and histograms, a bounded queue
worked through by one thread, handing a result to a request that may have given up already, and the app
skeleton (``/health``; ``/metrics`` in the
Prometheus text format and ``/stats``, the same numbers as one JSON object; the 429 of a full queue;
serving until stopped). fastapi, uvicorn and prometheus_client are imported only when an app is built."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any


# Latency histogram buckets (seconds): a 1 ms verdict to a 2-minute batch.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Snapshot keys that only ever grow: Prometheus counters (``…_total``); every other number is a gauge.
COUNTER_KEYS = frozenset({"requests", "rejected", "errors", "timeouts", "abandoned", "dispatch_errors", "items",
                          "failures", "resets", "steps", "batches", "worker_restarts", "tokens", "weight_loads",
                          "unauthorized"})


class Counters:
    """Named integer counters, a window of latencies (for percentiles) and a cumulative latency histogram
    (for Prometheus), safe across threads."""

    def __init__(self, *names: str, window: int = 4096):
        self.lock = threading.Lock()
        self.latencies: deque = deque(maxlen=window)
        self.bucket_counts = [0] * len(BUCKETS)
        self.latency_sum, self.latency_count = 0.0, 0
        for n in names:
            setattr(self, n, 0)

    def add(self, **counts: int) -> None:
        with self.lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def latency(self, seconds: float) -> None:
        with self.lock:
            self.latencies.append(seconds)
            self.latency_sum += seconds
            self.latency_count += 1
            for i, bound in enumerate(BUCKETS):
                if seconds <= bound:
                    self.bucket_counts[i] += 1

    def histogram(self) -> tuple[list[tuple[str, int]], float, int]:
        """Cumulative ``(upper bound, count)`` pairs ending with ``+Inf``, the sum and the count."""
        with self.lock:
            pairs = [(repr(b), c) for b, c in zip(BUCKETS, self.bucket_counts)]
            return pairs + [("+Inf", self.latency_count)], self.latency_sum, self.latency_count

    def percentile(self, q: float) -> float | None:
        with self.lock:
            xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None

    def values(self, *names: str) -> dict[str, int]:
        """The named counters, in the order given (a service's ``/stats`` lists them so)."""
        return {n: getattr(self, n) for n in names}

    def percentiles(self, prefix: str = "latency") -> dict[str, float | None]:
        """``<prefix>_p50_s`` and ``<prefix>_p99_s`` of the latency window (None before the first)."""
        return {f"{prefix}_p50_s": self.percentile(0.5), f"{prefix}_p99_s": self.percentile(0.99)}


class QueueWorker:
    """A bounded queue of jobs and one daemon thread that works through them until :meth:`close`: the
    verifier's dispatcher and the reward model's scorer. A subclass sets what :meth:`_work` needs before it
    calls ``__init__``, which starts the thread; ``_work`` must not raise (the thread serves every job)."""

    def __init__(self, stats: Counters, max_queue: int, thread_name: str):
        self.stats, self.max_queue = stats, max_queue
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._serve, name=thread_name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:  # None: close() was called
            self._work(job)

    def _work(self, job: Any) -> None:
        raise NotImplementedError

    def histograms(self) -> dict[str, Counters]:
        return {"request_seconds": self.stats}

    def close(self) -> None:
        """End the thread once the jobs queued before are done; with the queue full, the daemon thread ends
        with the process instead."""
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass


def settle(fut: Future, result: Any = None, exception: BaseException | None = None) -> None:
    """Hand a batch's outcome to its request, unless that request already gave up on it."""
    try:
        if exception is not None:
            fut.set_exception(exception)
        else:
            fut.set_result(result)
    except InvalidStateError:  # cancelled or already settled: nobody waits for it
        pass


class _ServiceCollector:
    """A service's numbers for Prometheus, read at scrape time: its ``metrics()`` snapshot (counters and
    gauges), ``up`` from its ``health()``, and a histogram per ``histograms()`` entry."""

    def __init__(self, name: str, service: Any):
        self.name, self.service = name, service

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        prefix = f"rlpipe_{self.name}"
        yield GaugeMetricFamily(f"{prefix}_up", "1 when /health says ok, else 0",
                                value=float(self.service.health().get("status") == "ok"))
        for key, value in self.service.metrics().items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or key.endswith(("_p50_s", "_p99_s")):
                continue  # latency percentiles: the histograms carry them
            family = CounterMetricFamily if key in COUNTER_KEYS else GaugeMetricFamily
            yield family(f"{prefix}_{key}", f"{self.name} service: {key.replace('_', ' ')}", value=float(value))
        for hist, counters in self.service.histograms().items():
            buckets, total, _ = counters.histogram()
            yield HistogramMetricFamily(f"{prefix}_{hist}", f"{self.name} service: {hist.replace('_', ' ')}",
                                        buckets=buckets, sum_value=total)


def service_app(title: str, name: str, service: Any, token: str | None = None):
    """A FastAPI app with the ``/health``, ``/metrics`` (Prometheus text) and ``/stats`` (JSON) every rlpipe
    service answers, from ``service.health()``, ``service.metrics()`` and ``service.histograms()``; the
    caller adds its work endpoint. ``name`` prefixes the Prometheus names: ``rlpipe_<name>_…``. With a
    ``token`` (default: ``RLPIPE_<NAME>_TOKEN`` or its ``_FILE``) every endpoint but ``/health`` requires
    ``Authorization: Bearer <token>`` (else 401)."""
    from fastapi import FastAPI, Response
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    from rlpipe.http_client import service_token

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ServiceCollector(name, service))
    app = FastAPI(title=title, version="1")
    token = token if token is not None else service_token(name)
    app.state.rlpipe_service, app.state.rlpipe_token = name, token
    if token:
        _require_token(app, name, token, getattr(service, "stats", None))
    app.get("/health")(service.health)
    app.get("/stats")(service.metrics)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _require_token(app: Any, name: str, token: str, stats: Any) -> None:
    import hmac

    from fastapi.responses import JSONResponse

    want = f"Bearer {token}".encode()

    @app.middleware("http")
    async def bearer(request: Any, call_next: Any) -> Any:
        if request.url.path != "/health":
            got = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(got, want):
                if stats is not None and hasattr(stats, "unauthorized"):
                    stats.add(unauthorized=1)
                return JSONResponse({"detail": f"the {name} service needs 'Authorization: Bearer <token>' "
                                     f"(RLPIPE_{name.upper()}_TOKEN); this request's is missing or wrong"},
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)


def check_listen(name: str, host: str, token: str | None) -> None:
    """Refuse to listen beyond loopback without a credential: anyone who reaches the port could use it."""
    import ipaddress

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not token:
        raise ValueError(f"the {name} service would listen on {host} with no credential: set RLPIPE_{name.upper()}_TOKEN "
                         f"(or RLPIPE_{name.upper()}_TOKEN_FILE), or listen on 127.0.0.1")


def queue_full(service: Any):
    """The 429 answer for a request the bounded queue has no room for (counted as ``rejected``)."""
    from fastapi import HTTPException

    service.stats.add(rejected=1)
    return HTTPException(status_code=429, detail=f"queue full ({service.max_queue} requests); retry later",
                         headers={"Retry-After": "1"})


def batch_answer(service: Any, n_items: int, submit: Callable[[], Any], answer: Callable[[Any], list],
                 count_errors: bool = True) -> dict[str, Any]:
    """One batch-scoring request (the verifier's ``/verify``, the reward model's ``/score``), counted and
    timed: ``submit()`` queues the batch — a full queue is 429, an item or option the service cannot take
    (ValueError, KeyError) 422 — and ``answer(job)`` waits for its results; a failure there is 500, counted
    as an error unless ``count_errors`` is False (a service whose worker counted it already)."""
    from fastapi import HTTPException

    start = time.perf_counter()
    service.stats.add(requests=1, items=n_items)
    try:
        job = submit()
    except (ValueError, KeyError) as e:
        raise HTTPException(status_code=422, detail=str(e).strip("'\"")) from None  # KeyError's str() quotes it
    except queue.Full:
        raise queue_full(service) from None
    try:
        out = answer(job)
    except Exception as e:  # noqa: BLE001 - the worker failed on this batch; the service goes on
        if count_errors:
            service.stats.add(errors=1)
        raise HTTPException(status_code=500, detail=f"{type(e).__name__}: {e}") from None
    service.stats.latency(time.perf_counter() - start)
    return {"results": out}


def run_service(app: Any, service: Any, host: str, port: int) -> None:
    """Serve ``app`` until stopped, then close ``service``. Request handlers are sync, so uvicorn runs
    them in its thread pool; the service's bounded queue is what limits the work in flight."""
    import uvicorn

    try:
        check_listen(app.state.rlpipe_service, host, app.state.rlpipe_token)
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_keep_alive=30)
    finally:
        service.close()
