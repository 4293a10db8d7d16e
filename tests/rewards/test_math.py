"""The ``math`` verifier against real math-verify (no mocks): every row of the verdict rule, and its limits."""

import os
from pathlib import Path

import pytest

import rlpipe.rewards.math as math_mod
import rlpipe.rewards.math_equal as math_equal
from rlpipe.rewards import get_verifier, verifier_names
from rlpipe.rewards.audit import audit, load_labels
from rlpipe.rewards.math import boxed_contents, final_answer
from rlpipe.rewards.pool import VerifierPool

ROOT = Path(__file__).resolve().parents[2]

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
    assert v.version == "3"
    assert v.check_reference("\\frac{1}{2}") is None and v.check_reference("46") is None
    msg = v.check_reference("}{")
    assert BROKEN in msg and "fix the row's ground_truth" in msg
    assert NO_TRUTH in v.check_reference(None)
    # The pool's deadline must cover every math-verify call the verifier may make.
    assert v.budget_s("46") >= ((8 + math_mod.MAX_BOXES) * math_mod.PARSE_TIMEOUT_S
                                + (5 + math_mod.MAX_BOXES) * math_mod.VERIFY_TIMEOUT_S)


def test_math_verify_internal_timeout_is_timeout_not_zero(monkeypatch):
    # Real math-verify, real signal.alarm (only the limit is lowered, to keep the test fast): comparing a
    # power tower with 1 cannot finish in 1 s. (Not (x+1)^300: sympy caches it and a rerun is fast.)
    monkeypatch.setattr(math_equal, "VERIFY_TIMEOUT_S", 1)  # where the comparison reads it
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
    with pytest.raises(KeyError, match="unknown verifier .astrology.; valid: .*math"):
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


def _verdict(response, truth):
    res = get_verifier("math")(response, truth)
    assert res.status == "ok", res
    return res.reward, res.reason


TWO = "0, by the two-answers rule"


@pytest.mark.parametrize("response,truth,reward", [
    # A hedge names two different values: wrong whichever one the reference is.
    ("The answer is 3 or 4.", "3", TWO),
    ("The answer is 3 or 4.", "4", TWO),
    ("So $x = 3$ or $x = 4$.", "3", TWO),
    ("I believe the answer is 10, or maybe 12.", "10", TWO),
    ("Answer: 3 (or possibly 4)", "3", TWO),
    (r"The probability is $\frac{1}{2}$ or $\frac{1}{3}$.", r"\frac{1}{3}", TWO),
    (r"The final answer is $\boxed{3 \text{ or } 4}$.", "3", TWO),
    ("The answer is 3 and 4.", "3", TWO),
    ("The answer is 3. Alternatively, it could be 4.", "3", TWO),
    ("The answer is 3 (if n is even) or 4 (if n is odd).", "3", TWO),
    # Conditions joined by "and" are not two answers.
    ("Since $x^2 = 16$ and $x > 0$, we have $x = 4$.", "4", 1.0),
    # Several boxes with different values and no correction between them.
    (r"$\boxed{3}$ $\boxed{4}$", "4", TWO),
    (r"The answer is $\boxed{12}$. Let me double check $\boxed{15}$: no, 15 does not work.", "15", TWO),
    (r"The answer is $\boxed{3}$. Is $\boxed{4}$ also possible? No, it is extraneous.", "4", TWO),
    # ... a correction makes the last box the answer, unless the text after it rejects it.
    (r"The answer is $\boxed{B}$. Wait, actually I made an error; the correct choice is $\boxed{C}$.", "C", 1.0),
    (r"The answer is $\boxed{B}$. Wait, actually I made an error; the correct choice is $\boxed{C}$.", "B", 0.0),
    (r"$\boxed{2}$. Wait, actually $\boxed{3}$ is not right either.", "3", TWO),
    (r"The answer is $\boxed{3}$. Wait, is it $\boxed{4}$? The sum would be 11. So it's 3.", "4", TWO),
    # Boxed steps, then the answer stated: the steps are not answers.
    (r"$0.04 \cdot 10,000 = \boxed{400}$, then $\boxed{612}$ more. The final answer is $1012$.", "1012", 1.0),
    (r"Part one gives $\boxed{12}$ and part two $\boxed{2}$. The final answer is $\boxed{14}$.", "14", 1.0),
    (r"The final answer is $\boxed{3}$ or $\boxed{4}$.", "4", TWO),
    # One value in two spellings is one answer.
    (r"The answer is $\boxed{\frac12}$, or in decimal form $\boxed{0.5}$.", "0.5", 1.0),
    ("The answer is 6 or 6.0, the same number.", "6", 1.0),
    (r"The answer is $\boxed{42}$. Double-checking: yes, $\boxed{42}$.", "42", 1.0),
    # A reference that is itself a set or a list accepts both values, and only both.
    ("The answer is 3 or 4.", "3, 4", 1.0),
    ("$x = 3$ or $x = 4$", "x=3 or x=4", 1.0),
    (r"$\boxed{3 \text{ or } 4}$", r"\{3, 4\}", 1.0),
    (r"The roots are $\boxed{2}$ and $\boxed{5}$.", "2, 5", 1.0),
    ("The answer is 3 or 4.", "3, 5", 0.0),
])
def test_two_different_final_answers_are_wrong(response, truth, reward):
    got, reason = _verdict(response, truth)
    assert (got, reason) == (0.0, math_mod.TWO_ANSWERS) if reward == TWO else got == reward, reason


@pytest.mark.parametrize("response,truth,reward", [
    (r"The answer is 3. Check: $3 \times 2 = 6$.", "6", 0.0),
    (r"The answer is 3. Check: $3 \times 2 = 6$.", "3", 1.0),
    ("So $x = 5$.\n\nVerification: $2(5) + 1 = 11$, as required.", "11", 0.0),
    ("So $x = 5$.\n\nVerification: $2(5) + 1 = 11$, as required.", "5", 1.0),
    ("Answer: 7\nCheck: 7^2 = 49", "49", 0.0),
    ("The answer is 3 (check: 3 × 2 = 6).", "6", 0.0),
    ("The answer is 3, since 3 + 3 = 6.", "6", 0.0),
    ("The answer is 3, since 3 + 3 = 6.", "3", 1.0),
    ("**Final answer:** 3\n\n**Verification:** 3*2 = 6", "6", 0.0),
    ("The answer is 3.\n\n### Verification\n3*2 = 6", "6", 0.0),
    ("x = 4. Let me check this: 4 + 4 = 8.", "8", 0.0),
    ("So the answer is $3$.\n\nTo double-check, $3 \\times 2 = 6$.", "6", 0.0),
    ("So the answer is $3$.\n\nTo double-check, $3 \\times 2 = 6$.", "3", 1.0),
    ("The answer is 3.5.", "3.5", 1.0),   # a decimal point is no sentence end
    # A check before the stated answer, or one the answer follows, leaves the answer where it is.
    (r"Check: $2 \cdot 3 = 6$ works. So the answer is 3.", "3", 1.0),
    ("Square 3 to get 9. Check: 9 - 6 = 3. So x = 3", "3", 1.0),
])
def test_a_self_check_is_not_the_answer(response, truth, reward):
    assert _verdict(response, truth)[0] == reward


@pytest.mark.parametrize("response,truth,reward", [
    (r"The probability is $\boxed{0.25\%}$.", "0.25", 0.0),   # 0.25% = 0.0025
    (r"$\boxed{\frac{1}{4}\%}$", r"\frac{1}{4}", 0.0),
    ("The probability is 0.3%.", "0.3", 0.0),
    (r"$\boxed{25\%}$", r"\frac{1}{4}", 1.0),                  # the value reading
    ("The probability is 30%.", "0.3", 1.0),
    (r"$\boxed{12.5\%}$", "12.5", 1.0),                         # a label on a percentage, not a probability
    (r"$\boxed{0.125}$", r"12.5\%", 1.0),
])
def test_percent_is_no_label_on_a_probability(response, truth, reward):
    assert _verdict(response, truth)[0] == reward


@pytest.mark.parametrize("response,truth,reward", [
    (r"$\boxed{5\mathrm{~m}}$", r"5\text{ km}", 0.0),
    (r"$\boxed{8 \text{ cm}^3}$", r"8\text{ cm}^2", 0.0),
    (r"$\boxed{10 \text{ m/s}}$", r"10\text{ km/h}", 0.0),
    (r"$\boxed{15\text{ mph}}$", r"15\text{ km/h}", 0.0),
    (r"$\boxed{5 cm}$", r"5\text{ km}", 0.0),                  # a known unit written bare
    (r"$\boxed{25°C}$", r"25^\circ F", 0.0),
    ("The volume is 8 cm³.", r"8\text{ cm}^2", 0.0),
    (r"$\boxed{8 \text{ cm}²}$", r"8\text{ cm}^2", 1.0),
    (r"$\boxed{36 \text{ km}/\text{h}}$", r"36\text{ m/s}", 0.0),
    (r"$\boxed{36 \text{ km}/\text{h}}$", r"36\text{ km/h}", 1.0),
    (r"$\boxed{60 \text{ mph}}$", r"60\text{ miles per hour}", 1.0),
    ("The car travels at 60 mph.", r"60\text{ miles per hour}", 1.0),
    (r"$\boxed{5 \text{ cm}}$", r"5\text{ centimeters}", 1.0),
    (r"$\boxed{9 \text{ sq ft}}$", r"9\text{ square feet}", 1.0),
    (r"$\boxed{8 \text{ cm}^2}$", r"8\text{ square centimeters}", 1.0),
    (r"$\boxed{5\mathrm{~km}}$", r"5\text{ kilometres}", 1.0),
    (r"$\boxed{61 \text{ mph}}$", r"60\text{ miles per hour}", 0.0),
])
def test_units_must_agree_in_any_spelling(response, truth, reward):
    got, reason = _verdict(response, truth)
    assert got == reward, reason


@pytest.mark.parametrize("response,truth,reward", [
    (r"$\boxed{0.\overline{3}}$", r"\frac{1}{3}", 1.0),          # repeating decimals
    (r"$\boxed{0.\overline{3}}$", "0.3", 0.0),
    (r"$\boxed{1.\overline{27}}$", r"\frac{14}{11}", 1.0),
    (r"$\boxed{45°}$", r"45^\circ", 1.0),                          # degrees
    (r"$\boxed{60°}$", r"30^\circ", 0.0),
    (r"$\boxed{\frac{1}{2}}$", r"\sin 30^\circ", 1.0),            # trig of degrees
    (r"$\boxed{\frac{\sqrt{3}}{2}}$", r"\sin 30^\circ", 0.0),
    (r"$\boxed{-1}$", "i^2", 1.0),                                 # the imaginary unit
    (r"$\boxed{1}$", "i^2", 0.0),
    (r"$\boxed{6.02e23}$", r"6.02 \times 10^{23}", 1.0),          # scientific notation
    ("The number of molecules is 6.02e23.", r"6.02 \times 10^{23}", 1.0),
    (r"$\boxed{6.02e22}$", r"6.02 \times 10^{23}", 0.0),
    (r"$\boxed{7 3/4}$", r"7\frac{3}{4}", 1.0),                    # mixed numbers
    ("The answer is 7 3/4.", "7.75", 1.0),
    (r"$\boxed{7\frac{3}{4}}$", r"\frac{21}{4}", 0.0),             # a sum, not 7 * 3/4
    ("Answer: 2 1/4", r"\frac{1}{2}", 0.0),
    ("The population is 3.5 million.", "3500000", 1.0),          # number words
    (r"$\boxed{3.5 \text{ million}}$", "350000", 0.0),
    (r"$\boxed{x > 3}$", r"(3, \infty)", 1.0),                     # inequality vs interval
    ("The solution is x > 3", r"(3,\infty)", 1.0),
    (r"$\boxed{x \ge 3}$", r"(3,\infty)", 0.0),
    (r"$\boxed{x \le 2 \text{ or } x \ge 5}$", r"(-\infty, 2] \cup [5, \infty)", 1.0),   # "or" is a union
    (r"The answer is $x \le 2$ or $x \ge 5$.", r"(-\infty, 2] \cup [5, \infty)", 1.0),
    (r"$\boxed{(-\infty, 2] \cup [5, \infty)}$", r"x \le 2 \text{ or } x \ge 5", 1.0),
    (r"$\boxed{x < 2 \text{ or } x \ge 5}$", r"(-\infty, 2] \cup [5, \infty)", 0.0),
    (r"$\boxed{x > 1, x < 3}$", r"(-\infty, \infty)", 0.0),     # overlapping: no union reading
    (r"The answer is $\boxed{A}$, no wait, it is $\boxed{C}$.", "C", 1.0),   # corrected choice
])
def test_forms_math_verify_misreads(response, truth, reward):
    got, reason = _verdict(response, truth)
    assert got == reward, reason


@pytest.mark.parametrize("response,truth,reward", [
    (r"$\boxed{18.90}$", r"\$18.90", 1.0),
    (r"$\boxed{\$18.90}$", r"\$18.90", 1.0),
    (r"The total is \$18.90.", r"\$18.90", 1.0),
    (r"$\boxed{18.9}$", r"\$18.90", 1.0),
    (r"$\boxed{\$18.09}$", r"\$18.90", 0.0),
    (r"$\boxed{\$1,250}$", "1250", 1.0),
])
def test_dollar_sign_references_parse(response, truth, reward):
    assert get_verifier("math").check_reference(truth) is None
    assert _verdict(response, truth)[0] == reward


def test_other_graders_audit_set():
    # An independent check: 354 cases from other graders' tests (hendrycks, MARIO, Qwen2.5-Math, prm800k,
    # Minerva, simple-evals, verl, DeepSeek) and model-style responses for each class of issue 41. Known
    # misses (false negatives, not paid): y = 2x+3 vs f(x) = 2x+3, and one physics expression sympy does not
    # simplify. A false positive here is a reward hack, so none is allowed.
    with VerifierPool(workers=max(2, min(8, os.cpu_count() or 2)), grace_s=5) as pool:
        report = audit(load_labels(ROOT / "datasets/audit/math_graders.jsonl"), pool)["math"]
    assert report["n"] >= 300
    assert report["false_positive"] == 0, report["disagreements"]
    assert report["agreement"] >= 0.98, report["disagreements"]
    for cat in ("hedged", "multi_box", "self_check", "percent_probability", "units_mismatch", "unit_synonyms",
                "repeating_decimal", "degrees", "imaginary", "sci_notation", "mixed_numbers", "number_words",
                "inequality_interval", "multiple_choice", "currency"):
        c = report["categories"][cat]
        assert c["n"] >= 7 and c["false_positive"] == 0 and c["agreement"] == 1.0, (cat, c)
