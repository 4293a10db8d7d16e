"""A pool of killable verifier worker processes with a hard per-sample timeout.

Why processes: math-verify's own timeout uses ``signal.alarm``, which works only on a process's
main thread; scoring from a Prefect task thread would silently lose it (peers shipped all-zero
rewards that way). Here each sample runs on a worker's main thread, and the pool enforces a
wall-clock deadline from outside: a worker that overruns is SIGKILLed and replaced, and its
sample gets status ``timeout``. Concurrency is bounded by the number of workers.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from rlpipe.rewards.base import VerifyResult


@dataclass(frozen=True)
class VerifyItem:
    verifier: str
    response: str
    ground_truth: str | None


def _worker(conn: Connection, plugins: tuple[str, ...]) -> None:
    from rlpipe.rewards import get_verifier

    for mod in plugins:
        importlib.import_module(mod)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        idx, name, response, gt = msg
        try:
            res = get_verifier(name)(response, gt)
        except Exception as e:  # noqa: BLE001 - a verifier bug must not kill the pool
            res = VerifyResult(None, "error", f"{type(e).__name__}: {e}"[:200])
        conn.send((idx, res.reward, res.status, res.reason))


class _Worker:
    def __init__(self, ctx: Any, plugins: tuple[str, ...]):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, plugins), daemon=True)
        self.proc.start()
        child.close()
        self.job: int | None = None
        self.deadline = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class VerifierPool:
    """``score(items)`` → one :class:`VerifyResult` per item, in order; never raises on model output."""

    def __init__(self, workers: int = 2, timeout_s: float = 5.0, plugins: tuple[str, ...] = ()):
        if workers < 1:
            raise ValueError("a verifier pool needs at least one worker")
        # forkserver: workers fork from a small clean process, not from this one (which may hold
        # torch/vLLM threads), and a replacement starts in milliseconds.
        self._ctx = mp.get_context("forkserver" if os.name == "posix" else "spawn")
        if os.name == "posix":
            self._ctx.set_forkserver_preload(["rlpipe.rewards", *plugins])
        self.plugins = tuple(plugins)
        self.timeout_s = timeout_s
        self._workers = [_Worker(self._ctx, self.plugins) for _ in range(workers)]
        self.restarts = 0

    @property
    def size(self) -> int:
        return len(self._workers)

    def healthy(self) -> bool:
        return all(w.proc.is_alive() for w in self._workers)

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker(self._ctx, self.plugins)
        self.restarts += 1

    def score(self, items: list[VerifyItem]) -> list[VerifyResult]:
        results: list[VerifyResult | None] = [None] * len(items)
        queue = deque(range(len(items)))
        for i, w in enumerate(self._workers):
            if not w.proc.is_alive():
                self._replace(i)
        while queue or any(w.job is not None for w in self._workers):
            for w in self._workers:
                if w.job is None and queue:
                    j = queue.popleft()
                    it = items[j]
                    w.conn.send((j, it.verifier, it.response, it.ground_truth))
                    w.job, w.deadline = j, time.monotonic() + self.timeout_s
            busy = [w for w in self._workers if w.job is not None]
            timeout = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready = wait([w.conn for w in busy], timeout=timeout)
            for i, w in enumerate(self._workers):
                if w.job is None:
                    continue
                if w.conn in ready:
                    try:
                        idx, reward, status, reason = w.conn.recv()
                        results[idx] = VerifyResult(reward, status, reason)
                    except (EOFError, OSError):  # the worker died (e.g. OOM-killed) mid-sample
                        results[w.job] = VerifyResult(None, "error", "verifier worker died")
                        w.job = None
                        self._replace(i)
                        continue
                    w.job = None
                elif time.monotonic() >= w.deadline:
                    results[w.job] = VerifyResult(None, "timeout", f"no verdict within {self.timeout_s:g} s; worker killed")
                    w.job = None
                    self._replace(i)
        return [r if r is not None else VerifyResult(None, "error", "no verdict") for r in results]

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            w.proc.join(2)
            w.kill()
        self._workers = []

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
