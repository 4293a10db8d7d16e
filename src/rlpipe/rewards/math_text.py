"""A math response read as text, before math-verify sees it: its boxes, the fixes applied to both sides
before parsing, and an answer written without LaTeX delimiters.

Nothing here parses mathematics: these are regular expressions over the response, so they are cheap and
cannot time out. :mod:`rlpipe.rewards.math_parse` hands what they produce to math-verify.
"""

from __future__ import annotations

import re

from rlpipe.rewards.math_forms import rewrite_forms

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
LATEX_DELIMS = re.compile(r"\$|\\\[|\\\(|\\boxed|\\fbox")
# 1\,234  1{,}234  1\ 234  1~234  "1 234": a digit group separator inside a number, not a product.
_DIGIT_GROUPS = re.compile(r"(?<![\d.])\d{1,3}(?:(?:\\,|\{,\}|\\ |~|\\;|\\!| )\d{3})+(?![\d])")
_GROUP_SEP = re.compile(r"\\,|\{,\}|\\ |~|\\;|\\!| ")
# Where a response names its answer: "the answer is", "result:", "solution set =".
ANSWER_IS = re.compile(r"(?:answer|result|solution(?: set)?)\s*(?:is|:|=)\s*", re.I)
# After the last box, the answer stated again with a value: "The final answer is $10,455$".
ANSWER_AFTER = re.compile(r"\banswer\s*(?:is|:|=)\s*:?\s*[-+($\\\d]", re.I)


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


def normalize(text: str) -> str:
    """The text fixes applied to both the reference and the answer before math-verify parses them."""
    text = _comma_lists(rewrite_forms(_join_digit_groups(text)))
    return _ON_THE_HOUR.sub(r"\1", _UPRIGHT_E.sub("e", text))


# A plain-text answer that reads as LaTeX math: digits, one-letter variables, operators, brackets, and
# a few function names (``2x+1``, ``x^2+1``, ``sqrt(2)/2``). Prose has longer words and is left alone.
_MATHLIKE = re.compile(r"(?:[\d.,+\-*/^()\[\]{}<>=| ]|\b[a-zA-Z]\b|(?<![a-zA-Z])[a-zA-Z](?=[\d(^_ +\-*/)]|$)|"
                       r"sqrt|pi|log|ln|sin|cos|tan|exp|infty|inf|\\[a-zA-Z]+)+")

# Where the value after "the answer is" ends: the sentence ("3. Check: 3 x 2 = 6"), a line, or a reason.
_STATEMENT_END = re.compile(r"\.(?=\s|$)|\n|;|,\s*(?:since|because|as|which|so|for|but)\b", re.I)


def plain_candidate(text: str) -> str | None:
    """The final answer of a response written without LaTeX delimiters, when it reads as math, else None:
    the rest of the sentence after the last "the answer is", else the whole text."""
    if LATEX_DELIMS.search(text):
        return None
    parts = ANSWER_IS.split(text)
    cand = parts[-1] if len(parts) > 1 else text
    cand = (_STATEMENT_END.split(cand, maxsplit=1)[0] if len(parts) > 1 else cand).strip().rstrip(".").strip()
    return cand if cand and _MATHLIKE.fullmatch(cand) else None
