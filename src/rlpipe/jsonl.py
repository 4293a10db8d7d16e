"""Reading JSON-lines files one object per line, with errors that name the line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def jsonl_objects(path: Path, error: type[Exception]) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; ``error`` names the line that is not a JSON object."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{path} line {n}: not valid JSON ({e.msg}); each line must be one JSON object") from None
        if not isinstance(obj, dict):
            raise error(f"{path} line {n}: expected a JSON object, got {type(obj).__name__}")
        out.append((n, obj))
    return out
