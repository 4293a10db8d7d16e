"""Run identity and the run folder under ``$RLPIPE_HOME``: ids, ``summary.json``."""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from rlpipe.config import Settings
from rlpipe.storage.layout import check_run_id

__all__ = ["new_run_id", "write_summary"]


def new_run_id(kind: str) -> str:
    return f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def write_summary(s: Settings, run_id: str, summary: dict[str, Any]) -> Path:
    """Write ``runs/<run_id>/summary.json`` atomically; returns its absolute path."""
    folder = s.run_dir(check_run_id(run_id))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"run_id": run_id} | summary, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)
    return path

