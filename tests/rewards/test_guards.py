import pytest

from rlpipe.rewards.guards import (
    RewardCircuitOpen, SandboxFloorError, check_circuit, check_rows_isolation, check_sandbox_floor, describe_invalid,
    invalid_share, sandboxed_verifiers,
)

FULL = ("bwrap", "seccomp", "uid", "rlimits", "cgroup")


def rows(statuses, verifier="math", reason="bad reference"):
    return [{"reward_status": s, "verifier": verifier, "reward_reason": None if s == "ok" else f"{reason} {i}"}
            for i, s in enumerate(statuses)]


@pytest.mark.parametrize("previous,share,trips", [
    ([], 0.9, False),               # one bad iteration is not a streak
    ([0.9, 0.6], 0.51, True),       # third in a row above 0.5
    ([0.9, 0.2], 0.9, False),       # a good iteration in between resets the streak
    ([0.9, 0.9], 0.5, False),       # exactly at the limit is not above it
    ([0.5, 0.9], 0.9, False),
    ([1.0, 1.0, 1.0], 0.0, False),  # recovered
])
def test_circuit_trips_only_after_max_iterations_in_a_row(previous, share, trips):
    r = rows(["error"] * 9 + ["ok"])
    if trips:
        with pytest.raises(RewardCircuitOpen) as e:
            check_circuit(previous, share, r, max_share=0.5, max_iterations=3, iteration=7)
        msg = str(e.value)
        assert "iteration 7" in msg and "3 iterations in a row" in msg and "verifier 'math'" in msg
        assert "bad reference 8" in msg and "--run-id" in msg
    else:
        check_circuit(previous, share, r, max_share=0.5, max_iterations=3, iteration=7)


def test_describe_invalid_names_each_verifier_its_statuses_and_last_reasons():
    r = rows(["ok", "error", "timeout"], "code", "sandbox lost") + rows(["skipped"], "math", "service down")
    text = describe_invalid(r)
    assert text.startswith("verifier 'code': 2 not ok (error 1, timeout 1)")
    assert "sandbox lost 2 | sandbox lost 1" in text and "verifier 'math': 1 not ok (skipped 1)" in text
    assert invalid_share(r) == 0.75 and describe_invalid(rows(["ok"])) == "all samples ok"


def test_sandbox_floor_names_what_is_missing_and_how_to_lower_it():
    check_sandbox_floor("bwrap+seccomp+uid+rlimits+cgroup", FULL, "here")
    with pytest.raises(SandboxFloorError) as e:
        check_sandbox_floor("seccomp+rlimits", FULL, "verifier(s) code on this machine")
    msg = str(e.value)
    assert "lacks bwrap+uid+cgroup" in msg and "reward.sandbox_min_level=seccomp+rlimits" in msg
    check_sandbox_floor("seccomp+rlimits", ("seccomp", "rlimits"), "lowered explicitly")
    with pytest.raises(SandboxFloorError):
        check_sandbox_floor("none", ("rlimits",), "no sandbox")
    with pytest.raises(SandboxFloorError):
        check_sandbox_floor(None, ("rlimits",), "no sandbox")


def test_row_isolation_is_checked_and_counted():
    r = [{"isolation": "seccomp+rlimits"}, {"isolation": "seccomp+rlimits"}, {"isolation": None}, {"isolation": None}]
    assert check_rows_isolation(r, ("rlimits",)) == {"sandbox/level/seccomp-rlimits": 0.5}
    with pytest.raises(SandboxFloorError, match="2 verdict"):
        check_rows_isolation(r, FULL)
    assert check_rows_isolation([{"isolation": None}], FULL) == {}


def test_only_code_running_verifiers_need_the_sandbox():
    assert sandboxed_verifiers(["math", "code", "python_expr", "format", "unknown"]) == ["code", "python_expr"]
