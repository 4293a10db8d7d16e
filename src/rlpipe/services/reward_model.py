"""The reward-model service: ``rlpipe serve reward-model MODEL_URI`` — batch scoring over HTTP.

Endpoints:
  GET  /health   → {"status": "ok"|"degraded", "version", "reward_stats", "queue", "max_queue"}
  POST /score    {"items": [{"prompt", "response", "chat"?} | {"input_ids": [...]}], "timeout_s"?}
                 → {"results": [{"score", "status", "reason", "rm_version"}]}
  GET  /stats    → requests, rejected (429), errors, timeouts, items, batches, mean batch size,
                   latency p50/p99 (s), queue length
  GET  /metrics  → the same numbers in the Prometheus text format (rlpipe_<service>_…: counters, gauges,
                   up, request-latency histograms)

Requests wait in a bounded queue (429 when full). One scorer thread takes every request waiting
(up to ``max_batch_items`` items) and scores them as one forward batch: concurrent requests are
micro-batched. A request that runs past its timeout gets status ``timeout`` per item and is
dropped if still queued; an item the model cannot read (token ids outside the vocabulary, too
long) gets ``error`` with the reason while the rest of its batch is scored. fastapi/uvicorn are
imported only when the app is built.
"""

from __future__ import annotations

import logging
import queue
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from rlpipe.services._common import Counters, QueueWorker, batch_answer, run_service, service_app, settle

log = logging.getLogger(__name__)

MAX_ITEMS = 4096


@dataclass
class _Job:
    seqs: list[list[int] | str]  # token ids, or the reason the item cannot be scored
    future: Future = field(default_factory=Future)


class RewardModelService(QueueWorker):
    """A scorer, a bounded queue of requests and one thread that scores them in micro-batches."""

    def __init__(self, scorer: Any, max_queue: int = 64, max_batch_items: int = 512, request_timeout_s: float = 30.0):
        self.scorer, self.max_batch_items = scorer, max_batch_items
        self.request_timeout_s = request_timeout_s
        self.vocab = len(scorer.tokenizer)
        self.max_len = int(getattr(scorer.model.config, "max_position_embeddings", 4096))
        stats = Counters("requests", "rejected", "errors", "timeouts", "items", "batches", "batched_items", window=4096)
        super().__init__(stats, max_queue, "rm-scorer")

    def _work(self, first: _Job) -> None:
        jobs, n = [first], len(first.seqs)
        while n < self.max_batch_items:  # take what else is waiting: one forward batch for all
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self._queue.put(None)  # close() was called: end once this batch is scored
                break
            jobs.append(nxt)
            n += len(nxt.seqs)
        self._score(jobs)

    def _score(self, jobs: list[_Job]) -> None:
        live = [j for j in jobs if j.future.set_running_or_notify_cancel()]  # drop those whose caller gave up
        seqs = [s for j in live for s in j.seqs if not isinstance(s, str)]
        try:
            xs = iter(self.scorer.score_ids(seqs) if seqs else [])
            self.stats.add(batches=1, batched_items=len(seqs))
            for j in live:
                settle(j.future, result=[s if isinstance(s, str) else next(xs) for s in j.seqs])
        except Exception as e:  # noqa: BLE001 - this thread must outlive every batch
            self.stats.add(errors=1)
            log.exception("reward-model scorer: a batch of %d sequence(s) failed", len(seqs))
            for j in live:
                settle(j.future, exception=e)

    def encode(self, item: "Item") -> list[int] | str:
        """Token ids to score, or why the item cannot be scored."""
        if item.input_ids is not None:
            ids = item.input_ids
            bad = [t for t in ids if not 0 <= t < self.vocab]
            if not ids or bad:
                return f"input_ids must be non-empty token ids in [0, {self.vocab}); got {bad[:3] or 'none'}"
        else:
            try:
                ids = self.scorer.encode(item.prompt or "", item.response or "", item.chat)
            except (ValueError, TypeError, KeyError) as e:  # e.g. chat: true with a prompt that is no message list
                return f"cannot read the item ({type(e).__name__}: {e}); with chat: true the prompt must be a JSON message list"
        if len(ids) > self.max_len:
            return f"{len(ids)} tokens, more than the reward model's {self.max_len} positions; shorten the item"
        return ids

    def submit(self, seqs: list[list[int] | str]) -> _Job:
        job = _Job(seqs)
        self._queue.put_nowait(job)  # queue.Full → 429
        return job

    def health(self) -> dict[str, Any]:
        alive = self._thread.is_alive()
        return {"status": "ok" if alive else "degraded", "version": self.scorer.version,
                "weights_sha256": self.scorer.weights_sha256, "reward_stats": self.scorer.stats,
                "queue": self._queue.qsize(), "max_queue": self.max_queue}

    def metrics(self) -> dict[str, Any]:
        s = self.stats
        return (s.values("requests", "rejected", "errors", "timeouts", "items", "batches")
                | {"mean_batch_items": s.batched_items / max(s.batches, 1)} | s.percentiles()
                | {"queue": self._queue.qsize(), "max_queue": self.max_queue})


class Item(BaseModel):
    prompt: str | None = Field(None, description="The prompt as stored: text, or (chat) a JSON list of messages.")
    response: str | None = Field(None, description="The response to score.")
    chat: bool = Field(False, description="The prompt is a JSON message list rendered with the chat template.")
    input_ids: list[int] | None = Field(None, description="Instead of texts: the full token ids (prompt + response + end).")


class ScoreRequest(BaseModel):
    items: list[Item] = Field(max_length=MAX_ITEMS)
    timeout_s: float | None = Field(None, gt=0, le=3600, description="Answer within this many seconds (default: the service's).")


def _answer(service: RewardModelService, job: _Job, wait: float) -> list[dict[str, Any]]:
    version = service.scorer.version
    try:
        got = job.future.result(timeout=wait)
    except TimeoutError:
        job.future.cancel()
        service.stats.add(timeouts=1)
        reason = f"reward-model service gave no answer within {wait:g} s (queue {service._queue.qsize()}); raise timeout_s"
        return [{"score": None, "status": "timeout", "reason": reason, "rm_version": version}] * len(job.seqs)
    return [{"score": None, "status": "error", "reason": x, "rm_version": version} if isinstance(x, str)
            else {"score": x, "status": "ok", "reason": "", "rm_version": version} for x in got]


def create_app(service: RewardModelService):
    app = service_app("rlpipe reward model", "reward_model", service)

    @app.post("/score")
    def score(req: ScoreRequest) -> dict[str, Any]:
        def submit() -> _Job:
            missing = [k for k, i in enumerate(req.items) if i.input_ids is None and i.response is None]
            if missing:
                raise ValueError(f"items {missing[:5]}: give a response (with its prompt) or input_ids")
            return service.submit([service.encode(i) for i in req.items])

        # a batch the model fails on is counted by the scorer thread, once for all the requests in it
        return batch_answer(service, len(req.items), submit,
                            lambda job: _answer(service, job, req.timeout_s or service.request_timeout_s),
                            count_errors=False)

    return app


def serve(scorer: Any, host: str = "127.0.0.1", port: int = 8766, max_queue: int = 64, max_batch_items: int = 512,
          request_timeout_s: float = 30.0) -> None:
    service = RewardModelService(scorer, max_queue=max_queue, max_batch_items=max_batch_items,
                                 request_timeout_s=request_timeout_s)
    run_service(create_app(service), service, host, port)
