"""The rollout service: ``rlpipe serve rollout MODEL_URI`` — a rollout engine (vLLM or HF) behind HTTP.

Endpoints (all but /health need the bearer token when RLPIPE_ROLLOUT_TOKEN is set):
  GET  /health    → {"status", "engine", "dtype", "version" (sha256 of the weights held), "max_model_len",
                     "vocab_size", "queue", "max_queue", "busy", "lora_rank" (the LoRA rank it serves adapters up
                     to; 0: none)}
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
  A LoRA adapter alone (a replica started with ``--lora-rank``: it serves its base weights with the adapter):
  POST /adapter?version=SHA256  raw body: the adapter's safetensors bytes (peft's adapter_model.safetensors) with
                  peft's adapter_config.json in the header's ``__metadata__["adapter_config"]`` (one body, megabytes;
                  :func:`rlpipe.rollout.remote.adapter_body` makes it) → {"adapter_sha256" (the engine's hash of the
                  tensors it read), "version" (``version``: the policy it now serves), "load_s", "bytes"}. 409 on a
                  replica without LoRA support; 413 beyond ``max_adapter_bytes``; 422 for bytes that are not
                  safetensors, no config, a rank above the served one, or tensors that do not fit the served model
                  (all checked before the engine sees the adapter: vLLM reads it only at the next request).
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
import re
import secrets
import shutil
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
# The least bound on an adapter body (a tiny model's adapter may be near its own size).
MIN_ADAPTER_BYTES = 16 << 20
# peft's names of a LoRA adapter's tensors: base_model.model.<module>.lora_A|lora_B.weight
_LORA_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


class TooLarge(ValueError):
    """More bytes than a weight stream may hold (HTTP 413)."""


class Conflict(ValueError):
    """A request this replica cannot serve as it was started (HTTP 409)."""


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


def _adapter_limit(model_dir: str | Path) -> int:
    """The checkpoint's weight bytes, at least 16 MiB: an adapter larger than its model is better sent merged."""
    return max(MIN_ADAPTER_BYTES, sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")))


def _base_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Each weight's shape in the checkpoint's *.safetensors, from their headers alone."""
    from safetensors import safe_open

    shapes = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            shapes |= {name: tuple(st.get_slice(name).get_shape()) for name in st.keys()}
    return shapes


def _header_metadata(data: bytes | bytearray) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes (ValueError when they are none)."""
    n = int.from_bytes(bytes(data[:8]), "little") if len(data) >= 8 else -1
    if not 0 < n <= len(data) - 8:
        raise ValueError("the body is not safetensors bytes (its 8-byte header length is missing or too large)")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except ValueError:
        raise ValueError("the body is not safetensors bytes (its header is not JSON)") from None
    return header.get("__metadata__") or {} if isinstance(header, dict) else {}


def check_adapter(data: bytes | bytearray, max_rank: int, base: dict[str, tuple[int, ...]]) -> str:
    """The adapter_config.json text of an adapter body, once the body is proven to be a LoRA adapter this replica
    can serve: safetensors bytes, peft's config in its metadata with a rank ≤ ``max_rank``, and every tensor a
    lora_A (r, in) or lora_B (out, r) of a weight of the served model (``base``: its shapes by name). ValueError
    naming what is wrong: vLLM reads an adapter only at the first request that uses it, too late to refuse it."""
    from safetensors.torch import load

    text = _header_metadata(data).get("adapter_config")
    if not text:
        raise ValueError("the body carries no adapter_config.json (the safetensors metadata's 'adapter_config'); "
                         "send it with RemoteEngine.load_adapter")
    try:
        config, tensors = json.loads(text), load(bytes(data))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type on bad bytes
        raise ValueError(f"the body is not a readable adapter: {type(e).__name__}: {e}") from None
    r = config.get("r") if isinstance(config, dict) else None
    if not isinstance(r, int) or not 0 < r <= max_rank:
        raise ValueError(f"adapter_config.json r={r!r}: this replica serves LoRA ranks 1..{max_rank}; restart it with "
                         f"--lora-rank {r} or more, or set rollout.lora_sync: merged")
    if not tensors:
        raise ValueError("the adapter holds no tensors")
    for name, t in tensors.items():
        m = _LORA_NAME.match(name)
        shape = base.get(f"{m['module']}.weight") if m else None
        if shape is None or len(shape) != 2 or t.dim() != 2:
            raise ValueError(f"adapter tensor {name}: not the lora_A/lora_B weight of a linear layer of the served model")
        want = (t.shape[0], shape[1]) if m["ab"] == "A" else (shape[0], t.shape[1])
        if tuple(t.shape) != want or min(t.shape) > max_rank:
            raise ValueError(f"adapter tensor {name}: shape {tuple(t.shape)} does not fit the served model's "
                             f"{m['module']}.weight {shape} (expected {want}, rank ≤ {max_rank}): an adapter of another model?")
    return text


class RolloutService:
    """An engine, the weights it holds, and the turn-taking in front of it."""

    def __init__(self, engine: RolloutEngine, model_dir: str | Path, store: Any, max_model_len: int = 256,
                 max_queue: int = 8, request_timeout_s: float = 300.0, max_stream_bytes: int | None = None,
                 max_adapter_bytes: int | None = None):
        """``max_stream_bytes``: the most bytes a weight stream may declare (default: 4× the weight bytes of
        ``model_dir``'s *.safetensors, or 32 GiB when it holds none). ``max_adapter_bytes``: the largest adapter
        body (default: the weight bytes, at least 16 MiB)."""
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        self.engine, self.store, self.max_model_len, self.model_dir = engine, store, max_model_len, Path(model_dir)
        self.max_adapter_bytes = max_adapter_bytes or _adapter_limit(model_dir)
        self._base: dict[str, tuple[int, ...]] | None = None
        self._scratch: tempfile.TemporaryDirectory | None = None
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
        from rlpipe.storage.weights import file_weights_digest

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
            got = file_weights_digest(tmp)
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
        from rlpipe.storage.weights import weights_digest

        with self._stream_lock:
            s = self._open(stream_id)
            missing = [k for k in range(s.n_buckets) if k not in s.received]
            if missing:
                raise ValueError(f"weight stream {stream_id}: buckets {missing[:5]} of {s.n_buckets} are missing; "
                                 "PUT them, then commit again")
            self._stream = None
        tensors = join_buckets(s.received[k][1] for k in range(s.n_buckets))
        s.received.clear()
        got = weights_digest(tensors)
        if got != s.sha256:
            raise ValueError(f"weight stream {stream_id}: the buckets hold weights {got[:12]}, the stream declared "
                             f"{s.sha256[:12]}; nothing was loaded (the engine keeps {self.engine.weights_sha256()[:12]})")
        return s.sha256, tensors

    def load_streamed(self, sha256: str, tensors: dict[str, Any], start: float) -> dict[str, Any]:
        """The proven tensors of a stream into the engine, in place."""
        return self._reloaded(self.engine.load_tensors(tensors, sha256), sha256, start)

    @property
    def lora_rank(self) -> int:
        """The LoRA rank the engine serves adapters up to (0: it was started without LoRA support)."""
        return int(getattr(self.engine, "lora_rank", None) or 0)

    def require_lora(self) -> None:
        """Conflict (409) on a replica started without LoRA support."""
        if not self.lora_rank:
            raise Conflict(f"this rollout replica ({self.engine.name}) was started without LoRA support and takes no "
                           "adapter: restart it with `rlpipe serve rollout MODEL --lora-rank R` (R ≥ train.lora.r, vLLM "
                           "only), or set rollout.lora_sync: merged to send the merged weights")

    def check_adapter(self, data: bytes | bytearray) -> str:
        """The adapter body checked against this replica (:func:`check_adapter`); its adapter_config.json text."""
        self.require_lora()
        if self._base is None:
            self._base = _base_shapes(self.model_dir)
        return check_adapter(data, self.lora_rank, self._base)

    def load_adapter(self, data: bytes | bytearray, version: str, config: str | None = None) -> dict[str, Any]:
        """An adapter body (see the module docstring) checked (unless its ``config`` comes from
        :meth:`check_adapter`), written to this service's scratch folder and loaded by the engine, which serves its
        base weights with it from now on and reports ``version``."""
        config = config or self.check_adapter(data)
        start = time.perf_counter()
        if self._scratch is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="rlpipe-rollout-adapter-")
        folder = Path(self._scratch.name) / secrets.token_hex(8)
        folder.mkdir()
        try:  # the engine copies the folder to its own (vLLM reads it later): this one goes at once
            (folder / "adapter_model.safetensors").write_bytes(data)
            (folder / "adapter_config.json").write_text(config)
            digest = self.engine.load_adapter(folder, version)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self.stats.add(weight_loads=1)
        return {"adapter_sha256": digest, "version": self.engine.weights_sha256(), "load_s": time.perf_counter() - start,
                "bytes": len(data)}

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "engine": self.engine.name, "dtype": self.engine.dtype,
                "version": self.engine.weights_sha256(), "max_model_len": self.max_model_len, "vocab_size": self.vocab,
                "queue": self._waiting, "max_queue": self.max_queue, "busy": self._turn.locked(),
                "lora_rank": self.lora_rank}

    def histograms(self) -> dict[str, Counters]:
        return {"request_seconds": self.stats}

    def metrics(self) -> dict[str, Any]:
        s = self.stats
        return (s.values("requests", "rejected", "errors", "timeouts", "unauthorized", "items", "tokens", "weight_loads")
                | s.percentiles() | {"queue": self._waiting, "max_queue": self.max_queue, "in_flight": int(self._turn.locked())})

    def close(self) -> None:
        self.engine.close()
        if self._scratch is not None:
            self._scratch.cleanup()


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
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="The weights' digest (rlpipe's tensor hash, rlpipe.storage.weights).")
    timeout_s: float | None = Field(None, gt=0, le=3600)


class StreamBegin(BaseModel):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="The weights' digest (rlpipe's tensor hash, rlpipe.storage.weights), the transfer's proof.")
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

    codes = {PermissionError: 403, LookupError: 404, Conflict: 409, TooLarge: 413}
    return HTTPException(status_code=codes.get(type(e), 422), detail=str(e))


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
    _adapter_endpoint(app, service)
    return app


async def _body(request: Any, most: int, what: str) -> bytearray:
    """The raw body of a request, read up to ``most`` bytes and never more (TooLarge beyond)."""
    if int(request.headers.get("content-length") or 0) > most:
        raise TooLarge(f"{what}: {request.headers['content-length']} bytes exceed the {most} bytes it may have")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > most:
            raise TooLarge(f"{what}: more than the {most} bytes it may have")
    return data


def _adapter_endpoint(app: Any, service: RolloutService) -> None:
    """POST /adapter?version=…: a LoRA adapter in one raw body (see the module docstring)."""
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    def load(data: bytearray, version: str) -> dict[str, Any]:
        with _refused():  # checked before the engine's turn: generation goes on meanwhile
            config = service.check_adapter(data)
        with _served(service, None):
            return service.load_adapter(data, version, config)

    async def adapter(request: Any) -> Any:
        version = request.query_params.get("version", "")
        with _refused():
            service.require_lora()  # before megabytes are read
            if not re.fullmatch(r"[0-9a-f]{64}", version):
                raise ValueError(f"version={version[:80]!r}: give the policy's weight digest (64 hex digits) as ?version=")
            data = await _body(request, service.max_adapter_bytes, "the adapter")
        return JSONResponse(await run_in_threadpool(load, data, version))

    app.add_route("/adapter", adapter, methods=["POST"])


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
            data = await _body(request, room, f"bucket {k} of stream {stream_id}")
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
          max_stream_bytes: int | None = None, max_adapter_bytes: int | None = None) -> None:
    service = RolloutService(engine, model_dir, store, max_model_len, max_queue, request_timeout_s, max_stream_bytes,
                             max_adapter_bytes)
    run_service(create_app(service), service, host, port)
