"""The hidden true quality of the synthetic preference task: verdicts on tricky answers."""

import math

import pytest

from rlpipe.rewards import get_verifier

CASES = [  # response, reference, reward (None: not ok), status
    ("46", "46", 1.0, "ok"),
    (" 46\n", "46", 1.0, "ok"),
    ("47", "46", math.exp(-1 / 5), "ok"),
    ("36", "46", math.exp(-2), "ok"),
    ("-4", "6", math.exp(-2), "ok"),
    ("460", "46", math.exp(-414 / 5), "ok"),
    ("", "46", 0.0, "ok"),  # an empty answer is the model's failure, never excluded
    ("4 6", "46", 0.0, "ok"),
    ("46.0", "46", 0.0, "ok"),
    ("forty-six", "46", 0.0, "ok"),
    ("46", "4a", None, "error"),  # the reference's fault
    ("46", None, None, "error"),
]


@pytest.mark.parametrize("response,reference,reward,status", CASES)
def test_closeness_verdicts(response, reference, reward, status):
    v = get_verifier("closeness")(response, reference)
    assert v.status == status
    assert v.reward == (pytest.approx(reward) if reward is not None else None)
    if status == "error":
        assert "not an integer" in v.reason


def test_reference_check_names_the_fix():
    assert get_verifier("closeness").check_reference("12") is None
    assert "e.g." in get_verifier("closeness").check_reference("1/2")
