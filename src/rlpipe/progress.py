"""Where an RL run stands: the record ``progress.json`` holds, typed.

It is written after every iteration on this machine (:class:`rlpipe.runs.RunFolder`) and, at each save
point, to the object store (:class:`rlpipe.resume.RunState`), which adds ``resume_state``. A resume reads
it back; a key this version does not know is an error that names the file and the key, never dropped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

__all__ = ["Progress"]


@dataclass(frozen=True)
class Progress:
    completed_iteration: int = -1  # -1: no iteration done yet
    resume_dir: str | None = None  # this machine's state folder of the last save point
    weights_sha256: str | None = None  # the policy after the last completed iteration (resume.json: the save point's)
    resume_state: str | None = None  # the store's copy of the last save point (the store's progress only)
    history_bytes: int = 0  # how much of history.jsonl the store holds (segments up to the last save point)
    last_registered: str | None = None  # the model version registered last
    reward_norm: dict[str, float] | None = None  # RLHF: the reward normaliser after the last iteration
    reward_model_version: str | None = None
    # What the run was started with (a resume compares them; an allowed change is recorded).
    dataset_version: str | None = None
    config_fingerprint: str | None = None
    resume_fingerprint: str | None = None
    config: dict[str, Any] | None = None  # the flat config as given
    config_changes: list[dict[str, Any]] = field(default_factory=list)
    # The base policy, evaluated before the first update, and the latest evaluation.
    heldout_n: int | None = None
    base_policy: str | None = None
    base_accuracy: float | None = None
    base_validation_accuracy: float | None = None
    base_true_score: float | None = None
    base_rm_score: float | None = None
    base_mean_steps: float | None = None
    base_tool_calls_per_episode: float | None = None
    final_accuracy: float | None = None
    final_validation_accuracy: float | None = None
    final_true_score: float | None = None
    final_rm_score: float | None = None
    final_mean_steps: float | None = None
    final_tool_calls_per_episode: float | None = None
    history: list[dict[str, Any]] | None = None  # runs from before history.jsonl kept it here (moved out on resume)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "progress.json") -> "Progress":
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(data) - known):
            raise ValueError(f"{where}: unknown key(s) {unknown}; this rlpipe knows {sorted(known)}. The file was written "
                             "by another rlpipe version: resume with that version, or remove the key(s) by hand")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: fields that are set (a None is left out, as a key never written)."""
        return {k: v for k, v in asdict(self).items() if v is not None and not (k == "config_changes" and not v)}

    def but(self, **changes: Any) -> "Progress":
        """A copy with ``changes``."""
        return replace(self, **changes)

    @property
    def started(self) -> bool:
        """Whether the run got past its base evaluation (its start is recorded)."""
        return self.base_accuracy is not None or self.completed_iteration >= 0
