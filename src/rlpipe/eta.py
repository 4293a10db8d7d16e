"""Progress of long work as a person reads it: ``k/N``, the recent pace and the time left.

The pace is the mean over a window of the latest steps, so one slow step (a held-out evaluation, a save
point) moves the estimate without owning it, and a resumed run estimates from its own steps, not from a
clock that started before the resume.
"""

from __future__ import annotations

import time
from collections import deque


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``: short enough for a log line, exact enough to plan by."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


class Eta:
    """Counts steps toward ``total`` and estimates the time left from the pace of the latest ``window`` steps.

    ``done`` is how many steps were complete when this began (a resume): the pace is measured only over
    steps seen here, from the clock at construction on.
    """

    def __init__(self, total: int, done: int = 0, window: int = 20, now: float | None = None) -> None:
        if total < 0 or not 0 <= done <= total:
            raise ValueError(f"progress: done={done} is not within 0..total={total}")
        self.total, self.done = total, done
        self._marks: deque[tuple[float, int]] = deque([(_clock(now), done)], maxlen=max(1, window) + 1)

    def tick(self, done: int | None = None, now: float | None = None) -> str:
        """Steps are done up to ``done`` (default: one more) at ``now``; returns the progress line."""
        self.done = self.done + 1 if done is None else done
        self._marks.append((_clock(now), self.done))
        return self.line()

    @property
    def pace(self) -> float | None:
        """Seconds per step over the window; None before the first step is timed."""
        (t0, d0), (t1, d1) = self._marks[0], self._marks[-1]
        return (t1 - t0) / (d1 - d0) if d1 > d0 else None

    @property
    def left_s(self) -> float | None:
        return None if self.pace is None else self.pace * max(self.total - self.done, 0)

    def line(self) -> str:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        if self.pace is None:
            return f"{self.done}/{self.total} ({pct:.0f}%)"
        return f"{self.done}/{self.total} ({pct:.0f}%), {self.pace:.2f} s each, ETA {format_duration(self.left_s or 0.0)}"


def _clock(now: float | None) -> float:
    return time.monotonic() if now is None else now
