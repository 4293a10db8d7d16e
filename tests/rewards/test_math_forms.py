"""The text rewrites and unit spellings the ``math`` verifier applies before math-verify parses (no sympy)."""

import pytest

from rlpipe.rewards.math_forms import canonical_unit, rewrite_forms, unit_of


@pytest.mark.parametrize("text,rewritten", [
    (r"\$18.90", "18.90"),                                   # an answer key's dollar sign
    (r"It costs \$ 5.50", "It costs 5.50"),
    ("45°", r"45^{\circ}"),                                  # the degree sign as math-verify's label
    ("25°C", r"25\text{ degC}"),                             # a temperature keeps its scale as a unit
    (r"\sin 30^\circ", r"\sin(\frac{30\pi}{180})"),          # trig of degrees in radians
    (r"\boxed{\cos(120^{\circ})}", r"\boxed{\cos(\frac{120\pi}{180})}"),  # the box's brace is kept
    (r"0.\overline{3}", r"\frac{1}{3}"),                     # repeating decimals, exactly
    (r"1.\overline{27}", r"\frac{14}{11}"),
    (r"-0.1\overline{6}", r"-\frac{1}{6}"),
    ("6.02e23.", "602000000000000000000000."),               # e-notation; the full stop is a full stop
    ("1e-3", "0.001"),
    (r"6.02 \times 10^{23}", "602000000000000000000000"),    # x 10^n, exact (not a 15-digit float)
    (r"2.5 \cdot 10^{-2}", "0.025"),
    (r"x^2 \times 10^3", r"x^2 \times 10^3"),                 # only a number times a power of ten
    ("3.5 million", "3500000"),
    (r"3.5 \text{ million}", "3500000"),
    ("7 3/4", r"\frac{31}{4}"),                              # mixed numbers are sums
    (r"\boxed{-1 1/2}", r"\boxed{-\frac{3}{2}}"),
    ("7 8/4", "7 8/4"),                                      # not a proper fraction: left alone
    ("2e^{x}", "2e^{x}"),                                    # Euler's number is no exponent marker
    ("8 cm² and x³", "8 cm^{2} and x^{3}"),                    # superscript digits
])
def test_rewrite_forms(text, rewritten):
    assert rewrite_forms(text) == rewritten


@pytest.mark.parametrize("unit,canonical", [
    ("mph", "mi/h"), ("miles per hour", "mi/h"), ("mi/h", "mi/h"),
    ("km/h", "km/h"), ("kilometers per hour", "km/h"), ("kmph", "km/h"), ("m/s", "m/s"),
    ("cm", "cm"), ("centimeters", "cm"), ("centimetre", "cm"), ("~m", "m"), ("metres", "m"), ("km", "km"),
    ("cm^2", "cm^2"), ("cm^{3}", "cm^3"), ("square centimeters", "cm^2"), ("sq ft", "ft^2"),
    ("cubic meters", "m^3"), ("hrs", "h"), ("minutes", "min"), ("lbs", "lb"), ("inches", "in"),
    ("or", None), ("e", None), ("(C)", None), ("2x+1", None),
])
def test_canonical_unit(unit, canonical):
    assert canonical_unit(unit) == canonical


@pytest.mark.parametrize("text,unit", [
    (r"5\mathrm{~m}", "m"), (r"5\text{ km}", "km"), (r"8 \text{ cm}^3", "cm^3"), (r"100 \mathrm{~cm}^{2}", "cm^2"),
    ("The car travels at 60 mph.", "mi/h"),        # a known unit written bare at the end
    (r"36 \text{ km}/\text{h}", "km/h"),            # one unit over another is one unit
    ("5 cm", "cm"),
    ("5 x", None), ("12 apples", None),            # bare letters that are no known unit
    (r"x=3 \text{ or } x=4", None), (r"\text{(C)}", None), ("46", None),
])
def test_unit_of(text, unit):
    assert unit_of(text) == unit
