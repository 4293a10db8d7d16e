"""Prompt tables: load a user's JSONL/Parquet file, validate every row, and version by content.

Validation reports; it never drops rows. Each :class:`Finding` names the row id (or line), the
field and what to do, so a user can fix the file and run again.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlpipe.config import canonical_json
from rlpipe.storage.schemas import PROMPT_SCHEMA
from rlpipe.storage.store import conform

SPLITS = ("train", "test", "validation")

__all__ = ["Finding", "PromptFileError", "dataset_version", "load_prompts", "validate_prompts", "SPLITS"]


@dataclass(frozen=True)
class Finding:
    row: str  # row id, or "line N" where a row has no usable id
    field: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"row {self.row}: {self.field}: {self.problem} — {self.fix}"

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


class PromptFileError(ValueError):
    """A prompt file that cannot be read at all (not JSON, not Parquet, wrong columns)."""


_GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.S)


def _row_from_json(obj: dict[str, Any], line: int, source: str, default_task: str) -> dict[str, Any]:
    """One JSONL object → a prompt row. Accepts the rlpipe schema and GSM8K's {question, answer}."""
    row = dict(obj)
    if "prompt" not in row and "question" in row:
        # GSM8K style: the reference answer is what follows '####' in the worked solution.
        row["prompt"] = row.pop("question")
        answer = row.pop("answer", None)
        if isinstance(answer, str):
            m = _GSM8K_ANSWER.search(answer)
            row.setdefault("ground_truth", (m.group(1) if m else answer).replace(",", "").strip())
        elif answer is not None:
            row.setdefault("ground_truth", str(answer))
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        row["prompt"] = json.dumps(prompt, ensure_ascii=False)
        row["chat"] = True
    row.setdefault("chat", False)
    row.setdefault("id", f"{Path(source).stem}-{line}")
    row.setdefault("task", default_task)
    row.setdefault("split", "train")
    if isinstance(row.get("tests"), (list, dict)):
        row["tests"] = json.dumps(row["tests"], ensure_ascii=False)
    if row.get("ground_truth") is not None and not isinstance(row["ground_truth"], str):
        row["ground_truth"] = str(row["ground_truth"])
    for key in ("id", "task", "split", "source"):
        if row.get(key) is not None and not isinstance(row[key], str):
            row[key] = str(row[key])
    return {f.name: row.get(f.name) for f in PROMPT_SCHEMA} | {
        "_extra": sorted(set(row) - set(PROMPT_SCHEMA.names))
    }


def load_prompts(path: str | Path, default_task: str = "math") -> pa.Table:
    """Read a JSONL or Parquet prompt file into :data:`PROMPT_SCHEMA` (no validation, no dropping)."""
    path = Path(path)
    if not path.exists():
        raise PromptFileError(f"{path}: file not found")
    if path.suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except Exception as e:  # noqa: BLE001
            raise PromptFileError(f"{path}: not a readable Parquet file: {e}") from None
        if "chat" not in table.column_names:
            table = table.append_column("chat", pa.array([False] * table.num_rows))
        if "split" not in table.column_names:
            table = table.append_column("split", pa.array(["train"] * table.num_rows))
        if "task" not in table.column_names:
            table = table.append_column("task", pa.array([default_task] * table.num_rows))
        try:
            return conform(table, PROMPT_SCHEMA, where=str(path))
        except ValueError as e:
            raise PromptFileError(f"{e}; the prompt schema is: {PROMPT_SCHEMA.names}") from None
    if path.suffix not in (".jsonl", ".json", ".ndjson"):
        raise PromptFileError(f"{path}: unknown prompt file type {path.suffix!r}; use .jsonl or .parquet")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{path} line {n}: not valid JSON ({e.msg}); each line must be one JSON object") from None
        if not isinstance(obj, dict):
            raise PromptFileError(f"{path} line {n}: expected a JSON object, got {type(obj).__name__}")
        row = _row_from_json(obj, n, str(path), default_task)
        row.pop("_extra")
        rows.append(row)
    try:
        return pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise PromptFileError(f"{path}: a field has the wrong type: {e}") from None


def _normalise_prompt(text: str) -> str:
    return " ".join(text.split()).lower()


def validate_prompts(table: pa.Table, verifiers: list[str] | None = None) -> list[Finding]:
    """Every problem in a prompt table, each naming its row. An empty list means the table is usable."""
    if verifiers is None:
        from rlpipe.rewards import verifier_names

        verifiers = verifier_names()
    findings: list[Finding] = []
    missing = [name for name in PROMPT_SCHEMA.names if name not in table.column_names]
    if missing:
        return [Finding("*", ", ".join(missing), "required column(s) missing", f"add them; schema: {PROMPT_SCHEMA.names}")]
    rows = table.to_pylist()
    ids = Counter(r["id"] for r in rows)
    prompts_by_split: dict[str, dict[str, str]] = {}
    seen_prompts: dict[tuple[str, str], str] = {}
    for n, r in enumerate(rows, start=1):
        rid = r["id"] if r["id"] else f"line {n}"
        if not r["id"]:
            findings.append(Finding(rid, "id", "empty id", "give every row a unique id"))
        elif ids[r["id"]] > 1:
            findings.append(Finding(rid, "id", f"id used by {ids[r['id']]} rows", "make ids unique"))
        prompt = r["prompt"] or ""
        if not prompt.strip():
            findings.append(Finding(rid, "prompt", "empty prompt", "write the question, or remove the row"))
        elif r["chat"]:
            try:
                msgs = json.loads(prompt)
                if not isinstance(msgs, list) or not all(
                    isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str)
                    for m in msgs
                ) or not msgs:
                    raise ValueError
            except ValueError:
                findings.append(
                    Finding(rid, "prompt", "chat prompt is not a list of {role, content} messages", "fix the messages")
                )
        if r["task"] not in verifiers:
            findings.append(
                Finding(rid, "task", f"unknown verifier {r['task']!r}", f"use one of: {', '.join(verifiers)}")
            )
        if r["split"] not in SPLITS:
            findings.append(Finding(rid, "split", f"unknown split {r['split']!r}", f"use one of: {', '.join(SPLITS)}"))
        has_gt = r["ground_truth"] is not None and str(r["ground_truth"]).strip() != ""
        has_tests = r["tests"] is not None and str(r["tests"]).strip() != ""
        if not has_gt and not has_tests:
            findings.append(
                Finding(rid, "ground_truth", "no ground truth and no tests", "add the reference answer (or tests for code)")
            )
        if prompt.strip():
            key = _normalise_prompt(prompt)
            where = (key, r["split"])
            if where in seen_prompts:
                findings.append(
                    Finding(rid, "prompt", f"duplicate of row {seen_prompts[where]} in split {r['split']!r}",
                            "remove one of the two rows")
                )
            else:
                seen_prompts[where] = rid
            prompts_by_split.setdefault(r["split"], {}).setdefault(key, rid)
    # Leakage: the same question in train and in a held-out split inflates held-out accuracy.
    train = prompts_by_split.get("train", {})
    for split in ("test", "validation"):
        for key, rid in prompts_by_split.get(split, {}).items():
            if key in train:
                findings.append(
                    Finding(rid, "split", f"leak: the same prompt is row {train[key]} in train",
                            "keep each question in one split only")
                )
    return findings


def dataset_version(table: pa.Table) -> str:
    """sha256 of the rows' canonical JSON, sorted by id: independent of row order and Parquet encoding."""
    rows = sorted((canonical_json(r) for r in table.select(PROMPT_SCHEMA.names).to_pylist()))
    h = hashlib.sha256()
    for r in rows:
        h.update(r.encode())
        h.update(b"\n")
    return h.hexdigest()
