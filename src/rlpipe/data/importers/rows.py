"""What every importer shares: the source row, the errors that name its file, row and field, and the
prompt-table row the prompt formats build."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class DataImportError(ValueError):
    """SRC cannot be read, or one of its rows cannot be converted (the message names file, row, field and fix)."""


class RowError(ValueError):
    """Raised by a converter: what is wrong with one field of the row it was given."""

    def __init__(self, name: str, problem: str, fix: str):
        super().__init__(f"{name}: {problem} — {fix}")
        self.field, self.problem, self.fix = name, problem, fix


@dataclass(frozen=True)
class Row:
    """One source row: where it came from (for messages: ``FILE row N``, 1-based), its 0-based index, its object."""

    at: str
    index: int
    obj: dict[str, Any]
    relpath: str | None = None  # inside a folder source: the file's path relative to it, without suffix


def need(obj: dict[str, Any], key: str, kind: type | tuple[type, ...] = str, what: str = "text") -> Any:
    value = obj.get(key)
    if value is None or (isinstance(value, str) and not value.strip() and kind is str):
        raise RowError(key, "missing or empty", f"every row of this format needs {key!r} ({what}); is FORMAT right?")
    if not isinstance(value, kind):
        raise RowError(key, f"is a {type(value).__name__}, not {what}", f"give {key!r} as published ({what})")
    return value


def fence(code: str) -> str:
    return f"```python\n{code.strip(chr(10)).rstrip()}\n```"


def prompt_row(row: Row, split: str, fmt: str, rid: str, prompt: str, task: str, ground_truth: str | None,
               solution: str | None, source: str) -> dict[str, Any]:
    return {"id": f"{fmt}/{rid}", "prompt": prompt, "chat": False, "task": task, "ground_truth": ground_truth,
            "tests": None, "split": split, "source": source, "solution": solution}
