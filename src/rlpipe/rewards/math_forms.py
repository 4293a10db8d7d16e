"""Answer forms math-verify misreads, rewritten as text before it parses, and the units an answer names.

Every rewrite here turns a form into one math-verify reads correctly and is applied to the reference and
the answer alike, so a rewrite can never make two different values equal: it only fixes what a form means.
Each was found by an audit case (``datasets/audit/math_graders.jsonl``, category in brackets):

- ``\\$18.90`` (an answer key's dollar sign) made the reference unparseable; the ``\\$`` is dropped
  [currency].
- ``45°`` was "no answer"; the sign is written ``^{\\circ}``, which math-verify reads as a label, and
  ``25°C`` / ``77^\\circ F`` become the units ``degC`` / ``degF`` [degrees].
- ``\\sin 30^\\circ`` was read as the sine of 30 radians; a degree argument of a trig function is
  converted to radians [degrees].
- ``0.\\overline{3}`` was "no answer" (Minerva's normaliser even reads it as 0.3); a repeating decimal
  is written as its exact fraction [repeating_decimal].
- ``6.02e23`` was read as 6.02·e·23, and ``6.02 \\times 10^{23}`` as a 15-digit float that math-verify
  rounds to 10 decimal places (so it differed from the integer 602000000000000000000000); e-notation,
  ``× 10^n`` and ``3.5 million`` are written out as exact plain decimals [sci_notation, number_words].
- ``cm²`` / ``x³``: superscript digits are written ``^{2}`` / ``^{3}``.
- ``7 3/4`` was read as 7·3/4 = 21/4; a whole number, a space and a proper fraction is a mixed number
  (prm800k's grader reads it so too) [mixed_numbers].

Units: math-verify drops unit words, so ``5 m`` matched ``5 km``. :func:`unit_of` finds the unit an answer
ends with and spells it one way (``mph`` = ``miles per hour`` = ``mi/h``, ``cm^2`` = ``square centimeters``),
so the verifier can refuse different units and accept synonyms [units_mismatch, unit_synonyms].
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

_DOLLAR = re.compile(r"\\\$\s*")
_DEGREE_SIGN = re.compile(r"\s*[°º]")
_TEMPERATURE = re.compile(r"\s*(?:[°º]|\^\s*(?:\{\s*\\circ\s*\}|\\circ))\s*([CF])\b")
_NUM = r"\d+(?:\.\d+)?"
_TRIG_DEGREES = re.compile(r"(\\(?:sin|cos|tan|sec|csc|cot))\s*(\(|\\left\()?\s*(-?" + _NUM +
                           r")\s*\^\s*(?:\{\s*\\circ\s*\}|\\circ)\s*(\)|\\right\))?")
_REPEATING = re.compile(r"(-?)(\d{0,30})\.(\d{0,30})\\overline\s*\{\s*(\d{1,30})\s*\}")
_E_NOTATION = re.compile(r"(?<![\w.\\])(" + _NUM + r")[eE]([+-]?\d{1,2})(?!\w|\.\d)")
_TIMES_TEN = re.compile(r"(?<![\w.\\^])(" + _NUM + r")\s*(?:\\times|\\cdot|×|\*)\s*10\s*\^\s*"
                        r"(?:\{\s*([+-]?\d{1,2})\s*\}|([+-]?\d{1,2}))(?![\d.])")
_SCALE = {"thousand": 3, "million": 6, "billion": 9, "trillion": 12}
_NUMBER_WORD = re.compile(r"(?<![\w.])(" + _NUM + r")\s*(?:\\(?:text|mbox|mathrm|textrm)\s*\{\s*)?"
                          r"(thousand|million|billion|trillion)\b\s*\}?")
_MIXED = re.compile(r"(?<![\w.,/^}\\])(-?)(\d+)(?:\s+|\s*\\[,;: ]\s*)([1-9]\d*)/([1-9]\d*)(?![\w/]|\.\d)")


def _plain_decimal(d: Decimal) -> str:
    """A Decimal as digits without an exponent (``6.02E+23`` → ``602000000000000000000000``)."""
    s = format(d.normalize(), "f")
    return s if "." not in s else s.rstrip("0").rstrip(".")


def _frac(f: Fraction) -> str:
    sign = "-" if f < 0 else ""
    return f"{sign}\\frac{{{abs(f.numerator)}}}{{{f.denominator}}}" if f.denominator != 1 else str(f.numerator)


def _repeating(m: re.Match[str]) -> str:
    """``1.2\\overline{7}`` → its exact fraction: whole part + (digits with one period − digits before it) / …"""
    sign, whole, fixed, period = m.groups()
    value = Fraction(int(whole or 0)) + Fraction(int(fixed + period) - int(fixed or 0),
                                                  10 ** len(fixed) * (10 ** len(period) - 1))
    return _frac(-value if sign else value)


def _scaled(m: re.Match[str], exponent: int) -> str:
    try:
        return _plain_decimal(Decimal(m.group(1)).scaleb(exponent))
    except InvalidOperation:  # an exponent beyond Decimal's context: leave the text as written
        return m.group(0)


def _mixed(m: re.Match[str]) -> str:
    sign, whole, num, den = m.groups()
    if int(den) == 0 or int(num) >= int(den):  # 7 8/4 is not a mixed number; leave it alone
        return m.group(0)
    value = int(whole) + Fraction(int(num), int(den))
    return _frac(-value if sign else value)


def _trig_degrees(m: re.Match[str]) -> str:
    fn, _, deg, _ = m.groups()
    return f"{fn}(\\frac{{{deg}\\pi}}{{180}})"


def rewrite_forms(text: str) -> str:
    """Every rewrite of the module docstring, in an order where each sees the previous one's output."""
    text = _DOLLAR.sub("", text).replace("²", "^{2}").replace("³", "^{3}")
    text = _TEMPERATURE.sub(r"\\text{ deg\1}", text)
    text = _DEGREE_SIGN.sub(r"^{\\circ}", text)
    text = _TRIG_DEGREES.sub(_trig_degrees, text)
    text = _REPEATING.sub(_repeating, text)
    text = _E_NOTATION.sub(lambda m: _scaled(m, int(m.group(2))), text)
    text = _TIMES_TEN.sub(lambda m: _scaled(m, int(m.group(2) or m.group(3))), text)
    text = _NUMBER_WORD.sub(lambda m: _scaled(m, _SCALE[m.group(2).lower()]), text)
    return _MIXED.sub(_mixed, text)


# ---- units ----------------------------------------------------------------------------------------------

_UNIT_WORDS = {
    "mm": ("millimeter", "millimetre", "mm"), "cm": ("centimeter", "centimetre", "cm"),
    "m": ("meter", "metre", "m"), "km": ("kilometer", "kilometre", "km"),
    "in": ("inch", "inches", "in"), "ft": ("foot", "feet", "ft"), "yd": ("yard", "yd"), "mi": ("mile", "mi"),
    "s": ("second", "sec", "s"), "min": ("minute", "min"), "h": ("hour", "hr", "h"), "day": ("day",),
    "week": ("week", "wk"), "month": ("month",), "year": ("year", "yr"),
    "mg": ("milligram", "mg"), "g": ("gram", "g", "gm"), "kg": ("kilogram", "kg"), "lb": ("pound", "lb"),
    "oz": ("ounce", "oz"), "ml": ("milliliter", "millilitre", "ml"), "l": ("liter", "litre", "l"),
    "deg": ("degree", "deg"), "usd": ("dollar",), "cent": ("cent",),
}
_CANONICAL = {w: c for c, words in _UNIT_WORDS.items() for w in words}
_SPEEDS = {"mph": "mi/h", "kph": "km/h", "kmph": "km/h", "kmh": "km/h", "fps": "ft/s"}
_NOT_UNITS = {"or", "and", "e", "i", "", "if", "for", "when", "where", "so", "to", "th", "st", "nd", "rd"}
# \text{ cm}^2, \mathrm{~m}, \mbox{km/h}: the braces' content and a power after them.
_TEXT_UNIT = re.compile(r"\\(?:text|mathrm|mbox|textrm|operatorname)\s*\{([^{}]*)\}(\s*\^\s*\{?\s*[23]\s*\}?)?")
_UNIT_OVER_UNIT = re.compile(r"\}\s*/\s*\\(?:text|mathrm|mbox|textrm)\s*\{")
# 5 cm, 60 mph, 9 sq ft at the end of a box or answer: a number, a space, then unit letters.
_BARE_UNIT = re.compile(r"\d\s*(?:\\[,;:! ]|~|\s)\s*((?:sq\.?\s+|square\s+|cubic\s+|cu\.?\s+)?[A-Za-z][A-Za-z/ ]*"
                        r"(?:\^\s*\{?\s*[23]\s*\}?)?)\s*\.?\s*$")


def _singular(word: str) -> str:
    if word in _CANONICAL:
        return word
    for suffix in ("es", "s"):
        if word.endswith(suffix) and word[: -len(suffix)] in _CANONICAL:
            return word[: -len(suffix)]
    return word[:-1] if word.endswith("s") and len(word) > 3 else word


def _base(part: str) -> str:
    """One factor of a unit (``square centimeters``, ``cm^2``, ``hrs``) as ``cm^2`` / ``h`` / the word."""
    part = part.strip()
    power = ""
    if m := re.fullmatch(r"(?:sq\.?|square)\s+(.+)", part):
        part, power = m.group(1), "^2"
    elif m := re.fullmatch(r"(?:cu\.?|cubic)\s+(.+)", part):
        part, power = m.group(1), "^3"
    elif m := re.fullmatch(r"(.+?)\s*\^\s*\{?\s*([23])\s*\}?", part):
        part, power = m.group(1), f"^{m.group(2)}"
    elif m := re.fullmatch(r"(.+?)\s+(squared|cubed)", part):
        part, power = m.group(1), "^2" if m.group(2) == "squared" else "^3"
    word = _singular(part.strip())
    return _CANONICAL.get(word, word) + power


def canonical_unit(unit: str) -> str | None:
    """One spelling per unit: ``miles per hour`` / ``mph`` → ``mi/h``; ``sq ft`` → ``ft^2``; None when no unit."""
    u = re.sub(r"\\[,;:! ]|~", " ", unit).strip().strip(".").lower()
    u = re.sub(r"\s+", " ", u.replace(" per ", "/"))
    if u in _NOT_UNITS or re.search(r"\d", re.sub(r"\^\s*\{?\s*[23]\s*\}?", "", u)):
        return None
    if u in _SPEEDS:
        return _SPEEDS[u]
    if not re.fullmatch(r"[a-z][a-z /^{}23]*", u):  # (C), a formula: an answer, not a unit
        return None
    return "/".join(_base(p) for p in u.split("/"))


def unit_of(text: str) -> str | None:
    """The canonical unit ``text`` ends with: the last ``\\text{…}`` unit, else a known unit written bare after
    a number at the very end (``60 mph``); None when it names none."""
    text = _UNIT_OVER_UNIT.sub("/", text)  # \text{km}/\text{h} is one unit, km/h
    found = [canonical_unit(body + (power or "")) for body, power in _TEXT_UNIT.findall(text)]
    found = [u for u in found if u]
    if found:
        return found[-1]
    m = _BARE_UNIT.search(text.strip().rstrip("$").strip()[-80:])  # the end only: linear in a long response
    if m is None:
        return None
    unit = canonical_unit(m.group(1))
    # Bare letters are a unit only when every factor is a known one: 5 x is a product, not five x-units.
    known = set(_CANONICAL.values()) | set(_SPEEDS.values())
    return unit if unit and all(p.split("^")[0] in known for p in unit.split("/")) else None
