"""Trajectory and prompt schemas, the object store (local folder or S3), and the run layout."""

from rlpipe.storage.schemas import PROMPT_SCHEMA, TRAJECTORY_SCHEMA, REWARD_STATUSES
from rlpipe.storage.store import ObjectStore, StageNotFound, open_store

__all__ = ["PROMPT_SCHEMA", "TRAJECTORY_SCHEMA", "REWARD_STATUSES", "ObjectStore", "StageNotFound", "open_store"]
