"""Run identity and the run folder under ``$RLPIPE_HOME/runs/<id>/``.

:class:`RunFolder` owns what a run keeps on this machine: ``progress.json`` (where the run stands, see
:class:`rlpipe.resume.RunState` for the store's copy), ``history.jsonl`` (per-iteration metrics), ``state/``
(save points and the spare the next save writes over), ``summary.json`` and ``report.html``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from rlpipe.config import Settings
from rlpipe.history import RunHistory
from rlpipe.progress import Progress
from rlpipe.storage.atomic import write_atomic, write_json_atomic
from rlpipe.storage.layout import check_run_id

__all__ = ["RunFolder", "new_run_id", "write_summary"]


def new_run_id(kind: str) -> str:
    return f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


class RunFolder:
    """One run's folder on this machine (see the module docstring)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @classmethod
    def of(cls, s: Settings, run_id: str) -> "RunFolder":
        return cls(s.run_dir(check_run_id(run_id)))

    # -- progress -------------------------------------------------------------------------------
    @property
    def progress_path(self) -> Path:
        return self.path / "progress.json"

    def read_progress(self) -> Progress | None:
        return _read(self.progress_path)

    def write_progress(self, progress: Progress) -> None:
        """Every iteration, not synced to disk (a power cut may lose the last iteration's line); ``resume.json``,
        synced, is what a resume continues from."""
        _write(self.progress_path, progress, fsync=False)

    @property
    def resume_path(self) -> Path:
        """The progress as of the last save point (or the run's start): what a resume continues from."""
        return self.path / "resume.json"

    def read_resume(self) -> Progress | None:
        return _read(self.resume_path)

    def write_resume(self, progress: Progress) -> None:
        _write(self.resume_path, progress, fsync=True)

    # -- history --------------------------------------------------------------------------------
    @property
    def history(self) -> RunHistory:
        """The per-iteration metrics (``history.jsonl``, append-only)."""
        return RunHistory(self.path / "history.jsonl")

    # -- save points ----------------------------------------------------------------------------
    def state_dir(self, iteration: int) -> Path:
        return self.path / "state" / f"iter={iteration}"

    @property
    def spare_state_dir(self) -> Path:
        """The last save point no longer needed: the next save writes its files over this one's (RecyclingWrites)."""
        return self.path / "state" / "spare"

    def prune_states(self, keep: str | Path | list[str | Path]) -> None:
        """Only ``keep`` (one folder or several) stays; the newest other one becomes the spare that the next save
        writes over (its pages reused, see RecyclingWrites), the rest are deleted."""
        kept = {str(k) for k in (keep if isinstance(keep, list) else [keep])}
        old = sorted((d for d in (self.path / "state").glob("iter=*") if str(d) not in kept),
                     key=lambda d: int(d.name.partition("=")[2]))
        if not old:
            return
        shutil.rmtree(self.spare_state_dir, ignore_errors=True)
        try:
            os.replace(old[-1], self.spare_state_dir)
        except OSError:  # a spare that could not be removed: no recycling next time, the old point still goes
            shutil.rmtree(old[-1], ignore_errors=True)
        for d in old[:-1]:
            shutil.rmtree(d, ignore_errors=True)

    # -- what a finished run leaves --------------------------------------------------------------
    @property
    def summary_path(self) -> Path:
        return self.path / "summary.json"

    @property
    def report_path(self) -> Path:
        return self.path / "report.html"

    def write_summary(self, run_id: str, summary: dict[str, Any]) -> Path:
        """``summary.json``, written atomically; returns its absolute path."""
        return write_json_atomic(self.summary_path, {"run_id": run_id} | summary, fsync=False)


def write_summary(s: Settings, run_id: str, summary: dict[str, Any]) -> Path:
    """Write ``runs/<run_id>/summary.json`` atomically; returns its absolute path."""
    return RunFolder.of(s, run_id).write_summary(run_id, summary)


def _read(path: Path) -> Progress | None:
    return Progress.from_dict(json.loads(path.read_text()), str(path)) if path.exists() else None


def _write(path: Path, progress: Progress, fsync: bool) -> None:
    write_atomic(path, json.dumps(progress.to_dict(), indent=2, sort_keys=True), fsync=fsync)
