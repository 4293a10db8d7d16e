"""Personal data and secrets in data files: a finding per value (row, field, kind), and a de-identified copy.

Prompt, preference and trajectory tables are scanned alike: every text value of a row, nested ones too
(a trajectory's ``steps[2].observation``, a chat prompt's messages), except the identifiers in
:data:`IDENTIFIERS` (ids, splits, verifier names, weight hashes), which are neither personal nor free text.
A finding never carries the value in full (:meth:`~rlpipe.data.pii.PiiFinding.masked`). The detection
rules and what they do not catch are in :mod:`rlpipe.data.pii`.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlpipe.data.pii import find_pii, redact
from rlpipe.data.prompts import Finding
from rlpipe.storage.atomic import write_atomic

__all__ = ["IDENTIFIERS", "PersonalDataFinding", "pii_findings", "redact_file", "redact_table", "redact_value",
           "is_trajectory_file"]

IDENTIFIERS = frozenset({
    "id", "task", "split", "chat", "run_id", "prompt_id", "policy_version", "verifier", "verifier_version",
    "reward_status", "isolation",
})
FIX = "remove it from the row, or write a de-identified copy with --redact OUT"


@dataclass(frozen=True)
class PersonalDataFinding(Finding):
    kind: str = ""  # a kind of rlpipe.data.pii.KINDS


def _texts(value: Any, field: str) -> Iterator[tuple[str, str]]:
    """(field path, text) of every string in a row value: ``prompt``, ``steps[2].observation``."""
    if isinstance(value, str):
        yield field, value
    elif isinstance(value, dict):
        for key, v in value.items():
            if key not in IDENTIFIERS:
                yield from _texts(v, f"{field}.{key}" if field else key)
    elif isinstance(value, list) and not _numbers(value):
        for i, v in enumerate(value):
            yield from _texts(v, f"{field}[{i}]")


def _numbers(value: list[Any]) -> bool:
    """Token ids, log-probs, masks: a list whose first item is a number holds no text (and is long)."""
    return bool(value) and isinstance(value[0], (int, float))


def _row_id(row: dict[str, Any], n: int) -> str:
    if "prompt_id" in row and "sample_index" in row:  # a trajectory: the prompt's id and which sample of it
        return f"{row['prompt_id']}#{row['sample_index']}"
    return str(row["id"]) if row.get("id") else f"line {n}"


def pii_findings(table: pa.Table) -> list[PersonalDataFinding]:
    """One finding per personal datum or secret in the table, naming the row, the field and the kind."""
    found = []
    for n, row in enumerate(table.to_pylist(), start=1):
        rid = _row_id(row, n)
        for field, text in _texts(row, ""):
            for f in find_pii(text):
                found.append(PersonalDataFinding(rid, field, f"{f.kind.replace('_', ' ')} {f.masked()}", FIX, f.kind))
    return found


def redact_value(value: Any, key: str = "") -> tuple[Any, int]:
    """``value`` with every text (nested too, identifiers left alone) redacted, and how many texts changed."""
    if key in IDENTIFIERS:
        return value, 0
    if isinstance(value, str):
        out = redact(value)
        return out, int(out != value)
    if isinstance(value, dict):
        pairs = {k: redact_value(v, k) for k, v in value.items()}
        return {k: v for k, (v, _) in pairs.items()}, sum(n for _, n in pairs.values())
    if isinstance(value, list) and not _numbers(value):
        pairs = [redact_value(v) for v in value]
        return [v for v, _ in pairs], sum(n for _, n in pairs)
    return value, 0


def redact_table(table: pa.Table) -> tuple[pa.Table, int]:
    """The table with every text value redacted (same schema), and how many values were replaced."""
    rows, n = redact_value(table.to_pylist())
    return (pa.Table.from_pylist(rows, schema=table.schema) if n else table), n


def is_trajectory_file(path: Path) -> bool:
    """A Parquet file of trajectory rows (a rollout or verify stage's part)."""
    try:
        names = pq.read_schema(path).names
    except Exception:  # noqa: BLE001 - not readable: the prompt loader says why
        return False
    return "response_text" in names and "prompt_id" in names


def redact_file(src: Path, out: Path) -> int:
    """Write a de-identified copy of a JSONL (optionally .gz) or Parquet file in the same format, every row
    and field kept; returns how many values were replaced."""
    if src.suffix == ".parquet":
        table, n = redact_table(pq.read_table(src))
        buf = io.BytesIO()
        pq.write_table(table, buf)
        write_atomic(out, buf.getvalue())  # a kill leaves the old file or the whole copy, never a part
        return n
    opener = gzip.open if src.suffix == ".gz" else open
    with opener(src, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    total, kept = 0, []
    for line in lines:
        if not line.strip():
            continue
        obj, n = redact_value(json.loads(line))
        kept.append(json.dumps(obj, ensure_ascii=False))
        total += n
    text = ("\n".join(kept) + "\n").encode("utf-8")
    write_atomic(out, gzip.compress(text) if out.suffix == ".gz" else text)
    return total
