"""What rlpipe's HTTP services share: counters with latency percentiles, handing a result to a
request that may have given up already, and the app skeleton (``/health``, ``/metrics``, the 429 of a full
queue, serving until stopped). fastapi and uvicorn are imported only when an app is built or served."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Any


class Counters:
    """Named integer counters and a window of request latencies, safe across threads."""

    def __init__(self, *names: str, window: int = 4096):
        self.lock = threading.Lock()
        self.latencies: deque = deque(maxlen=window)
        for n in names:
            setattr(self, n, 0)

    def add(self, **counts: int) -> None:
        with self.lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def latency(self, seconds: float) -> None:
        with self.lock:
            self.latencies.append(seconds)

    def percentile(self, q: float) -> float | None:
        with self.lock:
            xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def settle(fut: Future, result: Any = None, exception: BaseException | None = None) -> None:
    """Hand a batch's outcome to its request, unless that request already gave up on it."""
    try:
        if exception is not None:
            fut.set_exception(exception)
        else:
            fut.set_result(result)
    except InvalidStateError:  # cancelled or already settled: nobody waits for it
        pass


def service_app(title: str, service: Any):
    """A FastAPI app with the ``/health`` and ``/metrics`` every rlpipe service answers (from
    ``service.health()`` and ``service.metrics()``); the caller adds its work endpoint."""
    from fastapi import FastAPI

    app = FastAPI(title=title, version="1")
    app.get("/health")(service.health)
    app.get("/metrics")(service.metrics)
    return app


def queue_full(service: Any):
    """The 429 answer for a request the bounded queue has no room for (counted as ``rejected``)."""
    from fastapi import HTTPException

    service.stats.add(rejected=1)
    return HTTPException(status_code=429, detail=f"queue full ({service.max_queue} requests); retry later",
                         headers={"Retry-After": "1"})


def run_service(app: Any, service: Any, host: str, port: int) -> None:
    """Serve ``app`` until stopped, then close ``service``. Request handlers are sync, so uvicorn runs
    them in its thread pool; the service's bounded queue is what limits the work in flight."""
    import uvicorn

    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_keep_alive=30)
    finally:
        service.close()
