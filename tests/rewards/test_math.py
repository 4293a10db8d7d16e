import pytest

from rlpipe.rewards import get_verifier, verifier_names
from rlpipe.rewards.math import final_answer


@pytest.mark.parametrize(
    "response,truth,status,reward",
    [
        ("46", "46", "ok", 1.0),
        ("46.0", "46", "ok", 1.0),
        ("-22", "-22", "ok", 1.0),
        ("22", "-22", "ok", 0.0),
        ("so \\boxed{408}", "408", "ok", 1.0),
        ("\\boxed{\\frac{3}{4}}", "0.75", "ok", 1.0),
        ("47", "46", "ok", 0.0),
        ("", "46", "unparseable", None),
        ("   ", "46", "unparseable", None),
        ("46", None, "error", None),
    ],
)
def test_math_verdicts(response, truth, status, reward):
    res = get_verifier("math")(response, truth)
    assert (res.status, res.reward) == (status, reward), res.reason


def test_final_answer_takes_the_last_boxed_and_nested_braces():
    assert final_answer("first \\boxed{1} then \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert final_answer("no box 12") == "no box 12"
    assert final_answer("\\boxed{unclosed") == "unclosed"


def test_exact_is_strict_and_registry_lists_names():
    assert get_verifier("exact")("46.0", "46").reward == 0.0
    assert {"exact", "math"} <= set(verifier_names())
    with pytest.raises(KeyError, match="known: "):
        get_verifier("astrology")
