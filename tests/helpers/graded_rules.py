"""The rules of the two ``test_grade`` versions (:mod:`tests.helpers.graded_verifiers`, ``…_v2``), importable
without registering either: the rescore tests check stored verdicts against them."""


def v1(response: str) -> tuple[str, float | None]:
    """1 for a response of even length."""
    return "ok", float(len(response) % 2 == 0)


def v2(response: str) -> tuple[str, float | None]:
    """As v1, except that a length that is a multiple of 3 is an error and one that is a multiple of 5 (and not
    of 3) has its reward flipped."""
    n = len(response)
    if n % 3 == 0:
        return "error", None
    _, even = v1(response)
    return "ok", 1.0 - even if n % 5 == 0 else even
