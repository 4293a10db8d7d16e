"""The verifier service: ``rlpipe serve verifier`` — batch scoring over HTTP in front of a worker pool.

Endpoints:
  GET  /health   → {"status": "ok"|"degraded", "workers", "alive", "queue", "max_queue"}
  POST /verify   {"items": [{"verifier", "response", "ground_truth"}], "timeout_s"?} → {"results": [...]}
                 each result: {"reward", "status", "reason", "isolation"}
  GET  /stats    → requests, rejected (429), errors, timeouts, abandoned, dispatch_errors, items,
                   latency p50/p99 (s), queue length, worker restarts
  GET  /metrics  → the same numbers in the Prometheus text format (rlpipe_<service>_…: counters, gauges,
                   up, request-latency histograms)

Bounded everything: the pool has a fixed number of worker processes (each sample's hard deadline
is its verifier's declared budget plus ``grace_s``); requests wait in a bounded queue and are
refused with 429 when it is full (backpressure, not collapse).

Time: a request without ``timeout_s`` waits as long as the declared budgets of its own items and
of the requests queued before it can take (at least ``request_timeout_s``), so the service never
gives up on a verdict the verifiers would have given. A request whose ``timeout_s`` runs out gets
status ``timeout`` for each item, with a reason giving the time its batch declared; the batch is
then abandoned (the pool stops after the chunk it is on) and the dispatcher goes on with the next
request — a slow or abandoned request never stops the service. fastapi/uvicorn are imported only
when the app is built.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from rlpipe.rewards.base import VerifyResult
from rlpipe.rewards.pool import VerifierPool, VerifyItem
from rlpipe.services._common import Counters, QueueWorker, batch_answer, run_service, service_app, settle

MAX_ITEMS = 4096
CHUNK_PER_WORKER = 16  # items per worker scored between two checks for an abandoned request
_SLACK_S = 1.0  # worker replacement and transport on top of the declared budgets

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One request's batch: the future its handler waits on, and a flag set when the handler gives up."""

    items: list[VerifyItem]
    budget_s: float  # the longest the batch may legitimately take, from its verifiers' declared budgets
    waits_s: float  # budget_s plus that of the requests queued before it
    options: dict[str, dict[str, Any]] | None = None  # per verifier, for this request; None: the service's
    future: Future = field(default_factory=Future)
    abandoned: threading.Event = field(default_factory=threading.Event)

    def abandon(self) -> None:
        self.abandoned.set()
        self.future.cancel()  # succeeds only while it still waits in the queue


class VerifierService(QueueWorker):
    """A pool, a bounded request queue and one dispatcher thread feeding the pool."""

    def __init__(self, workers: int = 2, grace_s: float = 5.0, max_queue: int = 64,
                 request_timeout_s: float = 60.0, plugins: tuple[str, ...] = (),
                 options: dict[str, dict[str, Any]] | None = None):
        self.pool = VerifierPool(workers=workers, grace_s=grace_s, plugins=plugins, options=options)
        self.request_timeout_s = request_timeout_s
        self._backlog_s = 0.0  # declared budgets of the batches queued or being scored
        self._backlog_lock = threading.Lock()
        stats = Counters("requests", "rejected", "errors", "timeouts", "abandoned", "dispatch_errors", "items", window=2048)
        super().__init__(stats, max_queue, "verifier-dispatch")

    # -- the dispatcher: one thread, never ended by a request --------------------------------

    def _work(self, job: Job) -> None:
        try:
            self._run(job)
        except Exception as e:  # noqa: BLE001 - this thread must outlive every request
            self.stats.add(dispatch_errors=1)
            log.exception("verifier dispatcher: a batch of %d item(s) failed", len(job.items))
            settle(job.future, exception=e)
        finally:
            with self._backlog_lock:
                self._backlog_s -= job.budget_s

    def _run(self, job: Job) -> None:
        if not job.future.set_running_or_notify_cancel():  # its handler gave up while it was queued
            self.stats.add(abandoned=1)
            return
        results = self._score(job)
        settle(job.future, result=results)

    def _chunks(self, items: list[VerifyItem]) -> list[list[VerifyItem]]:
        step = self.pool.size * CHUNK_PER_WORKER
        return [items[i : i + step] for i in range(0, len(items), step)]

    def _score(self, job: Job) -> list[VerifyResult] | None:
        out: list[VerifyResult] = []
        for chunk in self._chunks(job.items):
            if job.abandoned.is_set():  # nobody will read the rest: free the pool for the next request
                self.stats.add(abandoned=1)
                return None
            out += self.pool.score(chunk, job.options)
        return out

    # -- requests ------------------------------------------------------------------------------

    def budget_s(self, items: list[VerifyItem], options: dict[str, dict[str, Any]] | None = None) -> float:
        """Longest the pool may take on ``items`` by their verifiers' declared budgets (+ grace).

        Per chunk, greedy assignment to ``size`` workers finishes within sum/size + the longest item."""
        total = 0.0
        for chunk in self._chunks(items):
            deadlines = [self.pool.deadline_s(i, options) for i in chunk]
            total += sum(deadlines) / self.pool.size + max(deadlines)
        return total + _SLACK_S

    def submit(self, items: list[VerifyItem], options: dict[str, dict[str, Any]] | None = None) -> Job:
        """Queue a batch; raises ``queue.Full`` (the caller answers 429), ValueError for unknown options."""
        self.pool.resolve_options(options)  # unknown options raise before anything is queued
        budget = self.budget_s(items, options) if items else 0.0
        with self._backlog_lock:
            job = Job(items, budget, waits_s=self._backlog_s + budget, options=options)
            self._queue.put_nowait(job)
            self._backlog_s += budget
        return job

    def health(self) -> dict[str, Any]:
        alive = self.pool.healthy() and self._thread.is_alive()
        return {"status": "ok" if alive else "degraded", "workers": self.pool.size, "alive": alive,
                "queue": self._queue.qsize(), "max_queue": self.max_queue}

    def metrics(self) -> dict[str, Any]:
        s = self.stats
        return (s.values("requests", "rejected", "errors", "timeouts", "abandoned", "dispatch_errors", "items")
                | s.percentiles() | {"error_rate": s.errors / max(s.requests, 1), "queue": self._queue.qsize(),
                                     "max_queue": self.max_queue, "worker_restarts": self.pool.restarts})

    def close(self) -> None:
        super().close()
        self.pool.close()


class Item(BaseModel):
    verifier: str = Field(description="Registered verifier name (math, exact, format, json, code, …).")
    response: str = Field(description="The model's full output.")
    ground_truth: str | None = Field(None, description="Reference answer, rule or tests (JSON), per verifier.")


class VerifyRequest(BaseModel):
    items: list[Item] = Field(max_length=MAX_ITEMS)
    timeout_s: float | None = Field(
        None, gt=0, le=3600,
        description="Answer within this many seconds; default: what the declared budgets of this batch and "
                    "the queue ahead of it need (at least the service's request timeout).")
    options: dict[str, dict[str, Any]] | None = Field(
        None, description="Verifier options for this request, by verifier name (e.g. {\"code\": {\"scoring\": "
                          "\"all\"}}); unknown options are refused with 422. Default: the service's own.")


def _as_dict(r: VerifyResult) -> dict[str, Any]:
    return {"reward": r.reward, "status": r.status, "reason": r.reason, "isolation": r.isolation}


def _answer(service: VerifierService, job: Job, timeout_s: float | None) -> list[dict[str, Any]]:
    """Wait for the batch; per-item ``timeout`` (with the declared time in the reason) when it runs out."""
    wait = timeout_s if timeout_s is not None else max(service.request_timeout_s, job.waits_s)
    try:
        return [_as_dict(r) for r in job.future.result(timeout=wait)]
    except TimeoutError:
        job.abandon()
        service.stats.add(timeouts=1)
        reason = (f"verifier service gave no answer within {wait:g} s; this batch declares up to "
                  f"{job.budget_s:.1f} s on {service.pool.size} workers and had {job.waits_s - job.budget_s:.1f} s "
                  f"of queued work before it: raise timeout_s or send smaller batches")
        return [{"reward": None, "status": "timeout", "reason": reason, "isolation": None}] * len(job.items)


def create_app(service: VerifierService):
    app = service_app("rlpipe verifier", "verifier", service)

    @app.post("/verify")
    def verify(req: VerifyRequest) -> dict[str, Any]:
        items = [VerifyItem(i.verifier, i.response, i.ground_truth) for i in req.items]
        # an option or verifier the service does not know: ValueError / KeyError from submit, so 422
        return batch_answer(service, len(req.items), lambda: service.submit(items, req.options),
                            lambda job: _answer(service, job, req.timeout_s))

    return app


def serve(host: str = "127.0.0.1", port: int = 8765, workers: int = 2, grace_s: float = 5.0,
          max_queue: int = 64, request_timeout_s: float = 60.0, plugins: tuple[str, ...] = (),
          options: dict[str, dict[str, Any]] | None = None) -> None:
    service = VerifierService(workers=workers, grace_s=grace_s, max_queue=max_queue,
                              request_timeout_s=request_timeout_s, plugins=plugins, options=options)
    run_service(create_app(service), service, host, port)  # the pool's size and the queue bound the work in flight
