"""Importers of maths datasets: GSM8K and MATH (also MATH-500 / PRM800K)."""

from __future__ import annotations

import re
from typing import Any

from rlpipe.data.importers.rows import Row, RowError, need, prompt_row
from rlpipe.data.prompts import gsm8k_answer


def convert_gsm8k(row: Row, split: str) -> dict[str, Any]:
    """GSM8K {question, answer}: the answer is a worked solution whose last line is ``#### 72``."""
    question, answer = need(row.obj, "question"), need(row.obj, "answer")
    parsed = gsm8k_answer(answer)
    if parsed is None:
        raise RowError("answer", "has no final '#### <number>' line", "give GSM8K's answer text as published")
    truth, solution = parsed
    return prompt_row(row, split, "gsm8k", f"{split}-{row.index}", question, "math", truth, solution, "openai/gsm8k")


def boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced, or None.

    ``\\{`` and ``\\}`` inside are literal braces and do not count; ``\\boxed 5`` (no braces) gives ``5``."""
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)\b", text)]
    if not starts:
        return None
    i = starts[-1].end()
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        depth += (c == "{") - (c == "}")
        if depth == 0:
            return text[i + 1 : j].strip()
        j += 1
    return None


def convert_math(row: Row, split: str) -> dict[str, Any]:
    """MATH {problem, level, type, solution} and MATH-500 / PRM800K {problem, solution, answer, subject, level, unique_id}."""
    problem, solution = need(row.obj, "problem"), need(row.obj, "solution")
    answer = row.obj.get("answer")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    truth = answer.strip() if isinstance(answer, str) and answer.strip() else boxed_answer(solution)
    if not truth:
        raise RowError("solution", "has no \\boxed{...} answer and the row has no answer field",
                       "give the row as published (MATH's solution ends with \\boxed{answer})")
    uid = row.obj.get("unique_id") or row.relpath or f"{split}-{row.index}"
    return prompt_row(row, split, "math", str(uid).removesuffix(".json"), problem, "math", truth, solution,
                      "hendrycks/math")
