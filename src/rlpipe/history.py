"""A run's per-iteration metrics, kept so that an iteration late in a run costs what an early one costs.

Locally ``runs/<id>/history.jsonl``: one JSON object per line, ``{"iteration": k, ...metrics}``. Lines are
only appended. A later line of the same iteration adds to the earlier ones (the parent flow adds its
outer timing after the iteration's own line); :meth:`RunHistory.read` merges them. Recording iteration
``k`` again — a redo after a kill — first drops every line of iterations ``>= k``: a rewrite that only a
redo pays. A line torn by a kill mid-write is dropped before the next append.

The object store gets the bytes appended since its last save point at each save point
(``runs/<id>/history/iter=<k>.jsonl``, see :class:`rlpipe.resume.RunState`); a resume on another machine
concatenates those segments. Nothing per iteration reads or writes the whole history: the alert rules and
the reward circuit breaker read a bounded :meth:`RunHistory.tail`, and only the run's summary reads it all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlpipe.storage.atomic import write_atomic

__all__ = ["RunHistory", "merge", "read_history"]

_CHUNK = 1 << 16


def merge(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per iteration, in iteration order; later lines of an iteration update earlier ones."""
    by_iteration: dict[int, dict[str, Any]] = {}
    for line in lines:
        by_iteration.setdefault(int(line["iteration"]), {}).update(line)
    return [by_iteration[k] for k in sorted(by_iteration)]


class RunHistory:
    """The append-only history file of one run (see the module docstring)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    # -- writing ----------------------------------------------------------------------------------
    def add(self, iteration: int, metrics: dict[str, Any]) -> None:
        """Iteration ``iteration``'s record; any records of it or later iterations (a redo) go first."""
        last = self.last_iteration()
        if last is not None and last >= iteration:
            self._keep_before(iteration)
        self._append({"iteration": iteration} | metrics)

    def extend(self, iteration: int, metrics: dict[str, Any]) -> None:
        """More metrics for a recorded iteration (merged into its record on reading)."""
        self._append({"iteration": iteration} | metrics)

    def replace(self, data: bytes) -> None:
        """The whole file (a resume that fetched the history from the store)."""
        write_atomic(self.path, data, fsync=False)

    def _append(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_torn_line()
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True, allow_nan=True) + "\n")

    def _drop_torn_line(self) -> None:
        """A kill mid-append leaves a line without its newline: cut it, or the next line would join it."""
        size = self.size()
        if not size:
            return
        with self.path.open("rb+") as f:
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            start = max(0, size - _CHUNK)
            while True:
                f.seek(start)
                cut = f.read(size - start).rfind(b"\n")
                if cut >= 0 or start == 0:
                    f.truncate(start + cut + 1 if cut >= 0 else 0)
                    return
                start = max(0, start - _CHUNK)

    def _keep_before(self, iteration: int) -> None:
        kept = [line for line in self._lines() if line["iteration"] < iteration]
        self.replace("".join(json.dumps(x, sort_keys=True) + "\n" for x in kept).encode())

    # -- reading ----------------------------------------------------------------------------------
    def size(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def bytes_from(self, offset: int) -> bytes:
        """What was appended after ``offset`` (the last save point's upload)."""
        if not self.path.exists():
            return b""
        with self.path.open("rb") as f:
            f.seek(offset)
            return f.read()

    def read(self) -> list[dict[str, Any]]:
        """Every iteration's merged record, oldest first."""
        return merge(self._lines())

    def tail(self, n: int) -> list[dict[str, Any]]:
        """The last ``n`` iterations' merged records, oldest first; reads from the file's end, so its cost
        does not grow with the run."""
        if n <= 0 or not self.path.exists():
            return []
        size, span = self.size(), _CHUNK
        while True:
            start = max(0, size - span)
            with self.path.open("rb") as f:
                f.seek(start)
                raw = f.read(size - start)
            lines = raw.split(b"\n")
            if start > 0:
                lines = lines[1:]  # the first may be cut
            records = merge(_parse(lines))
            if start == 0 or len(records) > n:  # one more than asked: the first may lack an earlier line
                return records[-n:]
            span *= 4

    def last_iteration(self) -> int | None:
        last = self.tail(1)
        return last[-1]["iteration"] if last else None

    def _lines(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return _parse(self.path.read_bytes().split(b"\n"))


def _parse(lines: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for raw in lines:
        if not raw.strip():
            continue
        try:
            out.append(json.loads(raw))
        except json.JSONDecodeError:  # only a torn last line can be cut; it is dropped before the next append
            continue
    return out


def read_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """A run folder's merged history (``<run_dir>/history.jsonl``)."""
    return RunHistory(Path(run_dir) / "history.jsonl").read()
