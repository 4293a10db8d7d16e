"""When the model's answer and the reference are one value: math-verify's comparison with rlpipe's
settings, the readings it misses (percent as a label, inequalities joined by "or" as a union, ``i`` as the
imaginary unit), and a fast path for plain numbers that needs no sympy.
"""

from __future__ import annotations

import re
from typing import Any

from rlpipe.rewards.math_parse import alarm_s

VERIFY_TIMEOUT_S = 3  # math-verify's alarms take whole seconds
FLOAT_ROUNDING = 10  # decimals agree when equal after rounding to 10 places
NUMERIC_PRECISION = 15


def same(g: Any, p: Any) -> bool:
    """math-verify's comparison with rlpipe's settings (raises its TimeoutException / errors)."""
    from math_verify import verify

    return verify(g, p, float_rounding=FLOAT_ROUNDING, numeric_precision=NUMERIC_PRECISION, strict=True,
                  allow_set_relation_comp=True, timeout_seconds=alarm_s(VERIFY_TIMEOUT_S), raise_on_error=True)


def equal(gold: Any, pred: Any) -> bool:
    """math-verify's comparison, then the percent-as-label reading, inequalities joined by "or" as a union,
    and ``i`` as the imaginary unit (the conventions in :mod:`rlpipe.rewards.math`)."""
    if same(gold, pred):
        return True
    g, p = _percent_value(gold), _percent_value(pred)
    # 0.25% is 0.0025: read as a label it would equal the probability 0.25, so not against a probability.
    if (g is not gold or p is not pred) and not (g is gold and _is_probability(gold)) and same(g, p):
        return True
    # "x <= 2 or x >= 5" describes (-oo, 2] U [5, oo); math-verify compares relations with sets one by one.
    gs, ps = _relations_as_set(gold), _relations_as_set(pred)
    if (gs is not gold or ps is not pred) and same(gs, ps):
        return True
    # i is the imaginary unit where it is the only letter on both sides (MARIO's rule): i^2 = -1.
    return _only_symbol_i(gold, pred) and same(_with_imaginary_unit(gold), _with_imaginary_unit(pred))


def _percent_value(x: Any) -> Any:
    """``12%`` (math-verify: ``12 * UnevaluatedExpr(1/100)``) → ``12``; anything else unchanged."""
    from sympy import Mul, Rational, UnevaluatedExpr

    if isinstance(x, Mul) and len(x.args) == 2 and x.args[1] == UnevaluatedExpr(Rational(1, 100)):
        return x.args[0]
    return x


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


_PLAIN_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _plain_number(text: str) -> str | None:
    """``46``, ``-2.5`` or ``\\boxed{46}`` as the *whole* text, else None (the fast path's input)."""
    t = text.strip()
    m = re.fullmatch(r"\\boxed\{\s*([^{}]*?)\s*\}", t)
    t = m.group(1) if m else t
    return t if _PLAIN_NUMBER.fullmatch(t) else None


def fast_verdict(response: str, ground_truth: str) -> float | None:
    """Plain number against plain number, compared exactly as decimals without loading sympy; else None."""
    from decimal import Decimal

    a, g = _plain_number(response), _plain_number(ground_truth)
    if a is None or g is None:
        return None
    return float(Decimal(a) == Decimal(g))
