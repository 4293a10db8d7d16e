"""The rollout service: ``rlpipe serve rollout MODEL_URI`` — a rollout engine (vLLM or HF) behind HTTP.

Endpoints (all but /health need the bearer token when RLPIPE_ROLLOUT_TOKEN is set):
  GET  /health    → {"status", "engine", "dtype", "version" (sha256 of the weights held), "max_model_len",
                     "vocab_size", "queue", "max_queue", "busy"}
  POST /generate  {"prompts": [[token ids]], "n", "temperature", "top_p", "max_new_tokens", "seed", "timeout_s"?}
                  → {"completions": [[{"token_ids", "logprobs", "text", "finish_reason"}]], "version"}
  POST /logprobs  {"prompts": [[ids]], "continuations": [[ids]]} → {"logprobs": [[…]], "version"}
                  (the engine's own forward pass: what the weight-sync probe compares with the trainer)
  POST /weights   {"uri", "sha256"} → {"version", "load_s", "tensors"}: loads the *.safetensors under
                  ``uri`` — which must lie under ``runs/`` of the service's own object store — checks
                  their sha256 before and the engine's read-back after, and reloads in place.
  GET  /stats, /metrics (Prometheus text)

The engine runs one request at a time; up to ``max_queue`` more wait for their turn (429 beyond that),
each at most its timeout (504 when the turn does not come; a generation once started runs to its end).
fastapi/uvicorn are imported only when the app is built.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel, Field

from rlpipe.rollout.base import Completion, RolloutEngine, SamplingConfig
from rlpipe.services._common import Counters, queue_full, run_service, service_app

log = logging.getLogger(__name__)

MAX_PROMPTS = 2048
MAX_N = 64


class RolloutService:
    """An engine, the weights it holds, and the turn-taking in front of it."""

    def __init__(self, engine: RolloutEngine, model_dir: str | Path, store: Any, max_model_len: int = 256,
                 max_queue: int = 8, request_timeout_s: float = 300.0):
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        self.engine, self.store, self.max_model_len = engine, store, max_model_len
        self.vocab = int(cfg["vocab_size"])
        self.max_queue, self.request_timeout_s = max_queue, request_timeout_s
        self._turn, self._count = threading.Lock(), threading.Lock()
        self._waiting = 0
        self.stats = Counters("requests", "rejected", "errors", "timeouts", "unauthorized", "items", "tokens",
                              "weight_loads", window=4096)

    @contextlib.contextmanager
    def turn(self, timeout_s: float) -> Iterator[None]:
        """The engine to oneself: queue.Full when ``max_queue`` requests already wait for it (the one it
        serves not counted), TimeoutError when the turn does not come within ``timeout_s``."""
        with self._count:
            if self._waiting >= self.max_queue:
                raise queue.Full
            self._waiting += 1
        try:
            got = self._turn.acquire(timeout=timeout_s)
        finally:
            with self._count:
                self._waiting -= 1
        if not got:
            raise TimeoutError
        try:
            yield
        finally:
            self._turn.release()

    def check_prompts(self, prompts: list[list[int]], extra: int) -> None:
        """ValueError naming the first prompt that is empty, has ids outside the vocabulary, or is too long."""
        for k, p in enumerate(prompts):
            bad = [t for t in p if not 0 <= t < self.vocab]
            if not p or bad:
                raise ValueError(f"prompts[{k}]: token ids must be a non-empty list in [0, {self.vocab}); got {bad[:3] or 'none'}")
            if len(p) + extra > self.max_model_len:
                raise ValueError(f"prompts[{k}]: {len(p)} tokens + {extra} more exceed the engine's {self.max_model_len} "
                                 "positions (max_model_len); shorten it or lower max_new_tokens")

    def load(self, uri: str, sha256: str) -> dict[str, Any]:
        """The weights under ``uri`` into the engine: PermissionError outside ``runs/`` of this store,
        LookupError when no weights are there, ValueError when their hash is not ``sha256``."""
        from rlpipe.rollout.base import WeightSyncError
        from rlpipe.storage.weights import file_weights_sha256

        key = self.store.key_of(uri) if "://" in uri or uri.startswith("/") else uri.strip("/")
        if key is None or not key.startswith("runs/") or ".." in key.split("/"):
            raise PermissionError(f"{uri} is not under runs/ of this service's object store {self.store.url('runs')}: "
                                  "weights load only from a run's own prefix")
        files = [k for k in self.store.list(key) if k.endswith(".safetensors")]
        if not files:
            raise LookupError(f"{self.store.url(key)} holds no *.safetensors weights")
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="rlpipe-rollout-") as tmp:
            for k in files:
                (Path(tmp) / Path(k).name).write_bytes(self.store.get_bytes(k))
            got = file_weights_sha256(tmp)
            if got != sha256:
                raise ValueError(f"{self.store.url(key)} holds weights {got[:12]}, the request expects {sha256[:12]}")
            held = self.engine.load_weights(tmp)
        if held != sha256:
            raise WeightSyncError(f"the engine holds {held[:12]} after the reload, not {sha256[:12]}")
        self.stats.add(weight_loads=1)
        return {"version": held, "load_s": time.perf_counter() - start,
                "tensors": float(getattr(self.engine, "last_readback", 0))}

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "engine": self.engine.name, "dtype": self.engine.dtype,
                "version": self.engine.weights_sha256(), "max_model_len": self.max_model_len, "vocab_size": self.vocab,
                "queue": self._waiting, "max_queue": self.max_queue, "busy": self._turn.locked()}

    def histograms(self) -> dict[str, Counters]:
        return {"request_seconds": self.stats}

    def metrics(self) -> dict[str, Any]:
        s = self.stats
        return (s.values("requests", "rejected", "errors", "timeouts", "unauthorized", "items", "tokens", "weight_loads")
                | s.percentiles() | {"queue": self._waiting, "in_flight": int(self._turn.locked())})

    def close(self) -> None:
        self.engine.close()


class GenerateRequest(BaseModel):
    prompts: list[list[int]] = Field(min_length=1, max_length=MAX_PROMPTS, description="Token ids of each prompt.")
    n: int = Field(1, ge=1, le=MAX_N, description="Completions per prompt.")
    temperature: float = Field(1.0, ge=0, le=10, description="0: greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(8, ge=1, le=8192)
    seed: int | None = Field(None, description="Sampling seed (the same seed and weights give the same samples).")
    timeout_s: float | None = Field(None, gt=0, le=3600, description="Most seconds to wait for the engine's turn.")


class LogprobsRequest(BaseModel):
    prompts: list[list[int]] = Field(min_length=1, max_length=MAX_PROMPTS)
    continuations: list[list[int]] = Field(min_length=1, max_length=MAX_PROMPTS)
    timeout_s: float | None = Field(None, gt=0, le=3600)


class WeightsRequest(BaseModel):
    uri: str = Field(min_length=1, description="Object-store URI (or key) of a folder with *.safetensors, under runs/.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="The weights' sha256 (rlpipe's tensor hash).")
    timeout_s: float | None = Field(None, gt=0, le=3600)


def _completion(c: Completion) -> dict[str, Any]:
    return {"token_ids": c.token_ids, "logprobs": c.logprobs, "text": c.text, "finish_reason": c.finish_reason}


@contextlib.contextmanager
def _served(service: RolloutService, timeout_s: float | None) -> Iterator[None]:
    """The engine's turn, timed and counted; the HTTP error when it cannot be had or the work fails."""
    from fastapi import HTTPException

    start = time.perf_counter()
    service.stats.add(requests=1)
    try:
        with service.turn(timeout_s or service.request_timeout_s):
            yield
    except queue.Full:
        raise queue_full(service) from None
    except TimeoutError:
        service.stats.add(timeouts=1)
        raise HTTPException(status_code=504, detail=f"the engine was busy for {timeout_s or service.request_timeout_s:g} s; "
                            "retry, raise timeout_s, or add a replica") from None
    except (ValueError, PermissionError, LookupError) as e:
        raise HTTPException(status_code={PermissionError: 403, LookupError: 404}.get(type(e), 422), detail=str(e)) from None
    except HTTPException:
        raise
    except Exception as e:  # noqa: BLE001 - the engine failed on this request; the service goes on
        service.stats.add(errors=1)
        log.exception("rollout service: request failed")
        raise HTTPException(status_code=500, detail=f"{type(e).__name__}: {e}") from None
    service.stats.latency(time.perf_counter() - start)


def create_app(service: RolloutService, token: str | None = None):
    app = service_app("rlpipe rollout", "rollout", service, token)

    @app.post("/generate")
    def generate(req: GenerateRequest) -> dict[str, Any]:
        with _served(service, req.timeout_s):
            service.check_prompts(req.prompts, req.max_new_tokens)
            sampling = SamplingConfig(n=req.n, temperature=req.temperature, top_p=req.top_p,
                                      max_new_tokens=req.max_new_tokens, seed=req.seed)
            outs = service.engine.generate(req.prompts, sampling)
            service.stats.add(items=len(req.prompts), tokens=sum(len(c.token_ids) for o in outs for c in o))
            return {"completions": [[_completion(c) for c in o] for o in outs], "version": service.engine.weights_sha256()}

    @app.post("/logprobs")
    def logprobs(req: LogprobsRequest) -> dict[str, Any]:
        with _served(service, req.timeout_s):
            if len(req.prompts) != len(req.continuations) or not all(req.continuations):
                raise ValueError(f"{len(req.prompts)} prompts and {len(req.continuations)} continuations: give one "
                                 "non-empty continuation per prompt")
            service.check_prompts([p + c for p, c in zip(req.prompts, req.continuations)], 0)
            lp = service.engine.sequence_logprobs(req.prompts, req.continuations)
            return {"logprobs": lp, "version": service.engine.weights_sha256()}

    @app.post("/weights")
    def weights(req: WeightsRequest) -> dict[str, Any]:
        with _served(service, req.timeout_s):
            return service.load(req.uri, req.sha256)

    return app


def serve(engine: RolloutEngine, model_dir: str | Path, store: Any, host: str = "127.0.0.1", port: int = 8768,
          max_model_len: int = 256, max_queue: int = 8, request_timeout_s: float = 300.0) -> None:
    service = RolloutService(engine, model_dir, store, max_model_len, max_queue, request_timeout_s)
    run_service(create_app(service), service, host, port)
