"""The ``math`` verifier (math-verify, plus fixes: equivalent forms, LaTeX, fractions, sets) and ``exact``
(string match of the final answer).

What the ``math`` verifier reads and how, one idea a module: :mod:`~rlpipe.rewards.math_text` (the
response as text: boxes, fixes before parsing), :mod:`~rlpipe.rewards.math_forms` (forms math-verify
misreads, units), :mod:`~rlpipe.rewards.math_parse` (math-verify's parser: the reference, the answer;
timeouts off the main thread), :mod:`~rlpipe.rewards.math_equal` (when two values are one) and
:mod:`~rlpipe.rewards.math_two_answers` (a response that states two answers is wrong). This module holds
the verifiers and the conventions they keep:

Verdicts: a reference that is None, empty or unreadable by math-verify → ``error`` naming the row's
fix (never 0/ok: the fault is the dataset's). An empty response → 0/``ok`` (no answer is a wrong answer). A response with no
extractable expression (prose, ``\\boxed{}``) → 0/``ok``: the model failed to give an answer. Wrong →
0/``ok``; equivalent → 1/``ok``. math-verify's own timeout → ``timeout``; its exceptions (called with
``raise_on_error=True``, so they are not silently False) → ``error``.

Conventions (the audit set ``datasets/audit/math.jsonl`` is labelled by these):

- The final answer is the last ``\\boxed{}``; without a box, math-verify's "final answer is" / last
  expression rules apply, on the response without a trailing self-check ("Check: …", "Let me verify:").
- Two different final answers are a wrong answer (the two-answers rule:
  :mod:`~rlpipe.rewards.math_two_answers`).
- Decimals equal an exact value when they agree after rounding to 10 places, so 0.333 ≠ 1/3 and
  0.1000001 ≠ 0.1, while 46.0 = 46 and 1.50 = 3/2.
- Units are ignored, not converted: ``5\\text{ cm}`` matches 5; the number must be in the unit the
  reference uses (500 cm does not match 5 m). When both sides name a unit (in ``\\text{}``,
  ``\\mathrm{}``, or a known unit written bare after the number: ``60 mph``) they must name the same
  unit, spelled any way: ``cm`` = ``centimeters``, ``mph`` = ``miles per hour``, ``sq ft`` = ``ft^2``;
  ``m`` ≠ ``km``, ``cm^3`` ≠ ``cm^2``, ``m/s`` ≠ ``km/h``.
- Percent: the % sign is read as a label: ``12%`` matches 12 (the question asked for a percentage) and
  0.12 (its value); without a % sign, 12 and 0.12 differ. Against a reference that is a number in
  [0, 1] (a probability) only the value counts: ``0.25%`` is 0.0025, not 0.25.
- ``i`` is the imaginary unit where it is the only letter on both sides: ``i^2`` = -1.
- A comma followed by exactly three digits is a thousands separator (``1,000`` = 1000); a comma list
  without brackets (``2, 3``) is a set of answers; ``(1, 2)`` is an ordered pair or open interval.

What math-verify gets wrong and we fix:

- math-verify reads ``1\\,234`` (LaTeX thin-space digit groups, also ``1{,}234``, ``1~234``) as
  ``1 + 234`` = 235; we join digit groups before parsing, because a thin space in a number is a
  thousands separator.
- Re-wrapping a reference in ``\\boxed{}`` mangled references already in LaTeX (``$\\frac12$``); we
  parse a reference with delimiters as written and put one without in ``$…$``.
- math-verify keeps only the last box unless boxes sit next to each other or are joined by
  "and"/","/";"; where the reference holds several answers (``2, 3``, ``\\{2,3\\}``, ``(1, 2)``) we read
  all the boxes as one list, because models often box each root in its own sentence.
- math-verify drops unit words on both sides, so ``5\\text{ m}`` matched a reference of
  ``5\\text{ cm}``; we give 0 when both name different units, because the answer is wrong.
- Forms math-verify misreads are rewritten on both sides before parsing (:mod:`rlpipe.rewards.math_forms`):
  ``\\$18.90``, ``45°``, ``\\sin 30^\\circ``, ``0.\\overline{3}``, ``6.02e23``, ``6.02 \\times 10^{23}``,
  ``3.5 million``, ``7 3/4``.
- math-verify's percent rule depends on the number type (12% = 12 but 12.5% ≠ 12.5); we read the %
  sign as a label for every number (retry with the % removed), because the convention must be one.
- math-verify compares an inequality answer with an interval reference only when asked; we ask
  (``allow_set_relation_comp``), because ``1 \\le x < 2`` describes the set ``[1,2)``.
- math-verify rounds decimals to 6 places by default, which accepts 0.3333333 for 1/3 and 0.1000001
  for 0.1; we round to 10.
- math-verify reads a plain-text answer only as a Python-style expression, so ``x^2+1``, ``2x+1`` and
  ``sqrt(2)/2`` were "no answer" or a stray number; an answer without delimiters that reads as math
  (after "the answer is", or the whole response) is parsed as LaTeX, the way references are.
- Plain number vs plain number (``46`` vs ``46.0``, the demo) is compared exactly as decimals without
  math-verify: same verdict, no sympy import, microseconds.
- math-verify reads a comma between digits as a decimal comma in some places (``2,74`` = 2.74,
  ``0,111`` = 0.111) and as a list separator in others (``1,22``); outside brackets, a comma between
  digits that is not a thousands grouping (``1,000``, ``12,345.5``) gets a space after it, so it is
  read as a list, because the convention above must hold everywhere.
- math-verify drops ``\\mathrm{e}`` (and ``\\text{e}``) as a unit, so ``1 - 1/\\mathrm{e}`` matched
  ``1 + 1/\\mathrm{e}`` (both read as 1); an upright e is written as ``e``, Euler's number, on both sides,
  and is not a unit word.
- math-verify reads a clock time on the hour (``12:00``) as the ratio 12/0 and fails, so the answer was
  an ``error``; ``h:00`` is read as ``h``, because a ratio's second term is never 0.
"""

from __future__ import annotations

from typing import Any

from rlpipe.rewards.base import VerifyResult, register_verifier
from rlpipe.rewards.math_equal import FLOAT_ROUNDING, NUMERIC_PRECISION, VERIFY_TIMEOUT_S, equal, fast_verdict
from rlpipe.rewards.math_forms import unit_of
from rlpipe.rewards.math_parse import (PARSE_TIMEOUT_S, BadReference, check_math_reference, n_elements,
                                       parse_answer, parse_reference)
from rlpipe.rewards.math_text import box_spans, boxed_contents, final_answer, normalize
from rlpipe.rewards.math_two_answers import (MAX_BOXES, MAX_HEDGED, TWO_ANSWERS, box_verdict, drop_self_check,
                                             hedge_verdict)

__all__ = ["FLOAT_ROUNDING", "MATH_BUDGET_S", "MAX_BOXES", "MAX_HEDGED", "NUMERIC_PRECISION", "PARSE_TIMEOUT_S",
           "TWO_ANSWERS", "VERIFY_TIMEOUT_S", "box_spans", "boxed_contents", "check_math_reference", "exact",
           "final_answer", "math_answer", "parse_reference"]

# math-verify's alarms take whole seconds. The verifier makes at most 8 + MAX_BOXES parses (reference; answer
# as plain text, as written, its boxes joined; each of the last MAX_BOXES boxes; up to MAX_HEDGED values
# joined by "or", and them joined) and 5 + MAX_BOXES comparisons (plain, percent as a label, inequalities as
# sets, the imaginary unit; each box but the last with the last; the MAX_HEDGED - 1 other values with the first).
MATH_BUDGET_S = (8 + MAX_BOXES) * PARSE_TIMEOUT_S + (5 + MAX_BOXES) * VERIFY_TIMEOUT_S + 1.0


def _check_exact_reference(ground_truth: str | None, **options: Any) -> str | None:
    if ground_truth is None or not str(ground_truth).strip():
        return "row has no ground truth (None or empty); fix the row's ground_truth"
    return None


@register_verifier("exact", version="2", budget_s=1.0, check_reference=_check_exact_reference)
def exact(response: str, ground_truth: str | None) -> VerifyResult:
    """String equality of the final answer (last box, else the stripped text) and the stripped reference."""
    problem = _check_exact_reference(ground_truth)
    if problem:
        return VerifyResult(None, "error", problem)
    if not response or not response.strip():
        return VerifyResult(0.0, "ok", "empty answer")
    return VerifyResult(float(final_answer(response) == str(ground_truth).strip()), "ok")


def _units_differ(response: str, ground_truth: str) -> bool:
    """Both sides name a unit and not the same one: math-verify drops units, so 5 m would match 5 km.
    Units are compared spelled one way (:func:`~rlpipe.rewards.math_forms.unit_of`): mph = miles per hour."""
    boxes = boxed_contents(response)
    a, g = unit_of(boxes[-1] if boxes else response), unit_of(ground_truth)
    return a is not None and g is not None and a != g


@register_verifier("math", version="3", budget_s=MATH_BUDGET_S, check_reference=check_math_reference)
def math_answer(response: str, ground_truth: str | None) -> VerifyResult:
    """Is the model's final answer mathematically equivalent to the reference? (math-verify, plus fixes;
    the verdicts, conventions and fixes are in the module docstring)."""
    try:
        gold_text = str(ground_truth) if ground_truth is not None else None
        fast = fast_verdict(response or "", gold_text) if gold_text else None
        if fast is not None:
            return VerifyResult(fast, "ok")
        gold = parse_reference(gold_text)
    except BadReference as e:
        return VerifyResult(None, "error", str(e))
    if not response or not response.strip():
        return VerifyResult(0.0, "ok", "empty answer")
    if _units_differ(normalize(response), normalize(str(ground_truth))):
        return VerifyResult(0.0, "ok", "the answer's unit differs from the reference's")
    return _judge(response, gold)


def _judge(response: str, gold: Any) -> VerifyResult:
    """Parse and compare the model's answer; math-verify's timeouts and exceptions become statuses."""
    from math_verify.errors import TimeoutException

    try:
        text = drop_self_check(normalize(response))
        multi = n_elements(gold) > 1
        boxes, hedge = box_verdict(text, multi), hedge_verdict(text, multi)
        if "two" in (boxes[0], hedge[0]):
            return VerifyResult(0.0, "ok", TWO_ANSWERS)
        pred = boxes[1] if boxes[0] == "last" else parse_answer(text, gold)
        if hedge[0] == "list" and (pred is None or n_elements(pred) == 1):
            pred = hedge[1]  # "3 or 4" against {3, 4}: math-verify read only the 3
        if pred is None:
            return VerifyResult(0.0, "ok", "no answer found in the response")
        return VerifyResult(float(equal(gold, pred)), "ok")
    except TimeoutException as e:
        return VerifyResult(None, "timeout", f"math-verify timed out ({e}); parse limit {PARSE_TIMEOUT_S} s, "
                                             f"compare limit {VERIFY_TIMEOUT_S} s")
    except Exception as e:  # noqa: BLE001 - verifiers never raise on model output
        return VerifyResult(None, "error", f"math-verify failed: {type(e).__name__}: {str(e)[:150]}")
