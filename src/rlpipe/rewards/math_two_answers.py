"""The two-answers rule of the ``math`` verifier: a response that states two different final answers is
wrong, even when one of them is right, because paying it would teach a policy to hedge.

A response states two answers when its final statement joins different values (numbers, ``x = number``)
with "or", "and" or "alternatively" ("3 or 4", "x = 3 or x = 4", "10, or maybe 12", "3 (if n is even) or 4",
``\\boxed{3 \\text{ or } 4}``), or when it boxes different values (``\\boxed{3} … \\boxed{4}``) — unless the
words between the boxes correct the earlier one ("wait, actually", "correction", "I made an error") and the
last box closes the response (nothing after it rejects it or names another number), in which case the last
box is the answer; boxed intermediate steps followed by "the final answer is …" (boxed or not) are steps,
not answers. Two spellings of one value (``\\frac12`` or ``0.5``) are one answer. When the reference itself
holds several answers (``3, 4``, ``\\{3, 4\\}``, ``x=3 or x=4``) the values are read together as one list and
compared with it. The check runs on the response without a trailing self-check ("The answer is 3. Check:
3 × 2 = 6"): the check's numbers are not an answer.
"""

from __future__ import annotations

import re
from typing import Any

from rlpipe.rewards.math_equal import same
from rlpipe.rewards.math_parse import parse_text
from rlpipe.rewards.math_text import ANSWER_AFTER, ANSWER_IS, box_spans

TWO_ANSWERS = "the response states two different final answers"
MAX_BOXES = 4  # the last boxes compared with each other
MAX_HEDGED = 3  # the values joined by "or" read from the final statement

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


def drop_self_check(text: str) -> str:
    """The response without a trailing self-check: from the first check heading that follows a stated value
    ("x = 5. Check: …") and after which no answer is stated (no box, no "the answer is"), the text is the
    model checking its answer, not giving one."""
    for m in _CHECK.finditer(text):
        before, after = text[: m.start()], text[m.start():]
        last = re.split(r"(?<=[.!?])\s+|\n+", before.strip())[-1]
        if _STATES_VALUE.search(last) and not _STATES_ANSWER.search(after):
            return before
    return text


def box_verdict(text: str, multi: bool) -> tuple[str, Any]:
    """Several boxes with different values against a one-answer reference: ``("two", None)`` when the
    response states both, ``("last", value)`` when words between them correct the earlier one and nothing
    after the last rejects it; ``("", None)`` when the boxes agree or the reference holds several answers."""
    if multi:
        return "", None
    vals = [(s, e, parse_text(f"${c}$", answer_side=True)) for s, e, c in box_spans(text)[-MAX_BOXES:] if c]
    vals = [v for v in vals if v[2] is not None]
    if len(vals) < 2:
        return "", None
    start, end, last = vals[-1]
    differ = [e for _, e, v in vals[:-1] if not same(v, last)]
    # "… = \boxed{200} … = \boxed{255} … The final answer is 10,455": boxed steps, then the answer stated.
    if not differ or ANSWER_AFTER.search(text[end:]):
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
    phrase = [m.end() for m in ANSWER_IS.finditer(text)]
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


def hedge_verdict(text: str, multi: bool) -> tuple[str, Any]:
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
    parsed = [parse_text(f"${v}$", answer_side=True) for v in values]
    if not all(p is not None and _answer_like(p) for p in parsed) or all(same(parsed[0], p) for p in parsed[1:]):
        return "", None
    if not multi:
        return "two", None
    joined = parse_text("$" + ", ".join(values) + "$", answer_side=True)
    return ("list", joined) if joined is not None else ("", None)
