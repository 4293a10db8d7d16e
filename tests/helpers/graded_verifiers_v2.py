"""``test_grade`` version 2, the same name as :mod:`tests.helpers.graded_verifiers` (version 1) with another
rule (:func:`tests.helpers.graded_rules.v2`): what ``rlpipe rescore`` re-scores a version-1 run with."""

from rlpipe.rewards.base import VerifyResult, register_verifier
from tests.helpers.graded_rules import v2


@register_verifier("test_grade", version="2")
def grade(response: str, ground_truth: str | None) -> VerifyResult:
    status, reward = v2(response)
    return VerifyResult(reward, status, "v2: length a multiple of 3" if status == "error" else "")
