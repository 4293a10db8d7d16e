"""What every rank of the trainer service executes (:mod:`rlpipe.services.trainer` is rank 0's HTTP front).

How the ranks work together: the HTTP handlers on rank 0 validate a request and queue it; rank 0's main
thread broadcasts each command to every rank (``broadcast_object_list``), all ranks execute it, and rank 0
hands the result back. Idle ranks hear a ping every ``PING_S`` so no collective waits past its timeout.
Nothing assumes a shared filesystem: each rank downloads and uploads its own files. A rank that fails a
step tells the others (:meth:`TrainerRanks._agree`), so no rank is left waiting in a collective.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from rlpipe.services._common import settle

log = logging.getLogger(__name__)

PING_S = 30.0


def run_key(store: Any, uri: str, run_id: str) -> str:
    """The store key of ``uri``; PermissionError unless it lies under ``runs/<run_id>/`` of this store."""
    key = store.key_of(uri) if "://" in uri or uri.startswith("/") else uri.strip("/")
    if key is None or not key.startswith(f"runs/{run_id}/") or ".." in key.split("/"):
        raise PermissionError(f"{uri} is not under runs/{run_id}/ of this service's object store "
                              f"{store.url('runs')}: the trainer reads and writes only the run's own prefix")
    return key


class TrainerRanks:
    """One rank's side: the trainer it holds and the commands it executes in step with the others."""

    def __init__(self, store: Any, workdir: Path, rank: int, world: int):
        self.store, self.workdir, self.rank, self.world = store, Path(workdir), rank, world
        self.trainer: Any = None
        self.run_id: str | None = None
        self.version: str | None = None
        self.buckets: tuple[str, list[bytes]] | None = None  # rank 0: the weights of the last update, to stream

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
        from rlpipe.storage.weights import file_weights_digest

        if art is None:
            return None
        dest = self.workdir / f"rank{self.rank}" / name
        shutil.rmtree(dest, ignore_errors=True)
        self.store.download_dir(run_key(self.store, art["uri"], run_id), dest)
        (dest / STATE_DONE).unlink(missing_ok=True)
        got = file_weights_digest(dest)
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
        self.trainer, self.run_id, self.buckets = None, None, None
        self.trainer = PolicyTrainer(model_dir=dirs["policy"], cfg=TrainConfig(**train), temperature=cmd["temperature"],
                                     seed=cmd["seed"], ref_model_dir=dirs["ref"], resume_dir=dirs["resume"],
                                     max_new_tokens=cmd.get("max_new_tokens"))
        self.run_id = run_id
        self.version = (cmd["resume"] or cmd["policy"])["sha256"]
        out = {"version": self.version, "world": self.world, "iteration": self.trainer.state.get("iteration")}
        if self.trainer.cfg.precision == "bf16_weights":  # start weights rounded to bfloat16: streamed as an update's
            handed = self._handoff({})
            out |= {"version": handed["weights_sha256"], "buckets": handed["buckets"]}
        return out

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
        out = self._handoff(metrics)
        if cmd.get("save", True):  # a save point: the resumable state into the store
            out |= self._save(cmd, metrics)
        return out | {"read_s": read_s, "update_s": update_s}

    def _handoff(self, metrics: dict[str, float]) -> dict[str, Any]:
        """The new weights, hashed once and cut into buckets that rank 0 serves (``GET /weights/{sha}/{k}``) until
        the next update: the sync streams them from here, never through the store."""
        from rlpipe.storage.weight_stream import encode_buckets

        start = time.perf_counter()
        digest, tensors = self.trainer.policy_tensors()  # every rank: under ZeRO-3 they gather onto rank 0
        if self.rank == 0:
            self.buckets = (digest, encode_buckets(tensors))
        self.version = digest
        return {"metrics": metrics, "saved": False, "weights_sha256": digest,
                "buckets": len(self.buckets[1]) if self.rank == 0 else 0, "handoff_s": time.perf_counter() - start}

    def bucket(self, sha256: str, k: int) -> bytes:
        """Bucket ``k`` of the weights ``sha256`` (rank 0): LookupError when they are not the ones held now."""
        if self.buckets is None or self.buckets[0] != sha256:
            held = self.buckets[0][:12] if self.buckets else "none"
            raise LookupError(f"the trainer serves weights {held}, not {sha256[:12]}: an update since replaced them")
        if not 0 <= k < len(self.buckets[1]):
            raise ValueError(f"bucket {k} out of range: the weights {sha256[:12]} come in {len(self.buckets[1])} bucket(s)")
        return self.buckets[1][k]

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
