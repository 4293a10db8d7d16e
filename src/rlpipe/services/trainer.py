"""The trainer service: ``rlpipe serve trainer [--nproc N]`` — the DeepSpeed policy trainer (with its critic
and reference model) as N ranks started by ``torchrun``; rank 0 answers HTTP.

Endpoints (all but /health need the bearer token when RLPIPE_TRAINER_TOKEN is set):
  GET  /health    → {"status", "world", "run_id", "version" (sha256 of the policy weights held), "busy", "queue"}
  POST /init      {"run_id", "policy": {"uri", "sha256"}, "resume"?, "ref"?, "critic"?, "train": {TrainConfig},
                   "seed", "temperature", "max_new_tokens"} → {"version", "world", "iteration", "buckets"? (train.precision
                  bf16_weights: the start weights rounded, to stream as an update's)}: every rank
                  downloads the folders (each must lie under ``runs/<run_id>/`` of the service's own object
                  store and hold the weights ``sha256`` names) and builds the trainer; a resume state brings
                  the optimizer, critic, KL controller and RNG back.
  POST /update    {"run_id", "iteration", "stages": [stage prefixes], "dynamic_batch"?, "step_rewards",
                   "extra_state", "save"} → {"metrics", "weights_sha256", "buckets", "saved", "state_prefix"?,
                   "state_uri"?, timings}: every rank reads the scored trajectories from the store, the ranks take
                  their optimizer steps together; the new weights are hashed once and kept in ``buckets`` to stream;
                  with ``save`` (a save point) the resumable state (weights, tokenizer, DeepSpeed optimizer shards
                  of every rank, trainer state, RNG) goes to the run's checkpoint prefix, marked whole last.
  GET  /weights/{sha256}/{k} → bucket k of the weights of the last update (safetensors bytes,
                  :mod:`rlpipe.storage.weight_stream`); 409 once another update replaced them.
  POST /logprobs  {"run_id", "prompts", "continuations"} → {"logprobs", "version"} (the weight-sync probe)
  GET  /stats, /metrics (Prometheus text)

The ranks' side (what each executes, and how they stay in step) is :mod:`rlpipe.services.trainer_ranks`;
this module is rank 0's HTTP front and the processes: one rank's main, the torchrun command, and the
local service ``rlpipe run --nproc N`` starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from rlpipe.services._common import Counters, queue_full
from rlpipe.services.trainer_ranks import TrainerRanks, rank_loop, run_key

log = logging.getLogger(__name__)

RUN_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


# -- rank 0's HTTP side ----------------------------------------------------------------------------
class TrainerService:
    """Rank 0's front: a bounded queue of commands for the ranks, and the numbers /metrics reports."""

    def __init__(self, ranks: TrainerRanks, max_queue: int = 4, request_timeout_s: float = 3600.0):
        self.ranks, self.max_queue, self.request_timeout_s = ranks, max_queue, request_timeout_s
        self.inbox: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self._lock, self.in_flight = threading.Lock(), 0
        self.stats = Counters("requests", "rejected", "errors", "timeouts", "unauthorized", "steps", "weight_loads",
                              window=1024)

    def submit(self, cmd: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
        """Run ``cmd`` on every rank; queue.Full past ``max_queue`` waiting, TimeoutError past the timeout."""
        if self.inbox.qsize() >= self.max_queue:
            raise queue.Full
        fut: Future = Future()
        with self._lock:
            self.in_flight += 1
        self.inbox.put((fut, cmd))
        try:
            return fut.result(timeout=timeout_s or self.request_timeout_s)
        except TimeoutError:
            fut.cancel()  # a command the ranks already run goes on; its result is dropped
            raise
        finally:
            with self._lock:
                self.in_flight -= 1

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "world": self.ranks.world, "run_id": self.ranks.run_id, "version": self.ranks.version,
                "busy": self.in_flight > 0, "queue": self.inbox.qsize(), "max_queue": self.max_queue}

    def histograms(self) -> dict[str, Counters]:
        return {"request_seconds": self.stats}

    def metrics(self) -> dict[str, Any]:
        s = self.stats
        return (s.values("requests", "rejected", "errors", "timeouts", "unauthorized", "steps", "weight_loads")
                | {"world": self.ranks.world} | s.percentiles()
                | {"queue": self.inbox.qsize(), "max_queue": self.max_queue, "in_flight": self.in_flight})

    def close(self) -> None:
        self.stop.set()


class Artifact(BaseModel):
    uri: str = Field(min_length=1, description="Object-store URI (or key) of a folder under runs/<run_id>/.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="The digest of the folder's weights (rlpipe's tensor hash).")


class InitRequest(BaseModel):
    run_id: str = Field(pattern=RUN_ID)
    policy: Artifact
    resume: Artifact | None = None
    ref: Artifact | None = None
    critic: Artifact | None = None
    train: dict[str, Any] = Field(description="The run's train section (TrainConfig).")
    seed: int = 0
    temperature: float = Field(1.0, gt=0, le=10)
    max_new_tokens: int | None = Field(None, ge=1, le=65536)
    timeout_s: float | None = Field(None, gt=0, le=86400)


class UpdateRequest(BaseModel):
    run_id: str = Field(pattern=RUN_ID)
    iteration: int = Field(ge=0)
    stages: list[str] = Field(min_length=1, max_length=64, description="Scored trajectory stages (prefixes) to train on.")
    dynamic_batch: int | None = Field(None, ge=1, description="Dynamic sampling: keep this many groups with signal.")
    step_rewards: bool = False
    extra_state: dict[str, Any] = Field(default_factory=dict)
    save: bool = Field(True, description="A save point: the resumable state goes to the store (else only the weights "
                       "are kept, to stream).")
    timeout_s: float | None = Field(None, gt=0, le=86400)


class LogprobsRequest(BaseModel):
    run_id: str = Field(pattern=RUN_ID)
    prompts: list[list[int]] = Field(min_length=1, max_length=4096)
    continuations: list[list[int]] = Field(min_length=1, max_length=4096)
    timeout_s: float | None = Field(None, gt=0, le=3600)


@contextlib.contextmanager
def _served(service: TrainerService, stat: str | None = None):
    """Timed and counted; the HTTP error when the queue is full, the ranks are busy too long or the work fails."""
    from fastapi import HTTPException

    start = time.perf_counter()
    service.stats.add(requests=1)
    try:
        yield
    except queue.Full:
        raise queue_full(service) from None
    except TimeoutError:
        service.stats.add(timeouts=1)
        raise HTTPException(status_code=504, detail="the trainer did not finish within the request's timeout_s") from None
    except (ValueError, PermissionError, LookupError, FileNotFoundError) as e:
        code = {PermissionError: 403, LookupError: 409, FileNotFoundError: 404}.get(type(e), 422)
        raise HTTPException(status_code=code, detail=str(e)) from None
    except HTTPException:
        raise
    except Exception as e:  # noqa: BLE001 - the ranks failed on this request; the service goes on
        service.stats.add(errors=1)
        raise HTTPException(status_code=500, detail=f"{type(e).__name__}: {e}") from None
    if stat:
        service.stats.add(**{stat: 1})
    service.stats.latency(time.perf_counter() - start)


def _check_init(service: TrainerService, req: InitRequest) -> None:
    """Before any rank moves: the folders lie under the run's prefix and exist, the train section is valid."""
    from rlpipe.config import TrainConfig

    store = service.ranks.store
    for name in ("policy", "resume", "ref", "critic"):
        art = getattr(req, name)
        if art is not None and not store.list(run_key(store, art.uri, req.run_id)):
            raise FileNotFoundError(f"{name}: {art.uri} holds no files")
    TrainConfig(**req.train)


def _check_run(service: TrainerService, run_id: str) -> None:
    if service.ranks.run_id != run_id:
        raise LookupError(f"the trainer holds run {service.ranks.run_id!r}, not {run_id!r}: POST /init first")


def create_app(service: TrainerService, token: str | None = None):
    from rlpipe.services._common import service_app

    app = service_app("rlpipe trainer", "trainer", service, token)

    @app.post("/init")
    def init(req: InitRequest) -> dict[str, Any]:
        with _served(service, "weight_loads"):
            _check_init(service, req)
            body = req.model_dump(exclude={"timeout_s"})
            return service.submit({"op": "init"} | body, req.timeout_s)

    @app.post("/update")
    def update(req: UpdateRequest) -> dict[str, Any]:
        with _served(service, "steps"):
            _check_run(service, req.run_id)
            store = service.ranks.store
            for p in req.stages:
                if not store.stage_done(run_key(store, p, req.run_id)):
                    raise FileNotFoundError(f"stage {p} is not complete in the store (no manifest)")
            return service.submit({"op": "update"} | req.model_dump(exclude={"timeout_s"}), req.timeout_s)

    @app.get("/weights/{sha256}/{k}")
    def weights(sha256: str, k: int) -> Any:
        from fastapi.responses import Response

        with _served(service):
            return Response(service.ranks.bucket(sha256, k), media_type="application/octet-stream")

    @app.post("/logprobs")
    def logprobs(req: LogprobsRequest) -> dict[str, Any]:
        with _served(service):
            _check_run(service, req.run_id)
            if len(req.prompts) != len(req.continuations) or not all(req.continuations) or not all(req.prompts):
                raise ValueError(f"{len(req.prompts)} prompts and {len(req.continuations)} continuations: give one "
                                 "non-empty continuation per non-empty prompt")
            return service.submit({"op": "logprobs"} | req.model_dump(exclude={"timeout_s"}), req.timeout_s)

    return app


# -- processes ---------------------------------------------------------------------------------------
def _http_thread(service: TrainerService, host: str, port: int, token: str | None) -> Any:
    import uvicorn

    from rlpipe.services._common import check_listen

    app = create_app(service, token)
    check_listen("trainer", host, app.state.rlpipe_token)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_keep_alive=30))
    server.install_signal_handlers = lambda: None  # the main thread runs the ranks' loop
    threading.Thread(target=server.run, name="trainer-http", daemon=True).start()
    return server


def rank_main(host: str, port: int, max_queue: int = 4, request_timeout_s: float = 3600.0) -> None:
    """One rank under torchrun (or alone): join the group, then execute commands until stopped. A signal
    ends a rank at once: between requests it holds nothing the store does not."""
    from rlpipe.config import settings
    from rlpipe.storage import open_store
    from rlpipe.training.engines import init_distributed

    _die_with_parent()
    rank, world = init_distributed()
    s = settings()
    workdir = Path(tempfile.mkdtemp(prefix="trainer-", dir=_home(s)))
    ranks = TrainerRanks(open_store(s.resolve_storage_uri(), s), workdir, rank, world)
    service, server = None, None
    if rank == 0:
        service = TrainerService(ranks, max_queue, request_timeout_s)
        server = _http_thread(service, host, port, None)
        log.warning("trainer service: %d rank(s), http://%s:%d", world, host, port)
    try:
        rank_loop(ranks, service.inbox if service else None, service.stop if service else None)
    finally:
        if server is not None:
            server.should_exit = True
        shutil.rmtree(workdir, ignore_errors=True)


def _die_with_parent() -> None:
    """torchrun starts each rank in a session of its own, so a SIGKILL to the launcher's process group would
    leave the ranks serving as orphans: on Linux, have the kernel end this rank when its launcher dies."""
    import ctypes
    import signal

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the launcher's own SIGTERM forwarding is what stops the ranks
    if os.getppid() != parent:  # the launcher died before the request took effect
        os._exit(1)


def _home(s: Any) -> Path:
    home = Path(s.home).resolve() / "trainer"
    home.mkdir(parents=True, exist_ok=True)
    return home


def launch_cmd(nproc: int, host: str, port: int, max_queue: int = 4, request_timeout_s: float = 3600.0) -> list[str]:
    """The command that starts the service as ``nproc`` ranks under torchrun on this machine."""
    import sys

    from rlpipe.net import free_port

    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "rlpipe.services.trainer",
            "--host", host, "--port", str(port), "--max-queue", str(max_queue), "--request-timeout", str(request_timeout_s)]


@contextlib.contextmanager
def local_trainer(nproc: int, home: Path, storage_uri: str, timeout_s: float = 300.0):
    """``rlpipe run --nproc N``: the trainer service as N ranks on this machine (loopback, a fresh token, its own
    RLPIPE_HOME, the run's object store) for the length of the block; yields its URL and token."""
    import secrets
    import subprocess

    import httpx

    from rlpipe.net import free_port
    from rlpipe.procs import stop_group

    home.mkdir(parents=True, exist_ok=True)
    port, token = free_port(), secrets.token_urlsafe(24)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env |= {"RLPIPE_HOME": str(home), "RLPIPE_STORAGE_URI": storage_uri, "RLPIPE_TRAINER_TOKEN": token}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    log_path = home / "trainer.log"
    with log_path.open("w") as out:
        proc = subprocess.Popen(launch_cmd(nproc, "127.0.0.1", port), env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout_s
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the trainer service ({nproc} ranks) exited at start; its log {log_path}:\n"
                                   + "\n".join(log_path.read_text(errors="replace").splitlines()[-15:]))
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the trainer service was not healthy after {timeout_s:g} s; its log {log_path}")
            time.sleep(0.5)
        yield url, token
    finally:
        stop_group(proc)


def _main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="one rank of the rlpipe trainer service (started by torchrun)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8769)
    ap.add_argument("--max-queue", type=int, default=4)
    ap.add_argument("--request-timeout", type=float, default=3600.0)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rank_main(a.host, a.port, a.max_queue, a.request_timeout)


if __name__ == "__main__":
    _main()
