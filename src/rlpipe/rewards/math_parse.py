"""math-verify's parser with rlpipe's settings: the reference (with the fix a bad row needs) and the model's
answer (which box or statement is the answer).

math-verify's own timeouts use ``signal.alarm``, which only works on a process's main thread;
the verifier pool runs each sample on a worker's main thread, so they work there. Off the main
thread (a Prefect task thread: SFT evaluation, dataset validation) math-verify would raise on
setting the alarm, so there the verifier calls it without its internal timeout: such callers
score the model's own short answers and references from the dataset, and the pool — the only
place arbitrary model output is judged in a run — still enforces a hard deadline from outside.
"""

from __future__ import annotations

import threading
from typing import Any

from rlpipe.rewards.math_text import ANSWER_AFTER, LATEX_DELIMS, box_spans, normalize, plain_candidate

PARSE_TIMEOUT_S = 2  # math-verify's alarms take whole seconds


def alarm_s(seconds: int) -> int | None:
    """math-verify's timeout where its alarm can work (the main thread), else none (see the docstring)."""
    return seconds if threading.current_thread() is threading.main_thread() else None


class BadReference(ValueError):
    """The row's ground truth cannot be judged against: the fault is the dataset's, not the model's."""


def _configs(answer_side: bool) -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    # On the answer side a box outranks "the answer is …" phrases: the model's box is its final word.
    latex = LatexExtractionConfig(boxed_match_priority=0) if answer_side else LatexExtractionConfig()
    return [latex, ExprExtractionConfig()]


def parse_text(text: str, answer_side: bool) -> Any | None:
    """The first expression math-verify extracts (raises its TimeoutException / errors), else None."""
    from math_verify import parse

    found = parse(text, extraction_config=_configs(answer_side), parsing_timeout=alarm_s(PARSE_TIMEOUT_S),
                  raise_on_error=True)
    return next((x for x in found if not isinstance(x, str)), None)


def _reference_text(ground_truth: str) -> str:
    """A reference already in math mode (``$…$``, ``\\[…\\]``, a box) is parsed as written; otherwise it is
    put in ``$…$`` so LaTeX without delimiters (``\\frac12``, ``[1,2)``, ``2, 3``) is read as LaTeX.
    (Re-wrapping everything in ``\\boxed{}`` mangled references that were already LaTeX.)"""
    gt = normalize(ground_truth.strip())
    return gt if LATEX_DELIMS.search(gt) else f"${gt}$"


def parse_reference(ground_truth: str | None) -> Any:
    """The reference as a sympy object; raises :class:`BadReference` naming the problem and the fix."""
    if ground_truth is None or not str(ground_truth).strip():
        raise BadReference("row has no ground truth (None or empty); fix the row's ground_truth")
    from math_verify.errors import TimeoutException

    try:
        gold = parse_text(_reference_text(str(ground_truth)), answer_side=False)
    except TimeoutException:
        raise BadReference(f"reference {str(ground_truth)[:80]!r} took over {PARSE_TIMEOUT_S} s to parse; "
                           "simplify the row's ground_truth") from None
    except Exception as e:  # noqa: BLE001 - any parser failure is the reference's problem here
        gold = None
        detail = f" ({type(e).__name__})"
    else:
        detail = ""
    if gold is None:
        raise BadReference(f"reference {str(ground_truth)[:80]!r} cannot be parsed by math-verify{detail}; "
                           "fix the row's ground_truth (a number, or LaTeX such as \\frac{1}{2}, [1,2), \\{2,3\\})")
    return gold


def check_math_reference(ground_truth: str | None, **options: Any) -> str | None:
    """``None`` when math-verify can read the reference, else what is wrong and how to fix it."""
    try:
        parse_reference(ground_truth)
    except BadReference as e:
        return str(e)
    return None


def n_elements(x: Any) -> int:
    """How many answers ``x`` holds: a set/tuple's length, 2 for an open interval ``(a, b)`` (also a pair), else 1."""
    from sympy import FiniteSet, Interval, Tuple

    if isinstance(x, (FiniteSet, Tuple)):
        return len(x)
    if isinstance(x, Interval) and x.left_open and x.right_open and x.start.is_finite and x.end.is_finite:
        return 2
    return 1


def parse_answer(text: str, gold: Any) -> Any | None:
    """The model's answer in the normalised response. Where the reference holds several answers and
    math-verify read one (it keeps only the last box unless boxes are adjacent or joined by "and"/","), all
    the boxes are read as one list. A plain-text answer that reads as math (``2x+1``, ``x^2+1``) is parsed as
    LaTeX, as references are."""
    boxes = box_spans(text)
    # Boxed steps, then "the final answer is …": the statement after the boxes is the answer (math-verify
    # would rank the last box first).
    tail = text[boxes[-1][1]:] if boxes and ANSWER_AFTER.search(text[boxes[-1][1]:]) else ""
    pred = parse_text(tail, answer_side=True) if tail else None
    cand = plain_candidate(text)
    pred = pred if pred is not None or not cand else parse_text(f"${cand}$", answer_side=True)
    pred = pred if pred is not None else parse_text(text, answer_side=True)
    boxes = [content for _, _, content in boxes]
    if n_elements(gold) > 1 and len(boxes) > 1 and (pred is None or n_elements(pred) == 1):
        joined = parse_text("$" + ", ".join(b for b in boxes if b) + "$", answer_side=True)
        pred = joined if joined is not None else pred
    return pred
