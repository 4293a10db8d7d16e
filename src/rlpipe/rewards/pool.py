"""A pool of killable verifier worker processes with a hard per-sample timeout.

Why processes: math-verify's own timeout uses ``signal.alarm``, which works only on a process's
main thread; scoring from a Prefect task thread would silently lose it (peers shipped all-zero
rewards that way). Here each sample runs on a worker's main thread, and the pool enforces a
wall-clock deadline from outside: a worker that overruns is SIGKILLed and replaced, and its
sample gets status ``timeout``. Concurrency is bounded by the number of workers.

The deadline of each sample is the verifier's own declared budget for that item
(``Verifier.budget_s``) plus ``grace_s`` (process scheduling, sandbox start-up): the pool never
pre-empts a verdict the verifier would have given, so a program that hangs is scored 0 by its
verifier instead of being excluded as ``timeout`` (hanging must not pay better than failing).
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

import rlpipe.rewards  # noqa: F401 - registers the built-in verifiers, whose budgets the parent reads
from rlpipe.rewards.base import DEFAULT_BUDGET_S, VerifyResult, check_options, get_verifier


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
        idx, name, response, gt, options = msg
        try:
            res = get_verifier(name)(response, gt, **options)
        except Exception as e:  # noqa: BLE001 - a verifier bug must not kill the pool
            res = VerifyResult(None, "error", f"{type(e).__name__}: {e}"[:200])
        conn.send((idx, res.reward, res.status, res.reason, res.isolation))


class _Worker:
    def __init__(self, ctx: Any, plugins: tuple[str, ...]):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, plugins), daemon=True)
        self.proc.start()
        child.close()
        self.job: int | None = None
        self.deadline = 0.0
        self.limit = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class VerifierPool:
    """``score(items)`` → one :class:`VerifyResult` per item, in order; never raises on model output."""

    def __init__(self, workers: int = 2, grace_s: float = 5.0, plugins: tuple[str, ...] = (),
                 options: dict[str, dict[str, Any]] | None = None):
        if workers < 1:
            raise ValueError("a verifier pool needs at least one worker")
        if grace_s <= 0:
            raise ValueError("grace_s must be positive")
        for mod in plugins:  # the parent reads budgets, so it must know the plugins' verifiers too
            importlib.import_module(mod)
        self.options = {k: dict(v) for k, v in (options or {}).items()}
        check_options(self.options)
        # forkserver: workers fork from a small clean process, not from this one (which may hold
        # torch/vLLM threads), and a replacement starts in milliseconds, math-verify already imported.
        self._ctx = mp.get_context("forkserver" if os.name == "posix" else "spawn")
        if os.name == "posix":
            self._ctx.set_forkserver_preload(["rlpipe.rewards", "rlpipe.rewards._warm", *plugins])
        self.plugins = tuple(plugins)
        self.grace_s = grace_s
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

    def resolve_options(self, options: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
        """The options of one call: the pool's own, or ``options`` (checked: unknown ones raise ValueError)."""
        if options is None:
            return self.options
        check_options(options)
        return options

    def deadline_s(self, item: VerifyItem, options: dict[str, dict[str, Any]] | None = None) -> float:
        """The hard wall-clock limit of one item: its verifier's declared budget plus the grace period."""
        opts = self.resolve_options(options).get(item.verifier, {})
        try:
            budget = float(get_verifier(item.verifier).budget_s(item.ground_truth, **opts))
        except Exception:  # noqa: BLE001 - unknown verifier or unreadable reference: the worker reports it
            budget = DEFAULT_BUDGET_S
        return budget + self.grace_s

    def score(self, items: list[VerifyItem], options: dict[str, dict[str, Any]] | None = None) -> list[VerifyResult]:
        """Verdicts in order; ``options`` (per verifier name) replace the pool's own for this call."""
        options = self.resolve_options(options)
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
                    w.conn.send((j, it.verifier, it.response, it.ground_truth, options.get(it.verifier, {})))
                    w.limit = self.deadline_s(it, options)
                    w.job, w.deadline = j, time.monotonic() + w.limit
            busy = [w for w in self._workers if w.job is not None]
            timeout = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready = wait([w.conn for w in busy], timeout=timeout)
            for i, w in enumerate(self._workers):
                if w.job is None:
                    continue
                if w.conn in ready:
                    try:
                        idx, reward, status, reason, isolation = w.conn.recv()
                        results[idx] = VerifyResult(reward, status, reason, isolation)
                    except (EOFError, OSError):  # the worker died (e.g. OOM-killed) mid-sample
                        results[w.job] = VerifyResult(None, "error", "verifier worker died")
                        w.job = None
                        self._replace(i)
                        continue
                    w.job = None
                elif time.monotonic() >= w.deadline:
                    results[w.job] = VerifyResult(None, "timeout", f"verifier {items[w.job].verifier!r} gave no verdict within "
                                                  f"its budget + grace ({w.limit:g} s); worker killed")
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
