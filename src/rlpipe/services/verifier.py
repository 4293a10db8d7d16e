"""The verifier service: ``rlpipe serve verifier`` — batch scoring over HTTP in front of a worker pool.

Endpoints:
  GET  /health   → {"status": "ok"|"degraded", "workers", "alive", "queue", "max_queue"}
  POST /verify   {"items": [{"verifier", "response", "ground_truth"}], "timeout_s"?} → {"results": [...]}
  GET  /metrics  → requests, rejected (429), errors, items, latency p50/p99 (s), queue length

Bounded everything: the pool has a fixed number of worker processes (each sample has a hard
timeout there); requests wait in a bounded queue and are refused with 429 when it is full
(backpressure, not collapse); a request that is not answered within its timeout gets status
``timeout`` for each of its items. fastapi/uvicorn are imported only when the app is built.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from rlpipe.rewards.pool import VerifierPool, VerifyItem

MAX_ITEMS = 4096


@dataclass
class _Stats:
    requests: int = 0
    rejected: int = 0
    errors: int = 0
    timeouts: int = 0
    items: int = 0
    latencies: deque = field(default_factory=lambda: deque(maxlen=2048))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def percentile(self, q: float) -> float | None:
        with self.lock:
            xs = sorted(self.latencies)
        if not xs:
            return None
        return xs[min(len(xs) - 1, int(q * len(xs)))]


class VerifierService:
    """A pool, a bounded request queue and one dispatcher thread feeding the pool."""

    def __init__(self, workers: int = 2, sample_timeout_s: float = 5.0, max_queue: int = 64,
                 request_timeout_s: float = 60.0, plugins: tuple[str, ...] = ()):
        self.pool = VerifierPool(workers=workers, timeout_s=sample_timeout_s, plugins=plugins)
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        self._queue: queue.Queue[tuple[list[VerifyItem], Future] | None] = queue.Queue(maxsize=max_queue)
        self.stats = _Stats()
        self._thread = threading.Thread(target=self._dispatch, name="verifier-dispatch", daemon=True)
        self._thread.start()

    def _dispatch(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            items, fut = job
            if fut.cancelled():
                continue
            try:
                fut.set_result(self.pool.score(items))
            except Exception as e:  # noqa: BLE001 - reported to the waiting request
                fut.set_exception(e)

    def submit(self, items: list[VerifyItem]) -> Future:
        fut: Future = Future()
        self._queue.put_nowait((items, fut))  # raises queue.Full: the caller answers 429
        return fut

    def health(self) -> dict[str, Any]:
        alive = self.pool.healthy() and self._thread.is_alive()
        return {"status": "ok" if alive else "degraded", "workers": self.pool.size, "alive": alive,
                "queue": self._queue.qsize(), "max_queue": self.max_queue}

    def metrics(self) -> dict[str, Any]:
        s = self.stats
        return {"requests": s.requests, "rejected": s.rejected, "errors": s.errors, "timeouts": s.timeouts,
                "items": s.items, "latency_p50_s": s.percentile(0.5), "latency_p99_s": s.percentile(0.99),
                "error_rate": s.errors / max(s.requests, 1), "queue": self._queue.qsize(),
                "worker_restarts": self.pool.restarts}

    def close(self) -> None:
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self.pool.close()


class Item(BaseModel):
    verifier: str = Field(description="Registered verifier name (math, exact, format, json, code, …).")
    response: str = Field(description="The model's full output.")
    ground_truth: str | None = Field(None, description="Reference answer, rule or tests (JSON), per verifier.")


class VerifyRequest(BaseModel):
    items: list[Item] = Field(max_length=MAX_ITEMS)
    timeout_s: float | None = Field(None, gt=0, le=3600, description="Answer within this many seconds.")


def create_app(service: VerifierService):
    from fastapi import FastAPI, HTTPException

    app = FastAPI(title="rlpipe verifier", version="1")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return service.health()

    @app.get("/metrics")
    def metrics() -> dict[str, Any]:
        return service.metrics()

    @app.post("/verify")
    def verify(req: VerifyRequest) -> dict[str, Any]:
        start = time.perf_counter()
        st = service.stats
        with st.lock:
            st.requests += 1
            st.items += len(req.items)
        items = [VerifyItem(i.verifier, i.response, i.ground_truth) for i in req.items]
        try:
            fut = service.submit(items)
        except queue.Full:
            with st.lock:
                st.rejected += 1
            raise HTTPException(status_code=429, detail=f"queue full ({service.max_queue} requests); retry later",
                                headers={"Retry-After": "1"}) from None
        timeout = req.timeout_s or service.request_timeout_s
        try:
            results = fut.result(timeout=timeout)
            out = [{"reward": r.reward, "status": r.status, "reason": r.reason} for r in results]
        except TimeoutError:
            fut.cancel()
            with st.lock:
                st.timeouts += 1
            out = [{"reward": None, "status": "timeout", "reason": f"service did not answer within {timeout:g} s"}] * len(items)
        except Exception as e:  # noqa: BLE001
            with st.lock:
                st.errors += 1
            raise HTTPException(status_code=500, detail=f"{type(e).__name__}: {e}") from None
        with st.lock:
            st.latencies.append(time.perf_counter() - start)
        return {"results": out}

    return app


def serve(host: str = "127.0.0.1", port: int = 8765, workers: int = 2, sample_timeout_s: float = 5.0,
          max_queue: int = 64, plugins: tuple[str, ...] = ()) -> None:
    import uvicorn

    service = VerifierService(workers=workers, sample_timeout_s=sample_timeout_s, max_queue=max_queue, plugins=plugins)
    try:
        # Request handlers are sync, so uvicorn runs them in its thread pool; the pool's size and the
        # bounded queue are what limit the work in flight.
        uvicorn.run(create_app(service), host=host, port=port, log_level="warning", timeout_keep_alive=30)
    finally:
        service.close()
