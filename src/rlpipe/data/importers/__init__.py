"""Import published datasets, rows exactly as distributed, into rlpipe's prompt or preference tables.

``rlpipe data import FORMAT SRC --out FILE`` reads SRC — a ``.jsonl``, ``.jsonl.gz``, ``.json`` or
``.parquet`` file, a folder (MATH's one-JSON-file-per-problem layout, or a ``datasets`` folder written
by ``save_to_disk``), or a Hugging Face hub name when the ``datasets`` library is installed — and
converts each row by its format (:data:`FORMATS`). What each format keeps:

- ``gsm8k``: the number after ``####`` (commas removed) as ground truth, and the worked solution for
  SFT, ending "The answer is \\boxed{N}.". GSM8K's calculator annotations (``<<48/2=24>>``) are
  removed from it: they are a tool-use trace of the dataset's authors, not text a model should learn.
- ``math``: the MATH rows ({problem, level, type, solution}: the answer is the last ``\\boxed{}`` of the
  solution, read with balanced braces) and MATH-500 / PRM800K rows (their ``answer`` field); the
  worked solution is kept.
- ``humaneval``, ``mbpp``, ``apps``, ``codecontests``: the reference solution fenced for SFT, and the
  tests as published, in ``ground_truth`` as JSON under the published key names (see each converter).
- ``ultrafeedback``, ``hh-rlhf``: preference pairs, read and validated by :mod:`rlpipe.data.preferences`.

Every row gets a stable id (``humaneval/HumanEval-0``, ``gsm8k/train-12``: the row's 0-based index in
its file when the format has no id of its own), a source, and a split: ``--split``, else the one the
file, folder or hub split name says (``test.jsonl``, ``train_prefs``), else MBPP's own split by task id,
else the format's default (``test`` for HumanEval and MATH, ``train`` otherwise). A row that cannot be converted
stops the import with an error naming the file, the row (1-based) and the field, and the fix: rows are
never dropped silently.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from rlpipe.data.importers.code import (convert_apps, convert_codecontests, convert_humaneval, convert_mbpp,
                                        mbpp_split)
from rlpipe.data.importers.maths import boxed_answer, convert_gsm8k, convert_math
from rlpipe.data.importers.preferences import convert_hh_rlhf, convert_ultrafeedback
from rlpipe.data.importers.rows import DataImportError, Row, RowError
from rlpipe.data.importers.source import read_source, split_from_name
from rlpipe.data.prompts import SPLITS, Finding, dataset_version, validate_prompts
from rlpipe.storage.schemas import PROMPT_SCHEMA

__all__ = ["FORMATS", "DataImportError", "ImportResult", "boxed_answer", "convert_rows", "import_dataset", "read_source"]


@dataclass(frozen=True)
class Format:
    kind: str  # "prompts" | "preferences"
    default_split: str  # "": none (MBPP splits by task id)
    convert: Callable[[Row, str], dict[str, Any]]


@dataclass
class ImportResult:
    kind: str
    rows: int
    splits: Counter = field(default_factory=Counter)
    findings: list[Finding] = field(default_factory=list)
    version: str = ""


FORMATS: dict[str, Format] = {
    "gsm8k": Format("prompts", "train", convert_gsm8k),
    "math": Format("prompts", "test", convert_math),
    "humaneval": Format("prompts", "test", convert_humaneval),
    "mbpp": Format("prompts", "", convert_mbpp),
    "apps": Format("prompts", "train", convert_apps),
    "codecontests": Format("prompts", "train", convert_codecontests),
    "ultrafeedback": Format("preferences", "train", convert_ultrafeedback),
    "hh-rlhf": Format("preferences", "train", convert_hh_rlhf),
}


def _row_split(fmt: Format, name: str, row: Row, given: str | None, implied: str | None) -> str:
    if given:
        split = split_from_name(given) or given
    elif implied:
        split = implied
    elif name == "mbpp" and isinstance(row.obj.get("task_id"), int):
        split = mbpp_split(row.obj["task_id"])
    else:
        split = fmt.default_split or "train"
    if split not in SPLITS:
        raise DataImportError(f"--split {given!r}: not one of {', '.join(SPLITS)} (or a name such as train_prefs, test, valid)")
    return split


def convert_rows(name: str, src: str | Path, split: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """SRC's rows converted by format ``name``; the first row that cannot be converted raises
    :class:`DataImportError` naming the file, the row, the field and the fix."""
    if name not in FORMATS:
        raise DataImportError(f"unknown format {name!r}; use one of: {', '.join(FORMATS)}")
    fmt, out = FORMATS[name], []
    for row, implied in read_source(src, split, fmt.default_split or "train"):
        if limit is not None and len(out) >= limit:
            break
        if not isinstance(row.obj, dict):
            raise DataImportError(f"{row.at}: is a {type(row.obj).__name__}, not an object — give one JSON object per row")
        try:
            converted = fmt.convert(row, _row_split(fmt, name, row, split, implied))
        except RowError as e:
            raise DataImportError(f"{row.at}: {e}") from None
        if isinstance(src, str) and not Path(src).exists():
            converted["source"] = src  # a hub name says exactly where the rows came from
        out.append(converted)
    return out


def _write_jsonl(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def _write(table: pa.Table, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".parquet":
        pq.write_table(table, out)
    else:
        _write_jsonl(table.to_pylist(), out)


def import_dataset(name: str, src: str | Path, out: str | Path, split: str | None = None,
                   limit: int | None = None) -> ImportResult:
    """Convert SRC by format ``name``, write OUT (.jsonl or .parquet), and validate what was written:
    prompt tables with :func:`~rlpipe.data.prompts.validate_prompts`, preference pairs with
    :func:`~rlpipe.data.preferences.load_preferences` (which also normalises them to its schema)."""
    out = Path(out)
    if out.suffix not in (".jsonl", ".parquet"):
        raise DataImportError(f"--out {out}: use a .jsonl or .parquet file name")
    rows = convert_rows(name, src, split, limit)
    if not rows:
        raise DataImportError(f"{src}: no rows to import")
    if FORMATS[name].kind == "preferences":
        from rlpipe.data.preferences import load_preferences, preference_version

        with tempfile.TemporaryDirectory() as tmp:  # the preference loader reads files: its rules, not a copy of them
            _write_jsonl(rows, Path(tmp) / "pairs.jsonl")
            table, findings = load_preferences(Path(tmp) / "pairs.jsonl")
        version = preference_version(table)
    else:
        table = pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA)
        findings, version = validate_prompts(table), dataset_version(table)
    _write(table, out)
    return ImportResult(FORMATS[name].kind, table.num_rows, Counter(table.column("split").to_pylist()), findings, version)
