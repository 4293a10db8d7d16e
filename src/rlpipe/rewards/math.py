"""Math answers: ``math`` (math-verify: equivalent forms, LaTeX, fractions) and ``exact`` (string match).

math-verify's own timeout uses ``signal.alarm``, which only works on the main thread; callers
that score off the main thread must run this in a killable worker process with a hard timeout.
"""

from __future__ import annotations

import re

from rlpipe.rewards.base import VerifyResult, register_verifier

_BOXED = re.compile(r"\\boxed\{")


def final_answer(response: str) -> str:
    """The part of a response that counts: the last ``\\boxed{…}`` if any, else the text before the first end marker."""
    starts = [m.end() for m in _BOXED.finditer(response)]
    if starts:
        i, depth = starts[-1], 1
        for j in range(i, len(response)):
            depth += {"{": 1, "}": -1}.get(response[j], 0)
            if depth == 0:
                return response[i:j].strip()
        return response[i:].strip()
    return response.strip()


@register_verifier("exact", version="1")
def exact(response: str, ground_truth: str | None) -> VerifyResult:
    if ground_truth is None:
        return VerifyResult(None, "error", "no ground truth")
    return VerifyResult(float(final_answer(response) == ground_truth.strip()), "ok")


@register_verifier("math", version="1")
def math_answer(response: str, ground_truth: str | None) -> VerifyResult:
    if ground_truth is None:
        return VerifyResult(None, "error", "no ground truth")
    try:
        from math_verify import parse, verify

        answer = final_answer(response)
        if not answer:
            return VerifyResult(None, "unparseable", "empty answer")
        # Both sides go through math-verify's LaTeX extraction as a boxed answer: plain numbers,
        # LaTeX (\\frac, \\sqrt, …) and expressions are all read the same way.
        gold = parse(f"\\boxed{{{ground_truth}}}")
        pred = parse(f"\\boxed{{{answer}}}")
        if not pred:
            return VerifyResult(None, "unparseable", f"no expression in {answer[:80]!r}")
        return VerifyResult(float(bool(verify(gold, pred))), "ok")
    except Exception as e:  # noqa: BLE001 - verifiers never raise on model output
        return VerifyResult(None, "error", f"{type(e).__name__}: {e}"[:200])
