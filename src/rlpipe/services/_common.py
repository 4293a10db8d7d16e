"""What rlpipe's HTTP services share: counters with latency percentiles, and handing a result to a
request that may have given up already."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Any


class Counters:
    """Named integer counters and a window of request latencies, safe across threads."""

    def __init__(self, *names: str, window: int = 4096):
        self.lock = threading.Lock()
        self.latencies: deque = deque(maxlen=window)
        for n in names:
            setattr(self, n, 0)

    def add(self, **counts: int) -> None:
        with self.lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def latency(self, seconds: float) -> None:
        with self.lock:
            self.latencies.append(seconds)

    def percentile(self, q: float) -> float | None:
        with self.lock:
            xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def settle(fut: Future, result: Any = None, exception: BaseException | None = None) -> None:
    """Hand a batch's outcome to its request, unless that request already gave up on it."""
    try:
        if exception is not None:
            fut.set_exception(exception)
        else:
            fut.set_result(result)
    except InvalidStateError:  # cancelled or already settled: nobody waits for it
        pass
