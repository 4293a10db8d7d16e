"""A value computed on first use, once per process, by whichever thread asks first.

The sandbox probes the machine and compiles its seccomp filter lazily (nothing happens at import
time) and both are slow, so each is made once and shared; threads that ask meanwhile wait for it.
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Once(Generic[T]):
    """``make()`` run on the first :meth:`get`; a call that raises leaves nothing cached."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._value: T | None = None

    def get(self) -> T:
        with self._lock:
            if self._value is None:
                self._value = self._make()
            return self._value

    def peek(self) -> T | None:
        """The value if it was made already, else None (never makes it)."""
        return self._value
