"""Work started on a thread of its own, its result or error in a future: a save written while the run goes on,
a batch generated ahead, the new weights hashed while an engine takes them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["done", "on_thread"]


def on_thread(work: Callable[[], Any], name: str) -> Future:
    """``work`` started on a daemon thread; its result or error in the future returned."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as e:  # noqa: BLE001 - handed to whoever joins it
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def done(value: Any) -> Future:
    """A future that already holds ``value`` (for a caller that takes a future where the work was done here)."""
    future: Future = Future()
    future.set_result(value)
    return future
