"""Verifiers that misbehave on purpose, loaded into pool workers as a plugin by the tests."""

import os
import sys
import time

from rlpipe.rewards.base import VerifyResult, register_verifier


@register_verifier("test_sleepy", version="1", budget_s=0.5)
def sleepy(response: str, ground_truth: str | None) -> VerifyResult:
    if response.startswith("sleep"):
        time.sleep(float(response.split()[1]))
    return VerifyResult(1.0, "ok")


@register_verifier("test_crashy", version="1")
def crashy(response: str, ground_truth: str | None) -> VerifyResult:
    if response == "die":
        os._exit(3)
    if response == "raise":
        raise RuntimeError("verifier bug")
    return VerifyResult(0.0, "ok")


@register_verifier("test_even", version="1")
def even_length(response: str, ground_truth: str | None) -> VerifyResult:
    """A reward any policy can earn: 1 when the response has an even number of characters."""
    return VerifyResult(float(len(response) % 2 == 0), "ok")


def broken_flag() -> str:
    """While this file exists, ``test_flaky`` fails as a broken verifier would (a cause a person fixes)."""
    return os.path.join(os.environ.get("RLPIPE_HOME", "/tmp"), "test-verifier-broken")


@register_verifier("test_flaky", version="1")
def flaky(response: str, ground_truth: str | None) -> VerifyResult:
    if os.path.exists(broken_flag()):
        return VerifyResult(None, "error", "reference store unreachable (test flag set)")
    return VerifyResult(float(len(response) % 2 == 0), "ok")


@register_verifier("test_zero", version="1")
def zero(response: str, ground_truth: str | None) -> VerifyResult:
    """A reward no policy can earn: every batch is flat at 0 (the reward_flat alert's deliberate trigger)."""
    return VerifyResult(0.0, "ok")


@register_verifier("test_warm", version="1")
def warm(response: str, ground_truth: str | None) -> VerifyResult:
    """1 when the worker gives its verdict with math-verify and sympy already imported, 0 when cold."""
    return VerifyResult(float(all(m in sys.modules for m in ("math_verify", "sympy", "latex2sympy2_extended"))), "ok")


@register_verifier("test_leaky", version="1")
def leaky(response: str, ground_truth: str | None) -> VerifyResult:
    """A verdict whose reason carries personal data (a verifier quoting whom to ask): data.redact's case."""
    return VerifyResult(float(len(response) % 2 == 0), "ok", "graded; questions to ops.grader@example-lab.org")
