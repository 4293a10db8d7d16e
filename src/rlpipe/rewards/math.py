"""Math answers: ``math`` (math-verify: equivalent forms, LaTeX, fractions, sets) and ``exact`` (string match).

math-verify's own timeouts use ``signal.alarm``, which only works on a process's main thread;
the verifier pool runs each sample on a worker's main thread, so they work there. Off the main
thread (a Prefect task thread: SFT evaluation, dataset validation) math-verify would raise on
setting the alarm, so there the verifier calls it without its internal timeout: such callers
score the model's own short answers and references from the dataset, and the pool — the only
place arbitrary model output is judged in a run — still enforces a hard deadline from outside.

The two-answers rule: a response that states two different final answers is wrong, even when one of them
is right, because paying it would teach a policy to hedge. It states two answers when its final statement
joins different values (numbers, ``x = number``) with "or", "and" or "alternatively" ("3 or 4", "x = 3 or
x = 4", "10, or maybe 12", "3 (if n is even) or 4", ``\\boxed{3 \\text{ or } 4}``), or when it boxes
different values (``\\boxed{3} … \\boxed{4}``) — unless the words between the boxes correct the earlier
one ("wait, actually", "correction", "I made an error") and the last box closes the response (nothing
after it rejects it or names another number), in which case the last box is the answer; boxed
intermediate steps followed by "the final answer is …" (boxed or not) are steps, not answers. Two
spellings of one value (``\\frac12`` or ``0.5``) are one answer. When the reference itself holds several
answers (``3, 4``, ``\\{3, 4\\}``, ``x=3 or x=4``) the values are read together as one list and compared
with it. The check runs on the response without a trailing self-check ("The answer is 3. Check: 3 × 2 =
6"): the check's numbers are not an answer.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from rlpipe.rewards.base import VerifyResult, register_verifier
from rlpipe.rewards.math_forms import rewrite_forms, unit_of

# math-verify's alarms take whole seconds. The verifier makes at most 8 + MAX_BOXES parses (reference; answer
# as plain text, as written, its boxes joined; each of the last MAX_BOXES boxes; up to MAX_HEDGED values
# joined by "or", and them joined) and 5 + MAX_BOXES comparisons (plain, percent as a label, inequalities as
# sets, the imaginary unit; each box but the last with the last; the MAX_HEDGED - 1 other values with the first).
PARSE_TIMEOUT_S = 2
VERIFY_TIMEOUT_S = 3
MAX_BOXES = 4
MAX_HEDGED = 3
MATH_BUDGET_S = (8 + MAX_BOXES) * PARSE_TIMEOUT_S + (5 + MAX_BOXES) * VERIFY_TIMEOUT_S + 1.0
TWO_ANSWERS = "the response states two different final answers"
FLOAT_ROUNDING = 10  # decimals agree when equal after rounding to 10 places
NUMERIC_PRECISION = 15

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_LATEX_DELIMS = re.compile(r"\$|\\\[|\\\(|\\boxed|\\fbox")
# 1\,234  1{,}234  1\ 234  1~234  "1 234": a digit group separator inside a number, not a product.
_DIGIT_GROUPS = re.compile(r"(?<![\d.])\d{1,3}(?:(?:\\,|\{,\}|\\ |~|\\;|\\!| )\d{3})+(?![\d])")
_GROUP_SEP = re.compile(r"\\,|\{,\}|\\ |~|\\;|\\!| ")


def _alarm_s(seconds: int) -> int | None:
    """math-verify's timeout where its alarm can work (the main thread), else none (see the docstring)."""
    return seconds if threading.current_thread() is threading.main_thread() else None


class _BadReference(ValueError):
    """The row's ground truth cannot be judged against: the fault is the dataset's, not the model's."""


def box_spans(response: str) -> list[tuple[int, int, str]]:
    """(start, end, content) of every top-level ``\\boxed{…}`` / ``\\fbox{…}`` in order (an unclosed last box
    runs to the end)."""
    out, pos = [], 0
    while (m := _BOXED.search(response, pos)) is not None:
        i, depth = m.end(), 1
        for j in range(i, len(response)):
            depth += {"{": 1, "}": -1}.get(response[j], 0)
            if depth == 0:
                out.append((m.start(), j + 1, response[i:j].strip()))
                pos = j + 1
                break
        else:
            out.append((m.start(), len(response), response[i:].strip()))
            break
    return out


def boxed_contents(response: str) -> list[str]:
    """Every top-level ``\\boxed{…}`` / ``\\fbox{…}`` content in order (an unclosed last box runs to the end)."""
    return [content for _, _, content in box_spans(response)]


def final_answer(response: str) -> str:
    """The part of a response that counts for ``exact``: the last box if any, else the whole stripped text."""
    boxes = boxed_contents(response)
    return boxes[-1] if boxes else response.strip()


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


def _join_digit_groups(text: str) -> str:
    """``1\\,234`` → ``1234``: math-verify reads the LaTeX thin space as ``1 + 234`` (= 235)."""
    return _DIGIT_GROUPS.sub(lambda m: _GROUP_SEP.sub("", m.group(0)), text)


# A whole run of numbers joined by commas (``2,74``, ``0,111``, ``1,000.5``), not the inside of a bracket
# (``(0,9)``, ``[0,1)`` are read as lists already), and a proper thousands grouping.
_COMMA_RUN = re.compile(r"(?<![\d.,(\[{])\d+(?:\.\d+)?(?:,\d+(?:\.\d+)?)+(?![\d,)\]}]|\.\d)")
_THOUSANDS = re.compile(r"[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?")
# Euler's number written upright: math-verify drops \mathrm{…} / \text{…} as a unit, so 1 - 1/\mathrm{e} read as 1.
_UPRIGHT_E = re.compile(r"\\(?:mathrm|text|textrm|rm|mathit)\s*\{\s*e\s*\}")
# A clock time on the hour (``12:00``): read as a ratio its second term is 0 and math-verify fails on 12/0.
_ON_THE_HOUR = re.compile(r"(?<![\d.:])(\d{1,2}):00(?![\d:])")


def _comma_lists(text: str) -> str:
    """``2,74`` → ``2, 74``: a comma between digits that is not a thousands separator separates answers
    (the convention); math-verify read it as a decimal comma (2.74), and ``0,111`` as 0.111."""
    def fix(m: re.Match[str]) -> str:
        run = m.group(0)
        return run if _THOUSANDS.fullmatch(run) else run.replace(",", ", ")
    return _COMMA_RUN.sub(fix, text)


def _normalize(text: str) -> str:
    """The text fixes applied to both the reference and the answer before math-verify parses them."""
    text = _comma_lists(rewrite_forms(_join_digit_groups(text)))
    return _ON_THE_HOUR.sub(r"\1", _UPRIGHT_E.sub("e", text))


def _configs(answer_side: bool) -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    # On the answer side a box outranks "the answer is …" phrases: the model's box is its final word.
    latex = LatexExtractionConfig(boxed_match_priority=0) if answer_side else LatexExtractionConfig()
    return [latex, ExprExtractionConfig()]


def _parse(text: str, answer_side: bool) -> Any | None:
    """The first expression math-verify extracts (raises its TimeoutException / errors), else None."""
    from math_verify import parse

    found = parse(text, extraction_config=_configs(answer_side), parsing_timeout=_alarm_s(PARSE_TIMEOUT_S),
                  raise_on_error=True)
    return next((x for x in found if not isinstance(x, str)), None)


def _reference_text(ground_truth: str) -> str:
    """A reference already in math mode (``$…$``, ``\\[…\\]``, a box) is parsed as written; otherwise it is
    put in ``$…$`` so LaTeX without delimiters (``\\frac12``, ``[1,2)``, ``2, 3``) is read as LaTeX.
    (Re-wrapping everything in ``\\boxed{}`` mangled references that were already LaTeX.)"""
    gt = _normalize(ground_truth.strip())
    return gt if _LATEX_DELIMS.search(gt) else f"${gt}$"


def parse_reference(ground_truth: str | None) -> Any:
    """The reference as a sympy object; raises :class:`_BadReference` naming the problem and the fix."""
    if ground_truth is None or not str(ground_truth).strip():
        raise _BadReference("row has no ground truth (None or empty); fix the row's ground_truth")
    from math_verify.errors import TimeoutException

    try:
        gold = _parse(_reference_text(str(ground_truth)), answer_side=False)
    except TimeoutException:
        raise _BadReference(f"reference {str(ground_truth)[:80]!r} took over {PARSE_TIMEOUT_S} s to parse; "
                            "simplify the row's ground_truth") from None
    except Exception as e:  # noqa: BLE001 - any parser failure is the reference's problem here
        gold = None
        detail = f" ({type(e).__name__})"
    else:
        detail = ""
    if gold is None:
        raise _BadReference(f"reference {str(ground_truth)[:80]!r} cannot be parsed by math-verify{detail}; "
                            "fix the row's ground_truth (a number, or LaTeX such as \\frac{1}{2}, [1,2), \\{2,3\\})")
    return gold


def check_math_reference(ground_truth: str | None, **options: Any) -> str | None:
    """``None`` when math-verify can read the reference, else what is wrong and how to fix it."""
    try:
        parse_reference(ground_truth)
    except _BadReference as e:
        return str(e)
    return None


_PLAIN_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _plain_number(text: str) -> str | None:
    """``46``, ``-2.5`` or ``\\boxed{46}`` as the *whole* text, else None (the fast path's input)."""
    t = text.strip()
    m = re.fullmatch(r"\\boxed\{\s*([^{}]*?)\s*\}", t)
    t = m.group(1) if m else t
    return t if _PLAIN_NUMBER.fullmatch(t) else None


def _fast_verdict(response: str, ground_truth: str) -> float | None:
    """Plain number against plain number, compared exactly as decimals without loading sympy; else None."""
    from decimal import Decimal

    a, g = _plain_number(response), _plain_number(ground_truth)
    if a is None or g is None:
        return None
    return float(Decimal(a) == Decimal(g))


def _n_elements(x: Any) -> int:
    """How many answers ``x`` holds: a set/tuple's length, 2 for an open interval ``(a, b)`` (also a pair), else 1."""
    from sympy import FiniteSet, Interval, Tuple

    if isinstance(x, (FiniteSet, Tuple)):
        return len(x)
    if isinstance(x, Interval) and x.left_open and x.right_open and x.start.is_finite and x.end.is_finite:
        return 2
    return 1


# A plain-text answer that reads as LaTeX math: digits, one-letter variables, operators, brackets, and
# a few function names (``2x+1``, ``x^2+1``, ``sqrt(2)/2``). Prose has longer words and is left alone.
_MATHLIKE = re.compile(r"(?:[\d.,+\-*/^()\[\]{}<>=| ]|\b[a-zA-Z]\b|(?<![a-zA-Z])[a-zA-Z](?=[\d(^_ +\-*/)]|$)|"
                       r"sqrt|pi|log|ln|sin|cos|tan|exp|infty|inf|\\[a-zA-Z]+)+")
_ANSWER_IS = re.compile(r"(?:answer|result|solution(?: set)?)\s*(?:is|:|=)\s*", re.I)


# Where the value after "the answer is" ends: the sentence ("3. Check: 3 x 2 = 6"), a line, or a reason.
_STATEMENT_END = re.compile(r"\.(?=\s|$)|\n|;|,\s*(?:since|because|as|which|so|for|but)\b", re.I)


def _plain_candidate(text: str) -> str | None:
    """The final answer of a response written without LaTeX delimiters, when it reads as math, else None:
    the rest of the sentence after the last "the answer is", else the whole text."""
    if _LATEX_DELIMS.search(text):
        return None
    parts = _ANSWER_IS.split(text)
    cand = parts[-1] if len(parts) > 1 else text
    cand = (_STATEMENT_END.split(cand, maxsplit=1)[0] if len(parts) > 1 else cand).strip().rstrip(".").strip()
    return cand if cand and _MATHLIKE.fullmatch(cand) else None


def _parse_answer(text: str, gold: Any) -> Any | None:
    """The model's answer in the normalised response. Where the reference holds several answers and
    math-verify read one (it keeps only the last box unless boxes are adjacent or joined by "and"/","), all
    the boxes are read as one list. A plain-text answer that reads as math (``2x+1``, ``x^2+1``) is parsed as
    LaTeX, as references are."""
    boxes = box_spans(text)
    # Boxed steps, then "the final answer is …": the statement after the boxes is the answer (math-verify
    # would rank the last box first).
    tail = text[boxes[-1][1]:] if boxes and _ANSWER_AFTER.search(text[boxes[-1][1]:]) else ""
    pred = _parse(tail, answer_side=True) if tail else None
    cand = _plain_candidate(text)
    pred = pred if pred is not None or not cand else _parse(f"${cand}$", answer_side=True)
    pred = pred if pred is not None else _parse(text, answer_side=True)
    boxes = [content for _, _, content in boxes]
    if _n_elements(gold) > 1 and len(boxes) > 1 and (pred is None or _n_elements(pred) == 1):
        joined = _parse("$" + ", ".join(b for b in boxes if b) + "$", answer_side=True)
        pred = joined if joined is not None else pred
    return pred


# ---- the two-answers rule (see the ``math`` docstring) ----------------------------------------------------

# Between two boxes: words that make the later box a correction of the earlier one ("wait, actually …").
_CORRECTION = re.compile(r"\b(?:wait|actually|correct(?:ion|ed|ing)?|mistake|error|instead|on (?:second thought|"
                         r"reflection)|re-?(?:comput|calculat)\w*|(?:was|is) wrong|scratch that)\b", re.I)
# After the last box: words that reject it ("Is \boxed{4} possible? No, 4 is extraneous").
_REJECTION = re.compile(r"\b(?:no|not|\w+n't|fails?|wrong|incorrect|extraneous|reject\w*|discard\w*|impossible|"
                        r"invalid|too (?:big|large|small))\b", re.I)
# A self-check heading ("Check:", "Let me verify:", "Sanity check:") at the start of a sentence or line.
_CHECK = re.compile(r"(?:^|(?<=[.!?;(]))[ \t]*(?:#+\s*|\*\*)?(?:let(?:'s| me| us)\s+|to\s+|we can\s+|as an?\s+)?"
                    r"(?:double[- ]?check|sanity check|check|verify|verification)(?:ing)?"
                    r"(?:\s+(?:it|this|that|the answer))?(?:\*\*)?\s*[:,]", re.I | re.M)
# The sentence before a check states a value ("x = 5.", "The answer is 3.", "Answer: 7", "… is 15.").
_STATES_VALUE = re.compile(r"(?:\bis\b|\bare\b|=|:)\s*\$?\s*[-+(\\\d]")
# After the last box, the answer stated again with a value: "The final answer is $10,455$".
_ANSWER_AFTER = re.compile(r"\banswer\s*(?:is|:|=)\s*:?\s*[-+($\\\d]", re.I)
# Right before the last box: "The final answer is $\boxed{…}": the boxes before it were steps.
_FINAL_BEFORE = re.compile(r"final answer\s*(?:is|:|=)?\s*:?\s*\$*\s*$", re.I)
_STATES_ANSWER = re.compile(r"(?:answer|result)\s*(?:is|:|=)|\\boxed|\\fbox", re.I)
_TEXT_OR = re.compile(r"\\(?:text|mbox|textrm|mathrm)\s*\{\s*or\s*\}")
# One value on either side of "or": $…$, \(…\), "x = 3", a fraction or a number.
_VALUE = (r"(\$[^$]+\$|\\\((?:(?!\\\)).)+\\\)|(?<![\w.])(?:[a-zA-Z]\s*=\s*)?[-+]?(?:\\[dt]?frac\{[^{}]*\}\{[^{}]*\}|"
          r"\d+(?:\.\d+)?(?:/\d+)?))")
# What joins two stated values: "or" (with "maybe", "possibly" …), "and", "Alternatively, it could be"; a
# short condition may sit between ("3 (if n is even) or 4").
_JOIN = (r"[\s,;.)]*(?:\([^()]{0,40}\)\s*)?(?:\(?\s*\bor\b\s*\(?\s*(?:(?:maybe|possibly|perhaps|else|even|rather)\s+)*"
         r"|\band\b\s*|\b(?:alternatively|otherwise)\b[\s,]*(?:[A-Za-z']+\s+){0,5})")
_HEDGE = re.compile(_VALUE + _JOIN + _VALUE, re.I)


def _drop_self_check(text: str) -> str:
    """The response without a trailing self-check: from the first check heading that follows a stated value
    ("x = 5. Check: …") and after which no answer is stated (no box, no "the answer is"), the text is the
    model checking its answer, not giving one."""
    for m in _CHECK.finditer(text):
        before, after = text[: m.start()], text[m.start():]
        last = re.split(r"(?<=[.!?])\s+|\n+", before.strip())[-1]
        if _STATES_VALUE.search(last) and not _STATES_ANSWER.search(after):
            return before
    return text


def _box_verdict(text: str, multi: bool) -> tuple[str, Any]:
    """Several boxes with different values against a one-answer reference: ``("two", None)`` when the
    response states both, ``("last", value)`` when words between them correct the earlier one and nothing
    after the last rejects it; ``("", None)`` when the boxes agree or the reference holds several answers."""
    if multi:
        return "", None
    vals = [(s, e, _parse(f"${c}$", answer_side=True)) for s, e, c in box_spans(text)[-MAX_BOXES:] if c]
    vals = [v for v in vals if v[2] is not None]
    if len(vals) < 2:
        return "", None
    start, end, last = vals[-1]
    differ = [e for _, e, v in vals[:-1] if not _same(v, last)]
    # "… = \boxed{200} … = \boxed{255} … The final answer is 10,455": boxed steps, then the answer stated.
    if not differ or _ANSWER_AFTER.search(text[end:]):
        return "", None
    # A correction counts when the corrected box closes the response: nothing after it rejects it or goes
    # on to other numbers ("… \boxed{4}? The sum would be 11, so it's 3.").
    after = text[end:]
    closes = not (_REJECTION.search(after) or re.search(r"\d", after))
    final = _FINAL_BEFORE.search(text[max(0, start - 40):start]) is not None
    if closes and (final or _CORRECTION.search(text[differ[-1]:start])):
        return "last", last
    return "two", None


def _final_span(text: str) -> str:
    """Where the response states its answer: after the last "the answer is" or in the last box, whichever
    comes later, else the last sentence."""
    boxes = box_spans(text)
    phrase = [m.end() for m in _ANSWER_IS.finditer(text)]
    if phrase and (not boxes or phrase[-1] > boxes[-1][1]):
        return text[phrase[-1]:]
    if boxes:
        return boxes[-1][2]
    return re.split(r"(?<=[.!?])\s+|\n+", text.strip())[-1]


def _answer_like(x: Any) -> bool:
    """A number or ``x = number``: a value stated as an answer (``x^2 = 16``, ``x > 0`` are conditions)."""
    from sympy import Eq, Symbol

    if getattr(x, "is_number", False):
        return True
    return isinstance(x, Eq) and isinstance(x.lhs, Symbol) and bool(x.rhs.is_number)


def _hedge_verdict(text: str, multi: bool) -> tuple[str, Any]:
    """Values joined by "or" / "and" in the final statement ("3 or 4", "x = 3 or x = 4", "10, or maybe 12",
    "3 and 4", "3. Alternatively, it could be 4"): when they differ, ``("two", None)`` against a one-answer
    reference, ``("list", values)`` against a reference that holds several; ``("", None)`` when there is no
    hedge or its values are one value."""
    # The final statement's end only (a hedge closes the response): linear time on a long last sentence.
    span, values = _TEXT_OR.sub(" or ", _final_span(text)[-400:]), []
    for m in _HEDGE.finditer(span):
        values += [m.group(1), m.group(2)] if not values else [m.group(2)]
    values = [re.sub(r"^\$|\$$|^\\\(|\\\)$", "", v).strip() for v in values[:MAX_HEDGED]]
    if len(values) < 2:
        return "", None
    parsed = [_parse(f"${v}$", answer_side=True) for v in values]
    if not all(p is not None and _answer_like(p) for p in parsed) or all(_same(parsed[0], p) for p in parsed[1:]):
        return "", None
    if not multi:
        return "two", None
    joined = _parse("$" + ", ".join(values) + "$", answer_side=True)
    return ("list", joined) if joined is not None else ("", None)


def _units_differ(response: str, ground_truth: str) -> bool:
    """Both sides name a unit and not the same one: math-verify drops units, so 5 m would match 5 km.
    Units are compared spelled one way (:func:`~rlpipe.rewards.math_forms.unit_of`): mph = miles per hour."""
    boxes = boxed_contents(response)
    a, g = unit_of(boxes[-1] if boxes else response), unit_of(ground_truth)
    return a is not None and g is not None and a != g


def _percent_value(x: Any) -> Any:
    """``12%`` (math-verify: ``12 * UnevaluatedExpr(1/100)``) → ``12``; anything else unchanged."""
    from sympy import Mul, Rational, UnevaluatedExpr

    if isinstance(x, Mul) and len(x.args) == 2 and x.args[1] == UnevaluatedExpr(Rational(1, 100)):
        return x.args[0]
    return x


def _same(g: Any, p: Any) -> bool:
    """math-verify's comparison with rlpipe's settings (raises its TimeoutException / errors)."""
    from math_verify import verify

    return verify(g, p, float_rounding=FLOAT_ROUNDING, numeric_precision=NUMERIC_PRECISION, strict=True,
                  allow_set_relation_comp=True, timeout_seconds=_alarm_s(VERIFY_TIMEOUT_S), raise_on_error=True)


def _is_probability(x: Any) -> bool:
    """A number in [0, 1]: where ``p%`` read as the label ``p`` would name another probability."""
    try:
        return bool(x.is_number and 0 <= x <= 1)
    except (AttributeError, TypeError):
        return False


def _with_imaginary_unit(x: Any) -> Any:
    """The symbol ``i`` as sympy's imaginary unit (math-verify parses ``i^2`` as a variable squared)."""
    from sympy import I

    found = [s for s in getattr(x, "free_symbols", ()) if s.name == "i"]
    return x.subs(found[0], I) if found else x


def _relations_as_set(x: Any) -> Any:
    """``x <= 2 or x >= 5`` (math-verify: the set {x <= 2, x >= 5}) as the union of what each inequality
    describes, when they are in one variable and pairwise disjoint (then "and" would describe nothing, so
    "or" is the only reading); anything else unchanged."""
    from sympy import FiniteSet, Union
    from sympy.core.relational import Equality, Relational

    args = x.args if isinstance(x, FiniteSet) else ()
    if len(args) < 2 or not all(isinstance(a, Relational) and not isinstance(a, Equality) for a in args):
        return x
    if len(set().union(*(a.free_symbols for a in args))) != 1:
        return x
    sets = [a.as_set() for a in args]
    if any(not sets[i].intersect(sets[j]).is_empty for i in range(len(sets)) for j in range(i)):
        return x
    return Union(*sets)


def _only_symbol_i(*xs: Any) -> bool:
    names = {s.name for x in xs for s in getattr(x, "free_symbols", ())}
    return names == {"i"}


def _equal(gold: Any, pred: Any) -> bool:
    """math-verify's comparison, then the percent-as-label reading, inequalities joined by "or" as a union,
    and ``i`` as the imaginary unit (see the ``math`` docstring)."""
    if _same(gold, pred):
        return True
    g, p = _percent_value(gold), _percent_value(pred)
    # 0.25% is 0.0025: read as a label it would equal the probability 0.25, so not against a probability.
    if (g is not gold or p is not pred) and not (g is gold and _is_probability(gold)) and _same(g, p):
        return True
    # "x <= 2 or x >= 5" describes (-oo, 2] U [5, oo); math-verify compares relations with sets one by one.
    gs, ps = _relations_as_set(gold), _relations_as_set(pred)
    if (gs is not gold or ps is not pred) and _same(gs, ps):
        return True
    # i is the imaginary unit where it is the only letter on both sides (MARIO's rule): i^2 = -1.
    return _only_symbol_i(gold, pred) and _same(_with_imaginary_unit(gold), _with_imaginary_unit(pred))


@register_verifier("math", version="3", budget_s=MATH_BUDGET_S, check_reference=check_math_reference)
def math_answer(response: str, ground_truth: str | None) -> VerifyResult:
    """Is the model's final answer mathematically equivalent to the reference? (math-verify, plus fixes).

    Verdicts: a reference that is None, empty or unreadable by math-verify → ``error`` naming the row's
    fix (never 0/ok: the fault is the dataset's). An empty response → 0/``ok`` (no answer is a wrong answer). A response with no
    extractable expression (prose, ``\\boxed{}``) → 0/``ok``: the model failed to give an answer. Wrong →
    0/``ok``; equivalent → 1/``ok``. math-verify's own timeout → ``timeout``; its exceptions (called with
    ``raise_on_error=True``, so they are not silently False) → ``error``.

    Conventions (the audit set ``datasets/audit/math.jsonl`` is labelled by these):

    - The final answer is the last ``\\boxed{}``; without a box, math-verify's "final answer is" / last
      expression rules apply, on the response without a trailing self-check ("Check: …", "Let me verify:").
    - Two different final answers are a wrong answer (the two-answers rule in the module docstring).
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
    try:
        gold_text = str(ground_truth) if ground_truth is not None else None
        fast = _fast_verdict(response or "", gold_text) if gold_text else None
        if fast is not None:
            return VerifyResult(fast, "ok")
        gold = parse_reference(gold_text)
    except _BadReference as e:
        return VerifyResult(None, "error", str(e))
    if not response or not response.strip():
        return VerifyResult(0.0, "ok", "empty answer")
    if _units_differ(_normalize(response), _normalize(str(ground_truth))):
        return VerifyResult(0.0, "ok", "the answer's unit differs from the reference's")
    return _judge(response, gold)


def _judge(response: str, gold: Any) -> VerifyResult:
    """Parse and compare the model's answer; math-verify's timeouts and exceptions become statuses."""
    from math_verify.errors import TimeoutException

    try:
        text = _drop_self_check(_normalize(response))
        multi = _n_elements(gold) > 1
        boxes, hedge = _box_verdict(text, multi), _hedge_verdict(text, multi)
        if "two" in (boxes[0], hedge[0]):
            return VerifyResult(0.0, "ok", TWO_ANSWERS)
        pred = boxes[1] if boxes[0] == "last" else _parse_answer(text, gold)
        if hedge[0] == "list" and (pred is None or _n_elements(pred) == 1):
            pred = hedge[1]  # "3 or 4" against {3, 4}: math-verify read only the 3
        if pred is None:
            return VerifyResult(0.0, "ok", "no answer found in the response")
        return VerifyResult(float(_equal(gold, pred)), "ok")
    except TimeoutException as e:
        return VerifyResult(None, "timeout", f"math-verify timed out ({e}); parse limit {PARSE_TIMEOUT_S} s, "
                                             f"compare limit {VERIFY_TIMEOUT_S} s")
    except Exception as e:  # noqa: BLE001 - verifiers never raise on model output
        return VerifyResult(None, "error", f"math-verify failed: {type(e).__name__}: {str(e)[:150]}")
