import time

import pytest

from rlpipe.rewards.pool import VerifierPool, VerifyItem

PLUGIN = ("tests.helpers.slow_verifiers",)


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(workers=2, grace_s=0.5, plugins=PLUGIN) as p:
        yield p


def test_math_statuses_through_the_pool(pool):
    items = [
        VerifyItem("math", "46", "46"),
        VerifyItem("math", "45", "46"),
        VerifyItem("math", "the answer is \\boxed{\\frac{1}{2}}", "0.5"),
        VerifyItem("math", "", "46"),
        VerifyItem("math", "46", None),
        VerifyItem("exact", " 46 ", "46"),
    ]
    got = [(r.status, r.reward) for r in pool.score(items)]
    assert got == [("ok", 1.0), ("ok", 0.0), ("ok", 1.0), ("ok", 0.0), ("error", None), ("ok", 1.0)]


def test_workers_and_their_replacements_start_with_math_verify_imported():
    """The fork server imports math-verify (and sympy) once: no worker spends ~0.4 s of an iteration on it."""
    with VerifierPool(workers=2, grace_s=0.5, plugins=PLUGIN) as fresh:
        assert [r.reward for r in fresh.score([VerifyItem("test_warm", "", None)] * 2)] == [1.0, 1.0]
        assert fresh.score([VerifyItem("test_sleepy", "sleep 30", None)])[0].status == "timeout"
        assert fresh.restarts == 1
        assert [r.reward for r in fresh.score([VerifyItem("test_warm", "", None)] * 4)] == [1.0] * 4


def test_hung_worker_is_killed_replaced_and_sample_times_out(pool):
    before = pool.restarts
    start = time.monotonic()
    res = pool.score([VerifyItem("test_sleepy", "sleep 30", None), VerifyItem("test_sleepy", "fine", None),
                      VerifyItem("test_sleepy", "fine", None)])
    assert time.monotonic() - start < 5
    assert [r.status for r in res] == ["timeout", "ok", "ok"] and res[0].reward is None
    assert "killed" in res[0].reason and pool.restarts == before + 1 and pool.healthy()
    # The replacement works.
    assert pool.score([VerifyItem("math", "2", "2")])[0].reward == 1.0


def test_crashing_and_raising_verifiers_become_error_statuses(pool):
    res = pool.score([VerifyItem("test_crashy", "die", None), VerifyItem("test_crashy", "raise", None),
                      VerifyItem("test_crashy", "ok", None), VerifyItem("nope", "x", None)])
    assert [r.status for r in res] == ["error", "error", "ok", "error"]
    assert "died" in res[0].reason and "verifier bug" in res[1].reason and "unknown verifier" in res[3].reason
    assert pool.healthy()


def test_many_items_keep_order(pool):
    items = [VerifyItem("exact", str(i), str(i if i % 3 else -1)) for i in range(50)]
    assert [r.reward for r in pool.score(items)] == [0.0 if i % 3 == 0 else 1.0 for i in range(50)]


def test_deadline_is_the_verifiers_budget_plus_grace_so_a_verdict_is_never_preempted(pool):
    # test_sleepy declares a 0.5 s budget; with 0.5 s of grace a 0.8 s verdict still arrives.
    assert pool.deadline_s(VerifyItem("test_sleepy", "x", None)) == 1.0
    res = pool.score([VerifyItem("test_sleepy", "sleep 0.8", None)])
    assert (res[0].status, res[0].reward) == ("ok", 1.0), res[0].reason
    res = pool.score([VerifyItem("test_sleepy", "sleep 3", None)])
    assert res[0].status == "timeout" and "budget + grace (1 s)" in res[0].reason


def test_options_a_verifier_does_not_accept_are_refused_when_the_pool_is_built():
    with pytest.raises(ValueError, match="verifier 'math' has no option"):
        VerifierPool(workers=1, options={"math": {"scoring": "all"}})
    with pytest.raises(KeyError, match="unknown verifier"):
        VerifierPool(workers=1, options={"astrology": {}})
