"""Resume rules: where a run's progress and resumable state live, and what a resume may change.

A run's progress (``progress.json``) is kept in two places:

- the local run folder (``$RLPIPE_HOME/runs/<id>/``), updated after every iteration, with the trainer's
  full state of the last iteration beside it (``state/iter=<k>/``);
- the object store (``runs/<id>/progress.json``), written at each save point (``train.save_interval``)
  *after* that iteration's full resumable state (weights, tokenizer, optimizer and critic states, KL
  controller, RNG, iteration) is complete under ``runs/<id>/checkpoints/iter=<k>/``.

A resume takes the local progress when its state folder is there and holds the recorded weights, and
otherwise the store's (another machine, a cleaned folder): it downloads the state of the last save point
and redoes the iterations after it. A resume whose config or dataset differs from the run's is refused
with the changed keys unless explicitly allowed; ``train.total_iterations`` may grow freely.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlpipe.config import RunConfig, canonical_json
from rlpipe.history import RunHistory
from rlpipe.progress import Progress

if TYPE_CHECKING:
    from rlpipe.runs import RunFolder

__all__ = ["ADDED_KEYS", "EXTENDABLE_KEYS", "ResumeRefused", "RunState", "config_changes", "resume_fingerprint"]

# Keys a resume may change without being a different experiment.
EXTENDABLE_KEYS = frozenset({"train.total_iterations"})
# Sections that watch, tidy or place a run without steering it (alerts, retention, where its services run,
# when an on-policy batch is generated): free to change on a resume.
OPERATIONAL_PREFIXES = ("alerts.", "retention.", "services.", "tracking.register_models", "tracking.stage_task_runs",
                        "rollout.prefetch", "train.async_save")


# Keys added after runs were recorded without them, each with its value that is the behaviour from before it
# existed: a run recorded without the key resumes at that value unchanged (upgrading rlpipe does not refuse the
# resume, nor redo the interrupted iteration's stages); any other value is a change like any other.
ADDED_KEYS: dict[str, Any] = {"train.precision": "fp32", "train.shuffle": "samples", "data.redact": False}


def _steers(key: str) -> bool:
    return key not in EXTENDABLE_KEYS and not key.startswith(OPERATIONAL_PREFIXES)


def _as_before(key: str, value: Any) -> bool:
    return key in ADDED_KEYS and value == ADDED_KEYS[key]


STATE_DONE = "_state_complete.json"  # written last: the state above it is whole


class ResumeRefused(RuntimeError):
    """A resume would silently change the experiment (config or dataset)."""


def resume_fingerprint(config: RunConfig) -> str:
    """The fingerprint a resume and a stored stage must match: the config without the extendable keys."""
    flat = {k: v for k, v in config.flat().items() if _steers(k) and not _as_before(k, v)}
    return hashlib.sha256(canonical_json(flat).encode()).hexdigest()


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key: old → new`` for every dotted key that differs, extendable and operational keys left out (a key
    of ADDED_KEYS missing from ``old`` counts as its value from before it existed)."""
    old = {k: v for k, v in ADDED_KEYS.items() if k not in old} | old
    keys = sorted(k for k in set(old) | set(new) if _steers(k))
    return [f"{k}: {old.get(k, '<absent>')!r} → {new.get(k, '<absent>')!r}" for k in keys if old.get(k) != new.get(k)]


def check_resume(progress: Progress, config: RunConfig, dataset_version: str, allow_change: bool) -> list[str]:
    """The changes this resume makes (empty: none). Raises :class:`ResumeRefused` unless allowed."""
    changes = []
    if progress.config is not None:
        changes = config_changes(progress.config, config.flat())
    elif progress.resume_fingerprint not in (None, resume_fingerprint(config)):
        changes = ["config: fingerprint differs (the saved progress has no key list)"]
    if progress.dataset_version not in (None, dataset_version):
        changes.append(f"dataset_version: {progress.dataset_version[:16]} → {dataset_version[:16]}")
    if changes and not allow_change:
        shown = "\n  ".join(changes[:20]) + ("\n  …" if len(changes) > 20 else "")
        raise ResumeRefused(
            f"this run was started with a different config or dataset; {len(changes)} change(s):\n  {shown}\n"
            "Resume with the run's own config, start a new --run-id, or pass --allow-config-change to continue "
            "with the change (it is recorded in MLflow)")
    return changes


class RunState:
    """A run's progress and resumable state, locally and in the object store."""

    def __init__(self, store: Any, folder: "RunFolder | Path", run_id: str):
        from rlpipe.runs import RunFolder
        from rlpipe.storage.layout import checkpoint_prefix, run_prefix

        self.folder = folder if isinstance(folder, RunFolder) else RunFolder(folder)
        self.store, self.run_id = store, run_id
        self.progress_key = f"{run_prefix(run_id)}/progress.json"
        self.history_prefix = f"{run_prefix(run_id)}/history"
        self._checkpoint = lambda k: checkpoint_prefix(run_id, f"iter={k}")

    @property
    def history(self) -> RunHistory:
        return self.folder.history

    # -- progress -----------------------------------------------------------------------------
    def read_local(self) -> Progress | None:
        return self.folder.read_progress()

    def write_local(self, progress: Progress) -> None:
        self.folder.write_progress(progress)

    def read_saved(self) -> Progress | None:
        if not self.store.exists(self.progress_key):
            return None
        return Progress.from_dict(self.store.get_json(self.progress_key), self.store.url(self.progress_key))

    # -- the state of a save point --------------------------------------------------------------
    def checkpoint_prefix(self, iteration: int) -> str:
        return self._checkpoint(iteration)

    def state_complete(self, iteration: int, weights_sha256: str) -> bool:
        key = f"{self._checkpoint(iteration)}/{STATE_DONE}"
        return self.store.exists(key) and self.store.get_json(key).get("weights_sha256") == weights_sha256

    def upload_state(self, local: Path, iteration: int, weights_sha256: str) -> str:
        """Upload a state folder; a marker written last says it is whole (a redo skips a whole one)."""
        prefix = self._checkpoint(iteration)
        if self.state_complete(iteration, weights_sha256):
            return self.store.url(prefix)
        # A local store links the state's files (nothing writes over them: Spare.take skips a file with two names).
        uri = self.store.upload_dir(local, prefix, link=True)
        self.mark_complete(iteration, weights_sha256, sorted(p.relative_to(local).as_posix() for p in Path(local).rglob("*")
                                                             if p.is_file()))
        return uri

    def mark_complete(self, iteration: int, weights_sha256: str, files: list[str]) -> None:
        """The marker that says the state of ``iteration`` is whole in the store: written after every file."""
        self.store.put_json(f"{self._checkpoint(iteration)}/{STATE_DONE}", {"weights_sha256": weights_sha256, "files": files})

    def save_point(self, progress: Progress) -> Progress:
        """Record in the store that the run can resume after ``progress['completed_iteration']``: first the
        history appended since the last save point (``history/iter=<k>.jsonl``), then the progress. Returns
        the progress with the history's uploaded length (``history_bytes``)."""
        k = progress.completed_iteration
        if not self.state_complete(k, progress.weights_sha256):
            raise RuntimeError(f"save point {k} of run {self.run_id}: its state is not complete in the store")
        since = progress.history_bytes
        appended = self.history.bytes_from(since)
        self.store.put_bytes(f"{self.history_prefix}/iter={k:08d}.jsonl", appended)
        progress = progress.but(history_bytes=since + len(appended))
        self.store.put_json(self.progress_key, progress.but(resume_state=self._checkpoint(k)).to_dict())
        return progress

    def history_out_of_progress(self, progress: Progress) -> Progress:
        """A run started before ``history.jsonl`` kept its history inside ``progress.json``: move it out once
        (the next save point uploads all of it as one segment)."""
        if progress.history is None:
            return progress
        self.history.replace("".join(json.dumps(h, sort_keys=True) + "\n" for h in progress.history).encode())
        progress = progress.but(history=None, history_bytes=0)
        self.write_local(progress)
        return progress

    def fetch_history(self, progress: Progress) -> Progress:
        """This machine's history from the store's segments up to the save point; the progress with its length."""
        k = progress.completed_iteration
        keys = sorted(key for key in self.store.list(self.history_prefix)
                      if int(key.rsplit("iter=", 1)[1].split(".")[0]) <= k)
        self.history.replace(b"".join(self.store.get_bytes(key) for key in keys))
        return progress.but(history_bytes=self.history.size())

    def fetch_state(self, progress: Progress, dest: Path) -> Path:
        """Download the save point's state into ``dest`` (replaced) and check its weights."""
        import shutil

        from rlpipe.storage.weights import file_digest_matches, file_weights_digest

        if dest.exists():
            shutil.rmtree(dest)
        self.store.download_dir(progress.resume_state, dest)
        (dest / STATE_DONE).unlink(missing_ok=True)
        if not file_digest_matches(dest, progress.weights_sha256):
            raise RuntimeError(f"{self.store.url(progress.resume_state)} holds weights {file_weights_digest(dest)[:12]}, "
                               f"its progress records {progress.weights_sha256[:12]}")
        return dest

    def local_state_ok(self, progress: Progress) -> bool:
        from rlpipe.storage.weights import file_digest_matches

        folder = progress.resume_dir
        if not folder:  # before the first save point: the run's start policy, which is not saved here
            return progress.completed_iteration == -1
        if not Path(folder).is_dir():
            return False
        try:
            return file_digest_matches(folder, progress.weights_sha256)
        except FileNotFoundError:
            return False
