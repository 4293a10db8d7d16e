"""``test_grade`` version 1, a plugin verifier for the rescore tests (:func:`tests.helpers.graded_rules.v1`).

Version 2 (:mod:`tests.helpers.graded_verifiers_v2`) registers the same name: a process loads one of the two."""

from rlpipe.rewards.base import VerifyResult, register_verifier
from tests.helpers.graded_rules import v1


@register_verifier("test_grade", version="1")
def grade(response: str, ground_truth: str | None) -> VerifyResult:
    status, reward = v1(response)
    return VerifyResult(reward, status)
