"""Prompt tables: load a user's JSONL/Parquet file, validate every row, and version by content.

Validation reports; it never drops rows. Each :class:`Finding` names the row id (or line), the
field and what to do, so a user can fix the file and run again. Besides each row's shape, split
and duplicates, it catches what would otherwise only show up as ``error`` verdicts or inflated
rewards during training: a reference (``ground_truth``, or ``tests`` when there is none — what
``tasks/rl.py`` hands the verifier) that the row's verifier rejects (``check_reference``), and a
prompt that states its own answer (:func:`answer_leak`, which documents the rule).
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
from rlpipe.jsonl import jsonl_objects
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


_CALCULATOR = re.compile(r"<<[^<>]*>>")


def gsm8k_answer(answer: str) -> tuple[str, str] | None:
    """GSM8K's worked answer (``...\n#### 1,000``) → (reference ``1000``, the worked solution for SFT ending
    "The answer is \\boxed{1000}." without the ``<<48/2=24>>`` calculator annotations); None without ``####``."""
    worked, marker, final = answer.rpartition("####")
    truth = final.strip().replace(",", "")
    if not marker or not truth:
        return None
    return truth, f"{_CALCULATOR.sub('', worked).rstrip()}\nThe answer is \\boxed{{{truth}}}.".lstrip("\n")


def _row_from_json(obj: dict[str, Any], line: int, source: str, default_task: str) -> dict[str, Any]:
    """One JSONL object → a prompt row. Accepts the rlpipe schema and GSM8K's {question, answer}."""
    row = dict(obj)
    if "prompt" not in row and "question" in row:
        # GSM8K style: the reference answer is what follows '####' in the worked solution.
        row["prompt"] = row.pop("question")
        answer = row.pop("answer", None)
        if isinstance(answer, str):
            parsed = gsm8k_answer(answer)
            row.setdefault("ground_truth", parsed[0] if parsed else answer.replace(",", "").strip())
            if parsed:  # keep the worked solution: SFT learns the reasoning, not only the number
                row.setdefault("solution", parsed[1])
        elif answer is not None:
            row.setdefault("ground_truth", str(answer))
    if "prompt" not in row and isinstance(row.get("messages"), list) and row["messages"]:
        # TRL's / OpenAI's conversational form: the last assistant message is the solution, the rest the prompt.
        msgs = list(row.pop("messages"))
        if isinstance(msgs[-1], dict) and msgs[-1].get("role") == "assistant" and len(msgs) > 1:
            row.setdefault("solution", msgs.pop()["content"])
        row["prompt"] = msgs
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
    for n, obj in jsonl_objects(path, PromptFileError):
        row = _row_from_json(obj, n, str(path), default_task)
        row.pop("_extra")
        rows.append(row)
    try:
        return pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise PromptFileError(f"{path}: a field has the wrong type: {e}") from None


def _normalise_prompt(text: str) -> str:
    return " ".join(text.split()).lower()


def _row_id(r: dict[str, Any], n: int) -> str:
    return r["id"] if r["id"] else f"line {n}"


def _row_findings(r: dict[str, Any], rid: str, ids: Counter, verifiers: list[str]) -> list[Finding]:
    """What is wrong with one row on its own: id, prompt shape, task, split, missing reference."""
    found = []
    if not r["id"]:
        found.append(Finding(rid, "id", "empty id", "give every row a unique id"))
    elif ids[r["id"]] > 1:
        found.append(Finding(rid, "id", f"id used by {ids[r['id']]} rows", "make ids unique"))
    prompt = r["prompt"] or ""
    if not prompt.strip():
        found.append(Finding(rid, "prompt", "empty prompt", "write the question, or remove the row"))
    elif r["chat"] and _chat_messages(prompt) is None:
        found.append(Finding(rid, "prompt", "chat prompt is not a list of {role, content} messages", "fix the messages"))
    if r["task"] not in verifiers:
        found.append(Finding(rid, "task", f"unknown verifier {r['task']!r}", f"use one of: {', '.join(verifiers)}"))
    if r["split"] not in SPLITS:
        found.append(Finding(rid, "split", f"unknown split {r['split']!r}", f"use one of: {', '.join(SPLITS)}"))
    return found


def _chat_messages(prompt: str) -> list[dict[str, str]] | None:
    try:
        msgs = json.loads(prompt)
    except ValueError:
        return None
    ok = isinstance(msgs, list) and msgs and all(
        isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str)
        for m in msgs
    )
    return msgs if ok else None


def _duplicate_findings(rows: list[dict[str, Any]]) -> list[Finding]:
    """The same prompt twice in a split, and the same prompt in train and a held-out split (leakage)."""
    found = []
    prompts_by_split: dict[str, dict[str, str]] = {}
    seen_prompts: dict[tuple[str, str], str] = {}
    for n, r in enumerate(rows, start=1):
        rid, prompt = _row_id(r, n), r["prompt"] or ""
        if not prompt.strip():
            continue
        key = _normalise_prompt(prompt)
        where = (key, r["split"])
        if where in seen_prompts:
            found.append(Finding(rid, "prompt", f"duplicate of row {seen_prompts[where]} in split {r['split']!r}",
                                 "remove one of the two rows"))
        else:
            seen_prompts[where] = rid
        prompts_by_split.setdefault(r["split"], {}).setdefault(key, rid)
    # Leakage: the same question in train and in a held-out split inflates held-out accuracy.
    train = prompts_by_split.get("train", {})
    for split in ("test", "validation"):
        for key, rid in prompts_by_split.get(split, {}).items():
            if key in train:
                found.append(Finding(rid, "split", f"leak: the same prompt is row {train[key]} in train",
                                     "keep each question in one split only"))
    return found


# -- references: what the verifier will be given ----------------------------------------------


def _reference(r: dict[str, Any]) -> tuple[str, str | None]:
    """``(field, value)`` the verifier is given for this row — the same rule as ``tasks/rl.py``."""
    if r["ground_truth"] is not None:
        return "ground_truth", r["ground_truth"]
    return "tests", r["tests"]


def _blank(value: str | None) -> bool:
    return value is None or not str(value).strip()


def _check_here(pairs: list[tuple[str, str | None]], options: dict[str, dict[str, Any]]) -> list[str | None]:
    """Each (verifier, reference)'s ``check_reference`` message; a crashing check becomes its message."""
    from rlpipe.rewards import get_verifier

    out: list[str | None] = []
    for task, reference in pairs:
        try:
            out.append(get_verifier(task).check_reference(reference, **options.get(task, {})))
        except Exception as e:  # noqa: BLE001 - a bug in a reference check must name the row, not abort validation
            out.append(f"the {task!r} verifier's reference check crashed ({type(e).__name__}: {e})"[:300])
    return out


class _ReferenceChecker:
    """Runs each verifier's ``check_reference`` once per distinct (verifier, reference).

    In-process, also on a Prefect task thread (``prepare-dataset``): the math verifier parses without
    math-verify's alarm-based timeout there (see ``rlpipe.rewards.math``)."""

    def __init__(self, options: dict[str, dict[str, Any]]):
        self.options = options
        self._memo: dict[tuple[str, str | None], str | None] = {}

    def prefetch(self, pairs: set[tuple[str, str | None]]) -> None:
        todo = sorted(pairs - set(self._memo), key=lambda p: (p[0], p[1] or ""))
        if not todo:
            return
        self._memo.update(zip(todo, _check_here(todo, self.options)))

    def problem(self, task: str, reference: str | None) -> str | None:
        self.prefetch({(task, reference)})
        return self._memo[(task, reference)]

    def accepts_none(self, task: str) -> bool:
        """A verifier that checks references and accepts none at all (``json``: any JSON value)."""
        from rlpipe.rewards.base import _no_check, get_verifier

        return get_verifier(task).check_reference is not _no_check and self.problem(task, None) is None


def _reference_findings(r: dict[str, Any], rid: str, checker: _ReferenceChecker, known: bool) -> list[Finding]:
    """A missing reference, or one the row's verifier cannot use (unparseable answer, broken tests or rule)."""
    field, ref = _reference(r)
    if _blank(r["ground_truth"]) and _blank(r["tests"]):
        if known and checker.accepts_none(r["task"]):
            return []
        return [Finding(rid, "ground_truth", "no ground truth and no tests", "add the reference answer (or tests for code)")]
    if not known:
        return []
    problem = checker.problem(r["task"], ref)
    if problem is None:
        return _code_name_findings(r, rid, field, ref)
    return [Finding(rid, field, f"the {r['task']!r} verifier cannot use this {field}: {problem}",
                    f"correct the row's {field} as described, or give the row the task whose verifier it was written for")]


def _code_name_findings(r: dict[str, Any], rid: str, field: str, ref: str | None) -> list[Finding]:
    """A name the tests take from the program that the row's own solution does not define: every program
    would score 0 on those tests (a `candidate` not renamed, a helper the tests expect under another name)."""
    if r["task"] != "code" or _blank(r["solution"]):
        return []
    from rlpipe.rewards.code import extract_program, undefined_names

    missing = undefined_names(ref, extract_program(r["solution"]))
    if not missing:
        return []
    return [Finding(rid, field, f"the tests use {', '.join(f'`{n}`' for n in missing)}, which neither the test code nor "
                    "the row's solution defines", "rename it in the tests to the solution's function, or add "
                    '"entry_point" / "test_setup_code" for it')]


# -- a prompt that gives away its answer -----------------------------------------------------

# Verifiers whose reference is *the answer* (for others — python_expr's target value, a format rule,
# tests — the prompt legitimately contains the reference).
ANSWER_VERIFIERS = ("math", "exact")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_BOXED = re.compile(r"^\\boxed\{(.*)\}$", re.S)
_OPERATOR = re.compile(r"[\w)\]}]\s*(?:[-+*/^×÷·]|\\times|\\cdot|\\div)\s*[\w(\[{\\]")
_MARKER = r"(?:####|\banswer\s*(?:is|:)|<answer>|\\boxed\{)"
_END = r"(?![\w]|[.,]\d)"


def _normalise_answer(text: str) -> str:
    text = text.strip().strip("$").strip()
    m = _BOXED.match(text)
    return _THOUSANDS.sub("", (m.group(1) if m else text).strip())


def _question_text(r: dict[str, Any]) -> str:
    """The line the model is asked to complete: the last non-empty line of the (last user) prompt.

    Earlier lines and messages hold instructions and few-shot examples, whose answers may well
    equal this row's; only the question itself can give the answer away."""
    prompt = r["prompt"] or ""
    if r["chat"]:
        msgs = _chat_messages(prompt) or []
        users = [m["content"] for m in msgs if m["role"] == "user"]
        prompt = users[-1] if users else ""
    lines = [ln for ln in prompt.splitlines() if ln.strip()]
    return _THOUSANDS.sub("", lines[-1]) if lines else ""


def answer_leak(r: dict[str, Any]) -> str | None:
    """The part of the prompt that states the row's own reference answer, or None.

    The rule (no false alarm on ``12+34=`` → ``46``, nor on ``14+3=`` → ``4`` or ``8-4=`` → ``4``):
    only rows of :data:`ANSWER_VERIFIERS`; only the question line (see :func:`_question_text`); the
    normalised reference (no ``$``, ``\\boxed{}`` or thousands commas) must appear as a whole token —
    not inside a longer number or word, nor as the start of a decimal — and either

    - right after an ``=`` whose left side is a computation (operands joined by an operator:
      ``12+34=46``; ``x = 4`` or ``Let a = 5`` defines an operand and is not a leak), or
    - right after an answer marker (``####``, ``answer:``, ``answer is``, ``<answer>``,
      ``\\boxed{``) and at the end of the line (``Answer: yes or no`` is an instruction).
    """
    if r["task"] not in ANSWER_VERIFIERS or _blank(r["ground_truth"]):
        return None
    ref = _normalise_answer(r["ground_truth"])
    line = _question_text(r)
    if not ref or ref not in line:
        return None
    token = re.escape(ref)
    for m in re.finditer(rf"(?<![<>!=])=\s*(?:\$\s*|\\boxed\{{\s*)?{token}{_END}", line):
        lhs = re.split(r"[=,;:?!\n]", line[: m.start()])[-1]
        if _OPERATOR.search(lhs):
            return line[m.start() - len(lhs) : m.end()].strip()[-80:]
    m = re.search(rf"{_MARKER}\s*\$?\s*{token}{_END}(?=\s*(?:</answer>)?[\s.!}}$]*$)", line, re.I)
    return line[m.start() : m.end()][-80:] if m else None


def _leak_findings(r: dict[str, Any], rid: str) -> list[Finding]:
    shown = answer_leak(r)
    if shown is None:
        return []
    return [Finding(rid, "prompt", f"the prompt contains its own reference answer {r['ground_truth'].strip()!r} ({shown!r})",
                    "remove the answer from the prompt (was the solution appended when the file was built?)")]


def validate_prompts(table: pa.Table, verifiers: list[str] | None = None,
                     options: dict[str, dict[str, Any]] | None = None) -> list[Finding]:
    """Every problem in a prompt table, each naming its row. An empty list means the table is usable.

    Besides the rows' shape, each reference is checked by its verifier (``check_reference``, with
    that verifier's ``options``) so a reference that could only ever score ``error`` is fixed before
    training, and prompts that state their own answer are flagged (:func:`answer_leak`).
    """
    from rlpipe.rewards import verifier_names

    known = set(verifier_names())
    verifiers = verifier_names() if verifiers is None else verifiers
    missing = [name for name in PROMPT_SCHEMA.names if name not in table.column_names]
    if missing:
        return [Finding("*", ", ".join(missing), "required column(s) missing", f"add them; schema: {PROMPT_SCHEMA.names}")]
    rows = table.to_pylist()
    ids = Counter(r["id"] for r in rows)
    checker = _ReferenceChecker(options or {})
    checked = [r for r in rows if r["task"] in verifiers and r["task"] in known]
    checker.prefetch({(r["task"], _reference(r)[1]) for r in checked if not (_blank(r["ground_truth"]) and _blank(r["tests"]))})
    findings: list[Finding] = []
    for n, r in enumerate(rows, start=1):
        rid = _row_id(r, n)
        findings += _row_findings(r, rid, ids, verifiers)
        findings += _reference_findings(r, rid, checker, r["task"] in verifiers and r["task"] in known)
        findings += _leak_findings(r, rid)
    return findings + _duplicate_findings(rows)


def dataset_version(table: pa.Table) -> str:
    """sha256 of the rows' canonical JSON, sorted by id: independent of row order and Parquet encoding."""
    rows = sorted((canonical_json(r) for r in table.select(PROMPT_SCHEMA.names).to_pylist()))
    h = hashlib.sha256()
    for r in rows:
        h.update(r.encode())
        h.update(b"\n")
    return h.hexdigest()
