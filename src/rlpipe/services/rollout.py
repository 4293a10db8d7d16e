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
  The trainer's weights streamed in buckets (:mod:`rlpipe.storage.weight_stream`), no object store between:
  POST /weights/stream/begin {"sha256", "buckets", "bytes"} → {"stream", "max_bytes"}: opens a stream of
                  ``buckets`` bodies of at most ``bytes`` bytes in all (413 beyond ``max_stream_bytes``). One stream at
                  a time: a begin drops the stream still open, if any (a sender that died mid-stream must not
                  lock the next sync out; the one writer is the run's weight sync). The buckets of a stream
                  left open are held in memory until the next begin.
  PUT  /weights/stream/{stream}/{k}  raw body: bucket k's safetensors bytes, decoded on arrival (422 for k out
                  of range or bytes that are not safetensors, 413 when the bodies would exceed the declared
                  bytes, 404 for a stream that is not the open one; a bucket sent again replaces the earlier).
  POST /weights/stream/{stream}/commit → {"version", "load_s", "tensors"}: 422 while buckets are missing (the
                  stream stays open to take them); else the stream closes, its tensors are hashed — a hash
                  other than the declared sha256 is 422 and the engine keeps its weights — and the engine
                  reloads them in place (its read-back checked, as for /weights).
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
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel, Field

from rlpipe.rollout.base import Completion, RolloutEngine, SamplingConfig, WeightSyncError
from rlpipe.services._common import Counters, queue_full, run_service, service_app

log = logging.getLogger(__name__)

MAX_PROMPTS = 2048
MAX_N = 64
MAX_BUCKETS = 1 << 16
# The stream bound when the model folder holds no *.safetensors to size it by.
FALLBACK_STREAM_BYTES = 32 << 30


class TooLarge(ValueError):
    """More bytes than a weight stream may hold (HTTP 413)."""


@dataclass
class WeightStream:
    """An open weight stream: what was declared, and each bucket received so far, decoded, with its size."""

    id: str
    sha256: str
    n_buckets: int
    bytes: int
    received: dict[int, tuple[int, dict[str, Any]]] = field(default_factory=dict)

    def room(self, k: int) -> int:
        """The most bytes bucket ``k`` may have: the declared total less the other buckets'."""
        return self.bytes - sum(size for j, (size, _) in self.received.items() if j != k)


def _stream_limit(model_dir: str | Path) -> int:
    """4× the checkpoint's weight bytes (a trainer in fp32 sends twice a bf16 checkpoint's; the rest is margin)."""
    size = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    return 4 * size if size else FALLBACK_STREAM_BYTES


class RolloutService:
    """An engine, the weights it holds, and the turn-taking in front of it."""

    def __init__(self, engine: RolloutEngine, model_dir: str | Path, store: Any, max_model_len: int = 256,
                 max_queue: int = 8, request_timeout_s: float = 300.0, max_stream_bytes: int | None = None):
        """``max_stream_bytes``: the most bytes a weight stream may declare (default: 4× the weight bytes of
        ``model_dir``'s *.safetensors, or 32 GiB when it holds none)."""
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        self.engine, self.store, self.max_model_len = engine, store, max_model_len
        self.vocab = int(cfg["vocab_size"])
        self.max_queue, self.request_timeout_s = max_queue, request_timeout_s
        self._turn, self._count = threading.Lock(), threading.Lock()
        self._waiting = 0
        self.max_stream_bytes = max_stream_bytes or _stream_limit(model_dir)
        self._stream: WeightStream | None = None
        self._stream_lock = threading.Lock()
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
        return self._reloaded(held, sha256, start)

    def _reloaded(self, held: str, sha256: str, start: float) -> dict[str, Any]:
        """The answer to a weight load, once the engine reports the version it was sent."""
        if held != sha256:
            raise WeightSyncError(f"the engine holds {held[:12]} after the reload, not {sha256[:12]}")
        self.stats.add(weight_loads=1)
        return {"version": held, "load_s": time.perf_counter() - start,
                "tensors": float(getattr(self.engine, "last_readback", 0))}

    def begin_stream(self, sha256: str, buckets: int, nbytes: int) -> dict[str, Any]:
        """Open a weight stream (dropping the one still open); TooLarge beyond ``max_stream_bytes``."""
        if nbytes > self.max_stream_bytes:
            raise TooLarge(f"bytes={nbytes}: a weight stream here holds at most {self.max_stream_bytes} bytes "
                           "(max_stream_bytes, 4× the served checkpoint's weights by default); is this the right model?")
        stream = WeightStream(secrets.token_hex(8), sha256, buckets, nbytes)
        with self._stream_lock:
            if self._stream is not None:
                log.warning("weight stream %s dropped with %d of %d buckets: a new stream begins", self._stream.id,
                            len(self._stream.received), self._stream.n_buckets)
            self._stream = stream
        return {"stream": stream.id, "max_bytes": self.max_stream_bytes}

    def _open(self, stream_id: str, k: int | None = None) -> WeightStream:
        """The open stream if it is ``stream_id`` (LookupError else) and ``k`` one of its buckets (ValueError
        else); the caller holds ``_stream_lock``."""
        s = self._stream
        if s is None or s.id != stream_id:
            raise LookupError(f"weight stream {stream_id} is not open (a later begin, or its commit, closed it): "
                              "begin a new one with POST /weights/stream/begin")
        if k is not None and not 0 <= k < s.n_buckets:
            raise ValueError(f"bucket {k} is out of range: stream {stream_id} declared buckets 0..{s.n_buckets - 1}")
        return s

    def bucket_room(self, stream_id: str, k: int) -> int:
        """The most bytes bucket ``k`` of the open stream may have."""
        with self._stream_lock:
            return self._open(stream_id, k).room(k)

    def put_bucket(self, stream_id: str, k: int, data: bytes | bytearray) -> None:
        """Bucket ``k`` decoded as it arrives (while the next one travels) and kept; ValueError when it is not
        safetensors bytes."""
        from rlpipe.storage.weight_stream import decode_bucket

        tensors = decode_bucket(data, k)
        with self._stream_lock:
            s = self._open(stream_id, k)
            if len(data) > s.room(k):
                raise TooLarge(f"bucket {k}: {len(data)} bytes exceed what stream {stream_id} declared "
                               f"({s.bytes} bytes in all, {s.room(k)} left for this bucket)")
            s.received[k] = (len(data), tensors)

    def take_stream(self, stream_id: str) -> tuple[str, dict[str, Any]]:
        """Close the open stream and return (its sha256, its tensors), proven whole: ValueError while buckets
        are missing (the stream stays open) or when the tensors' hash is not the declared one (it closes)."""
        from rlpipe.storage.weight_stream import join_buckets
        from rlpipe.storage.weights import weights_sha256

        with self._stream_lock:
            s = self._open(stream_id)
            missing = [k for k in range(s.n_buckets) if k not in s.received]
            if missing:
                raise ValueError(f"weight stream {stream_id}: buckets {missing[:5]} of {s.n_buckets} are missing; "
                                 "PUT them, then commit again")
            self._stream = None
        tensors = join_buckets(s.received[k][1] for k in range(s.n_buckets))
        s.received.clear()
        got = weights_sha256(tensors)
        if got != s.sha256:
            raise ValueError(f"weight stream {stream_id}: the buckets hold weights {got[:12]}, the stream declared "
                             f"{s.sha256[:12]}; nothing was loaded (the engine keeps {self.engine.weights_sha256()[:12]})")
        return s.sha256, tensors

    def load_streamed(self, sha256: str, tensors: dict[str, Any], start: float) -> dict[str, Any]:
        """The proven tensors of a stream into the engine, in place."""
        return self._reloaded(self.engine.load_tensors(tensors, sha256), sha256, start)

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


class StreamBegin(BaseModel):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="The weights' sha256 (rlpipe's tensor hash), the transfer's proof.")
    buckets: int = Field(ge=1, le=MAX_BUCKETS, description="How many buckets (PUT bodies) the stream has.")
    bytes: int = Field(ge=1, description="The bodies' bytes in all, or a bound on them: no more are taken.")


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
        raise _refusal(e) from None
    except HTTPException:
        raise
    except Exception as e:  # noqa: BLE001 - the engine failed on this request; the service goes on
        service.stats.add(errors=1)
        log.exception("rollout service: request failed")
        raise HTTPException(status_code=500, detail=f"{type(e).__name__}: {e}") from None
    service.stats.latency(time.perf_counter() - start)


def _refusal(e: Exception):
    """The 4xx of a request the service cannot take, with the reason."""
    from fastapi import HTTPException

    return HTTPException(status_code={PermissionError: 403, LookupError: 404, TooLarge: 413}.get(type(e), 422), detail=str(e))


@contextlib.contextmanager
def _refused() -> Iterator[None]:
    """A request that needs no engine turn: its ValueError, PermissionError or LookupError as a 4xx."""
    try:
        yield
    except (ValueError, PermissionError, LookupError) as e:
        raise _refusal(e) from None


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

    _stream_endpoints(app, service)
    return app


def _stream_endpoints(app: Any, service: RolloutService) -> None:
    """/weights/stream/…: begin, a PUT per bucket, commit (see the module docstring)."""
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    @app.post("/weights/stream/begin")
    def stream_begin(req: StreamBegin) -> dict[str, Any]:
        with _refused():
            return service.begin_stream(req.sha256, req.buckets, req.bytes)

    async def stream_bucket(request: Any) -> Any:
        """A plain Starlette route: the raw body, read up to the room the stream has left, never more."""
        stream_id, k = request.path_params["stream_id"], request.path_params["k"]
        with _refused():
            room = service.bucket_room(stream_id, k)
            if int(request.headers.get("content-length") or 0) > room:
                raise TooLarge(f"bucket {k}: {request.headers['content-length']} bytes exceed the {room} bytes "
                               f"stream {stream_id} has left for it")
            data = bytearray()
            async for chunk in request.stream():
                data += chunk
                if len(data) > room:
                    raise TooLarge(f"bucket {k}: more than the {room} bytes stream {stream_id} has left for it")
            await run_in_threadpool(service.put_bucket, stream_id, k, data)  # decoding: off the event loop
        return JSONResponse({"stream": stream_id, "bucket": k, "bytes": len(data)})

    app.add_route("/weights/stream/{stream_id}/{k:int}", stream_bucket, methods=["PUT"])

    @app.post("/weights/stream/{stream_id}/commit")
    def stream_commit(stream_id: str) -> dict[str, Any]:
        start = time.perf_counter()
        with _refused():  # decoded and hashed before the engine's turn: generation goes on meanwhile
            sha, tensors = service.take_stream(stream_id)
        with _served(service, None):
            return service.load_streamed(sha, tensors, start)


def serve(engine: RolloutEngine, model_dir: str | Path, store: Any, host: str = "127.0.0.1", port: int = 8768,
          max_model_len: int = 256, max_queue: int = 8, request_timeout_s: float = 300.0,
          max_stream_bytes: int | None = None) -> None:
    service = RolloutService(engine, model_dir, store, max_model_len, max_queue, request_timeout_s, max_stream_bytes)
    run_service(create_app(service), service, host, port)
