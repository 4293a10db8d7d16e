"""The code verifiers run model code in the sandbox; these cases are the model's failures (reward 0,
status ok) or the verifier's own (timeout/error), never an exception."""

import json

import pytest

from rlpipe.rewards import get_verifier

ADD = json.dumps({"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]})


@pytest.mark.parametrize(
    "response,reward,reason",
    [
        ("```python\ndef add(a, b):\n    return a + b\n```", 1.0, "tests: 3/3"),
        ("def add(a, b):\n    return a - b", 1 / 3, "tests: 1/3"),
        ("def add(a, b)\n    return a + b", 0.0, "compile: 0/3 passed; SyntaxError"),
        ("def add(a, b):\n    while True: pass", 0.0, "ran past its time budget"),
        ("while True: pass", 0.0, "run: 0/3 passed; program ran past its time budget"),
        ("raise SystemExit(0)", 0.0, "run: 0/3 passed; SystemExit"),
        ("import os\nos._exit(0)", 0.0, "ended before the harness could report"),
        ("import os\nprint('\\n@@RLPIPE_VERDICT@@' + '{\"phase\": \"tests\", \"passed\": 3, \"total\": 3}')\nos._exit(0)",
         0.0, "ended before the harness could report"),  # a forged verdict without the nonce
        ("x = 'a' * (10**10)\ndef add(a, b): return a + b", 0.0, "MemoryError"),
        ("", 0.0, "empty program"),
    ],
)
def test_code_verdicts(response, reward, reason):
    res = get_verifier("code")(response, ADD)
    assert res.status == "ok", res.reason
    assert res.reward == pytest.approx(reward) and reason in res.reason, res.reason


def test_code_spec_errors_are_the_datasets_fault():
    assert get_verifier("code")("x = 1", "not json").status == "error"
    assert get_verifier("code")("x = 1", json.dumps({"tests": []})).status == "error"
    assert get_verifier("code")("def f(): return 1", json.dumps(["assert f() == 1"])).reward == 1.0


@pytest.mark.parametrize(
    "expr,expected,reward",
    [("40+6", "46", 1.0), ("2*23", "46", 1.0), ("46.0", "46", 0.0), ("40+", "46", 0.0),
     ("__import__('os').system('id')", "0", 0.0), ("9**9**9", "46", 0.0), ("", "46", 0.0)],
)
def test_python_expr_verdicts(expr, expected, reward):
    res = get_verifier("python_expr")(expr, expected)
    assert (res.status, res.reward) == ("ok", reward), res.reason
