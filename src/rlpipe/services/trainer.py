"""The trainer service: ``rlpipe serve trainer [--nproc N]`` — the DeepSpeed policy trainer (with its critic
and reference model) as N ranks started by ``torchrun``; rank 0 answers HTTP.

Endpoints (all but /health need the bearer token when RLPIPE_TRAINER_TOKEN is set):
  GET  /health    → {"status", "world", "run_id", "version" (sha256 of the policy weights held), "busy", "queue"}
  POST /init      {"run_id", "policy": {"uri", "sha256"}, "resume"?, "ref"?, "critic"?, "train": {TrainConfig},
                   "seed", "temperature", "max_new_tokens"} → {"version", "world", "iteration"}: every rank
                  downloads the folders (each must lie under ``runs/<run_id>/`` of the service's own object
                  store and hold the weights ``sha256`` names) and builds the trainer; a resume state brings
                  the optimizer, critic, KL controller and RNG back.
  POST /update    {"run_id", "iteration", "stages": [stage prefixes], "dynamic_batch"?, "step_rewards",
                   "extra_state"} → {"metrics", "weights_sha256", "state_prefix", "state_uri", "saved", timings}:
                  every rank reads the scored trajectories from the store, the ranks take their optimizer
                  steps together, and the resumable state (weights, tokenizer, DeepSpeed optimizer shards of
                  every rank, trainer state, RNG) goes to the run's checkpoint prefix, marked whole last.
  POST /logprobs  {"run_id", "prompts", "continuations"} → {"logprobs", "version"} (the weight-sync probe)
  GET  /stats, /metrics (Prometheus text)

How the ranks work together: the HTTP handlers on rank 0 validate a request and queue it; rank 0's main
thread broadcasts each command to every rank (``broadcast_object_list``), all ranks execute it, and rank 0
hands the result back. Idle ranks hear a ping every ``PING_S`` so no collective waits past its timeout.
Nothing assumes a shared filesystem: each rank downloads and uploads its own files.
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

from rlpipe.services._common import Counters, queue_full, settle

log = logging.getLogger(__name__)

PING_S = 30.0
RUN_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


def run_key(store: Any, uri: str, run_id: str) -> str:
    """The store key of ``uri``; PermissionError unless it lies under ``runs/<run_id>/`` of this store."""
    key = store.key_of(uri) if "://" in uri or uri.startswith("/") else uri.strip("/")
    if key is None or not key.startswith(f"runs/{run_id}/") or ".." in key.split("/"):
        raise PermissionError(f"{uri} is not under runs/{run_id}/ of this service's object store "
                              f"{store.url('runs')}: the trainer reads and writes only the run's own prefix")
    return key


# -- what every rank executes --------------------------------------------------------------------
class TrainerRanks:
    """One rank's side: the trainer it holds and the commands it executes in step with the others."""

    def __init__(self, store: Any, workdir: Path, rank: int, world: int):
        self.store, self.workdir, self.rank, self.world = store, Path(workdir), rank, world
        self.trainer: Any = None
        self.run_id: str | None = None
        self.version: str | None = None

    def execute(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "ping":
            return {}
        if op == "init":
            return self._init(cmd)
        if self.trainer is None or cmd.get("run_id") != self.run_id:
            raise LookupError(f"the trainer holds run {self.run_id!r}, not {cmd.get('run_id')!r}: POST /init first")
        return self._update(cmd) if op == "update" else self._logprobs(cmd)

    def _agree(self, err: BaseException | None, what: str) -> None:
        """Every rank passed ``what``, or every rank raises — its own error, or that another rank failed — so
        that no rank is left waiting in a collective."""
        failed = int(err is not None)
        if self.world > 1:
            import torch
            import torch.distributed as dist

            # NCCL reduces device tensors only; gloo (CPU) any.
            flag = torch.tensor([failed], device=f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu")
            dist.all_reduce(flag)
            failed = int(flag)
        if err is not None:
            raise err
        if failed:
            raise RuntimeError(f"{what} failed on {failed} other rank(s); see the trainer service's log")

    def _fetch(self, art: dict[str, str] | None, name: str, run_id: str) -> str | None:
        """A folder of the store into this rank's work dir, its weights checked against the expected sha256."""
        from rlpipe.resume import STATE_DONE
        from rlpipe.storage.weights import file_weights_sha256

        if art is None:
            return None
        dest = self.workdir / f"rank{self.rank}" / name
        shutil.rmtree(dest, ignore_errors=True)
        self.store.download_dir(run_key(self.store, art["uri"], run_id), dest)
        (dest / STATE_DONE).unlink(missing_ok=True)
        got = file_weights_sha256(dest)
        if got != art["sha256"]:
            raise ValueError(f"{art['uri']} holds weights {got[:12]}, the request expects {art['sha256'][:12]}")
        return str(dest)

    def _init(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from rlpipe.config import TrainConfig
        from rlpipe.training.trainer import PolicyTrainer

        run_id, err = cmd["run_id"], None
        try:
            dirs = {k: self._fetch(cmd.get(k), k, run_id) for k in ("policy", "resume", "ref", "critic")}
        except Exception as e:  # noqa: BLE001 - every rank must hear of it before the collective start-up
            err = e
        self._agree(err, "downloading the start weights")
        train = dict(cmd["train"])
        if dirs["critic"]:
            train["critic"] = dict(train.get("critic") or {}) | {"model": dirs["critic"]}
        self.trainer, self.run_id = None, None
        self.trainer = PolicyTrainer(model_dir=dirs["policy"], cfg=TrainConfig(**train), temperature=cmd["temperature"],
                                     seed=cmd["seed"], ref_model_dir=dirs["ref"], resume_dir=dirs["resume"],
                                     max_new_tokens=cmd.get("max_new_tokens"))
        self.run_id = run_id
        self.version = (cmd["resume"] or cmd["policy"])["sha256"]
        return {"version": self.version, "world": self.world, "iteration": self.trainer.state.get("iteration")}

    def _read(self, cmd: dict[str, Any]) -> tuple[Any, dict[str, float]]:
        import pyarrow as pa

        from rlpipe.rollout.batch import filter_groups, table_to_samples
        from rlpipe.storage.schemas import TRAJECTORY_SCHEMA

        tables = [self.store.read_stage(run_key(self.store, p, self.run_id), schema=TRAJECTORY_SCHEMA) for p in cmd["stages"]]
        dyn: dict[str, float] = {}
        if cmd.get("dynamic_batch"):
            table, dyn = filter_groups(tables, cmd["dynamic_batch"])
        else:
            table = pa.concat_tables(tables)
        dyn["samples_generated"] = float(sum(t.num_rows for t in tables))
        return table_to_samples(table, bool(cmd.get("step_rewards"))), dyn

    def _update(self, cmd: dict[str, Any]) -> dict[str, Any]:
        start, err, samples, extra = time.perf_counter(), None, None, {}
        try:
            samples, extra = self._read(cmd)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it before the optimizer steps
            err = e
        self._agree(err, "reading the trajectories")
        read_s, start = time.perf_counter() - start, time.perf_counter()
        metrics = self.trainer.update(samples, cmd["iteration"]) | extra
        update_s = time.perf_counter() - start
        if self.rank == 0 and os.environ.get("RLPIPE_TRAINER_FAULT") == str(cmd["iteration"]):
            os.kill(os.getpid(), 9)  # test hook: the service dies after the optimizer steps, before the state is saved
        if int(metrics.get("nonfinite_steps", 0)) >= self.trainer.cfg.max_nonfinite_steps:
            return {"metrics": metrics, "saved": False, "read_s": read_s, "update_s": update_s}
        return self._save(cmd, metrics) | {"read_s": read_s, "update_s": update_s}

    def _save(self, cmd: dict[str, Any], metrics: dict[str, float]) -> dict[str, Any]:
        """Each rank saves into its own folder and uploads what it wrote; rank 0 marks the state whole last."""
        import torch.distributed as dist

        from rlpipe.resume import RunState

        start, k = time.perf_counter(), cmd["iteration"]
        state = RunState(self.store, self.workdir, self.run_id)
        prefix, local = state.checkpoint_prefix(k), self.workdir / f"rank{self.rank}" / f"state-{k}"
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True)
        digest = self.trainer.save(local, extra_state=cmd.get("extra_state") or {})
        save_s, start = time.perf_counter() - start, time.perf_counter()
        if self.rank == 0:
            self.store.delete(prefix)
        if self.world > 1:
            dist.barrier()
        files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
        for rel in files:
            self.store.put_bytes(f"{prefix}/{rel}", (local / rel).read_bytes())
        everyone = [files]
        if self.world > 1:
            everyone = [None] * self.world
            dist.all_gather_object(everyone, files)
        if self.rank == 0:
            state.mark_complete(k, digest, sorted({f for fs in everyone for f in fs}))
        shutil.rmtree(local, ignore_errors=True)
        self.version = digest
        return {"metrics": metrics, "saved": True, "weights_sha256": digest, "state_prefix": prefix,
                "state_uri": self.store.url(prefix), "save_s": save_s, "upload_s": time.perf_counter() - start}

    def _logprobs(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return {"logprobs": self.trainer.sequence_logprobs(cmd["prompts"], cmd["continuations"]), "version": self.version}


def rank_loop(ranks: TrainerRanks, inbox: "queue.Queue | None", stop: threading.Event | None = None) -> None:
    """Every rank: take the next command (rank 0 from its inbox, the others from rank 0), execute it, and
    on rank 0 hand the result to the waiting request. Ends on a ``stop`` command."""
    import torch.distributed as dist

    while True:
        fut, box = None, [None]
        if ranks.rank == 0:
            fut, cmd = _next(inbox, stop)
            box = [cmd]
        if ranks.world > 1:
            dist.broadcast_object_list(box, src=0)
        cmd = box[0]
        if cmd["op"] == "stop":
            return
        try:
            result, err = ranks.execute(cmd), None
        except Exception as e:  # noqa: BLE001 - the request fails, the service goes on
            log.exception("trainer rank %d: %s failed", ranks.rank, cmd["op"])
            result, err = None, e
        if fut is not None:
            settle(fut, result, err)


def _next(inbox: "queue.Queue", stop: threading.Event | None) -> tuple[Future | None, dict[str, Any]]:
    """Rank 0's next command: a request, a stop, or a ping after ``PING_S`` idle seconds."""
    idle_since = time.monotonic()
    while True:
        if stop is not None and stop.is_set():
            return None, {"op": "stop"}
        try:
            return inbox.get(timeout=1.0)
        except queue.Empty:
            if time.monotonic() - idle_since >= PING_S:
                return None, {"op": "ping"}


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
                | {"world": self.ranks.world} | s.percentiles() | {"queue": self.inbox.qsize(), "in_flight": self.in_flight})

    def close(self) -> None:
        self.stop.set()


class Artifact(BaseModel):
    uri: str = Field(min_length=1, description="Object-store URI (or key) of a folder under runs/<run_id>/.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="The sha256 of the folder's weights (rlpipe's tensor hash).")


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
            f"--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "rlpipe.services.trainer",
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
