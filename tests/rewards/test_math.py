"""The ``math`` verifier against real math-verify (no mocks): every row of the verdict rule, and its limits."""

import pytest

import rlpipe.rewards.math as math_mod
from rlpipe.rewards import get_verifier, verifier_names
from rlpipe.rewards.math import boxed_contents, final_answer

BROKEN = "cannot be parsed"
NO_TRUTH = "no ground truth"


@pytest.mark.parametrize(
    "response,truth,status,reward,reason",
    [
        # The reference's fault: error naming the fix, never 0/ok (whatever the answer is).
        ("46", None, "error", None, NO_TRUTH),
        ("46", "", "error", None, NO_TRUTH),
        ("46", "   ", "error", None, NO_TRUTH),
        ("46", "}{", "error", None, BROKEN),
        ("\\boxed{1}", "\\frac{", "error", None, BROKEN),
        ("", "}{", "error", None, BROKEN),
        # Nothing to judge.
        ("", "46", "ok", 0.0, "empty answer"),  # no answer is a wrong answer: never an escape from the penalty
        ("  \n ", "46", "ok", 0.0, "empty answer"),
        # The model gave no answer / a wrong one: 0/ok.
        ("I cannot solve this.", "7", "ok", 0.0, "no answer"),
        ("\\boxed{}", "3", "ok", 0.0, "no answer"),
        ("47", "46", "ok", 0.0, ""),
        ("22", "-22", "ok", 0.0, ""),
        ("\\boxed{0.333}", "\\frac{1}{3}", "ok", 0.0, ""),
        ("\\boxed{1\\,234}", "235", "ok", 0.0, ""),
        ("\\boxed{[1,2]}", "[1,2)", "ok", 0.0, ""),
        ("\\boxed{2}", "2, 3", "ok", 0.0, ""),
        ("\\boxed{2} and \\boxed{1}", "(1,2)", "ok", 0.0, ""),
        # Equivalent forms: 1/ok.
        ("46", "46", "ok", 1.0, ""),
        ("46.0", "46", "ok", 1.0, ""),
        ("so \\boxed{408}", "408", "ok", 1.0, ""),
        ("\\boxed{\\frac{3}{4}}", "0.75", "ok", 1.0, ""),
        ("\\boxed{0.5}", "$\\frac{1}{2}$", "ok", 1.0, ""),
        ("\\boxed{\\frac{1}{2}}", "\\frac12", "ok", 1.0, ""),
        ("\\boxed{x \\in [1,2)}", "[1,2)", "ok", 1.0, ""),
        ("\\boxed{1 \\le x < 2}", "[1,2)", "ok", 1.0, ""),
        ("\\boxed{1\\,234}", "1234", "ok", 1.0, ""),
        ("\\boxed{12.5\\%}", "12.5", "ok", 1.0, ""),
        ("\\boxed{5\\text{ cm}}", "5", "ok", 1.0, ""),
        # Several boxes against a reference with several answers.
        ("\\boxed{2} and \\boxed{3}", "2, 3", "ok", 1.0, ""),
        ("\\boxed{2} and \\boxed{3}", "\\{2,3\\}", "ok", 1.0, ""),
        ("The roots are \\boxed{2}. The other root is \\boxed{3}.", "2, 3", "ok", 1.0, ""),
        ("\\boxed{1} and \\boxed{2}", "(1,2)", "ok", 1.0, ""),
        # ... but against a single reference the last box counts.
        ("first \\boxed{47} then corrected: \\boxed{46}", "46", "ok", 1.0, ""),
        ("I think 46, so \\boxed{47}", "46", "ok", 0.0, ""),
    ],
)
def test_math_verdicts(response, truth, status, reward, reason):
    res = get_verifier("math")(response, truth)
    assert (res.status, res.reward) == (status, reward), res.reason
    assert reason in res.reason


def test_reference_check_and_budget_are_declared():
    v = get_verifier("math")
    assert v.version == "2"
    assert v.check_reference("\\frac{1}{2}") is None and v.check_reference("46") is None
    msg = v.check_reference("}{")
    assert BROKEN in msg and "fix the row's ground_truth" in msg
    assert NO_TRUTH in v.check_reference(None)
    # The pool's deadline must cover every math-verify call the verifier may make.
    assert v.budget_s("46") >= 3 * math_mod.PARSE_TIMEOUT_S + 2 * math_mod.VERIFY_TIMEOUT_S


def test_math_verify_internal_timeout_is_timeout_not_zero(monkeypatch):
    # Real math-verify, real signal.alarm (only the limit is lowered, to keep the test fast): comparing a
    # power tower with 1 cannot finish in 1 s. (Not (x+1)^300: sympy caches it and a rerun is fast.)
    monkeypatch.setattr(math_mod, "VERIFY_TIMEOUT_S", 1)
    res = get_verifier("math")("\\boxed{9^{9^{9^{9}}}}", "1")
    assert res.status == "timeout" and res.reward is None, res
    assert "timed out" in res.reason


def test_boxes_and_final_answer():
    assert boxed_contents("a \\boxed{1} b \\fbox{\\frac{2}{3}} c \\boxed{x") == ["1", "\\frac{2}{3}", "x"]
    assert final_answer("first \\boxed{1} then \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert final_answer("no box 12") == "no box 12"
    assert final_answer("\\boxed{unclosed") == "unclosed"


def test_exact_is_strict_and_registry_lists_names():
    assert get_verifier("exact")("46.0", "46").reward == 0.0
    assert get_verifier("exact")("46", None).status == "error"
    assert {"exact", "math"} <= set(verifier_names())
    with pytest.raises(KeyError, match="known: "):
        get_verifier("astrology")


@pytest.mark.parametrize("response,truth,status,reward", [
    ("46", "46", "ok", 1.0),
    (" \\boxed{46} ", "46", "ok", 1.0),
    ("46.0", "46", "ok", 0.0),       # exact means exact: the model's wrong form scores 0
    ("", "46", "ok", 0.0),  # no answer is a wrong answer
    ("46", None, "error", None),      # the reference's fault, never 0/ok
    ("46", "  ", "error", None),
])
def test_exact_verdict_rule(response, truth, status, reward):
    res = get_verifier("exact")(response, truth)
    assert (res.status, res.reward) == (status, reward), res.reason
    assert (get_verifier("exact").check_reference(truth) is None) == (status != "error")
