"""The environment service: ``rlpipe serve env`` — agent environments over HTTP, each call in a sandbox.

Endpoints:
  GET  /health   → {"status", "envs", "sandbox", "in_flight", "workers", "max_queue", "step_timeout_s"}
  POST /reset    {"spec", "task", "seed"}                        → {"observation", "env_s"}
  POST /step     {"spec", "task", "seed", "actions", "seen"}     → {"observation", "reward", "done", "info", "env_s"}
  GET  /stats    → requests, rejected (429), failures, timeouts, resets, steps, in flight,
                   latency p50/p99 (s), environment step time p50/p99 (s)
  GET  /metrics  → the same numbers in the Prometheus text format (rlpipe_<service>_…: counters, gauges,
                   up, request-latency histograms)

The service is stateless: a step carries the episode so far (its task, seed, actions and the
observations seen) and is answered by replaying it in a fresh sandbox (:mod:`rlpipe.envs.sandboxed`),
so any replica answers any step and a restart loses no episode. At most ``workers`` sandboxes run at
once; up to ``max_queue`` more requests wait, the rest get 429. An environment that fails — crashes,
runs past ``step_timeout_s``, breaks its sandbox's limits, or is not deterministic under replay —
answers 200 with ``{"failed": true, "reason"}``: the episode's status is then ``error``. A request
the service cannot read (an unknown environment, a bad parameter) is 422 naming the field.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from pydantic import BaseModel, Field

from rlpipe.envs.sandboxed import EnvFailure, SandboxOptions, sandbox_call
from rlpipe.services._common import Counters, queue_full, run_service, service_app

MAX_ACTIONS = 1000
MAX_TEXT = 65536


class EnvService:
    """Bounded concurrency over sandboxed replay calls, with counters."""

    def __init__(self, options: SandboxOptions, workers: int = 2, max_queue: int = 64):
        self.options, self.workers, self.max_queue = options, workers, max_queue
        self._slots = threading.Semaphore(workers)
        self._admit = threading.Lock()
        self.in_flight = 0  # running or waiting
        self.stats = Counters("requests", "rejected", "failures", "timeouts", "resets", "steps", window=4096)
        self.env_times = Counters(window=4096)

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        """The reply to one replay request, or ``None`` when the queue is full."""
        with self._admit:
            if self.in_flight >= self.workers + self.max_queue:
                return None
            self.in_flight += 1
        start = time.perf_counter()
        try:
            with self._slots:
                reply = sandbox_call(request, self.options)
            self.env_times.latency(float(reply.get("env_s", 0.0)))
            return {k: reply[k] for k in ("observation", "reward", "done", "info", "env_s") if k in reply}
        except EnvFailure as e:
            self.stats.add(failures=1, timeouts=int(e.kind == "timeout"))
            return {"failed": True, "kind": e.kind, "reason": str(e)}
        finally:
            with self._admit:
                self.in_flight -= 1
            self.stats.latency(time.perf_counter() - start)

    def health(self) -> dict[str, Any]:
        from rlpipe.envs import env_names
        from rlpipe.sandbox import isolation_report

        return {"status": "ok", "envs": env_names(), "sandbox": isolation_report()["level"], "in_flight": self.in_flight,
                "workers": self.workers, "max_queue": self.max_queue, "step_timeout_s": self.options.step_timeout_s}

    def histograms(self) -> dict[str, Counters]:
        return {"request_seconds": self.stats, "step_seconds": self.env_times}

    def metrics(self) -> dict[str, Any]:
        s = self.stats
        return (s.values("requests", "rejected", "failures", "timeouts", "resets", "steps") | {"in_flight": self.in_flight}
                | s.percentiles() | self.env_times.percentiles("env_step"))

    def close(self) -> None:
        pass


class ResetRequest(BaseModel):
    spec: dict[str, Any] = Field(description="The environment spec (as in configs/envs/*.yaml).")
    task: dict[str, Any] = Field(default_factory=dict)
    seed: int = 0


class StepRequest(ResetRequest):
    actions: list[str] = Field(min_length=1, max_length=MAX_ACTIONS, description="Every action so far, the new one last.")
    seen: list[str] = Field(default_factory=list, max_length=MAX_ACTIONS + 1,
                            description="The observations the episode saw (first: reset's); replay must give them again.")


def create_app(service: EnvService):
    from fastapi import HTTPException
    from pydantic import ValidationError

    from rlpipe.envs import EnvSpec

    app = service_app("rlpipe environments", "env", service)

    def answer(req: ResetRequest, actions: list[str], seen: list[str]) -> dict[str, Any]:
        service.stats.add(requests=1, resets=int(not actions), steps=int(bool(actions)))
        try:
            spec = EnvSpec.model_validate(req.spec)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "spec"
            raise HTTPException(status_code=422, detail=f"spec.{where}: {first['msg']}") from None
        if any(len(a) > MAX_TEXT for a in actions):
            raise HTTPException(status_code=422, detail=f"actions: an action longer than {MAX_TEXT} characters")
        reply = service.run({"spec": spec.model_dump(mode="json"), "task": req.task, "seed": req.seed,
                             "actions": actions, "seen": seen})
        if reply is None:
            raise queue_full(service)
        return reply

    @app.post("/reset")
    def reset(req: ResetRequest) -> dict[str, Any]:
        return answer(req, [], [])

    @app.post("/step")
    def step(req: StepRequest) -> dict[str, Any]:
        return answer(req, req.actions, req.seen)

    return app


def serve(options: SandboxOptions, host: str = "127.0.0.1", port: int = 8767, workers: int = 2, max_queue: int = 64) -> None:
    service = EnvService(options, workers=workers, max_queue=max_queue)
    run_service(create_app(service), service, host, port)
