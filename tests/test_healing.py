"""Healing decisions as plain functions: what a failed flow run's final state says, and what is done about it.
The messages are the ones Prefect 3 writes (a process worker's Crashed state; the engine's Failed state)."""

import pytest

from rlpipe.healing import Decision, Failure, HealPolicy, backoff_s, classify, decide

SIGKILL = ("Flow run infrastructure exited with non-zero status code -9. Process exited due to a SIGKILL signal. "
           "Typically caused by the operating system terminating the process for exceeding memory limits, or by "
           "manual cancellation.")
OOM_137 = ("Flow run infrastructure exited with non-zero status code 137. Process was killed, likely due to an "
           "out-of-memory (OOM) condition.")


@pytest.mark.parametrize("state, message, kind, resumable", [
    ("CRASHED", SIGKILL, "killed", True),
    ("CRASHED", "Flow run process exited with non-zero status code -9.", "killed", True),  # a runner's words
    ("CRASHED", OOM_137, "oom", True),
    ("CRASHED", "Flow run infrastructure exited with non-zero status code 247. Process was terminated due to high "
                "memory usage.", "oom", True),
    ("CRASHED", "Flow run infrastructure exited with non-zero status code -15. Process exited due to a SIGTERM "
                "signal.", "terminated", True),
    ("CRASHED", "Flow run infrastructure exited with non-zero status code 143. Process received SIGTERM", "terminated",
     True),
    ("CRASHED", "Flow run infrastructure exited with non-zero status code 1. Process exited with a general error.",
     "exit:1", True),
    ("CRASHED", "Execution was aborted by an interrupt signal.", "crashed", True),
    ("crashed", None, "crashed", True),
    ("CRASHED", "Flow run process ran out of memory", "oom", True),
    ("FAILED", "Flow run encountered an exception: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
     "oom", True),
    ("FAILED", "Flow run encountered an exception: torch.OutOfMemoryError: CUDA error", "oom", True),
    ("FAILED", "Flow run encountered an exception: MemoryError: ", "oom", True),
    ("FAILED", "Flow run encountered an exception: RuntimeError: DefaultCPUAllocator: not enough memory: you tried "
               "to allocate 1024 bytes. Out of memory", "oom", True),
    ("FAILED", "Flow run encountered an exception: TrainerDown: trainer at http://127.0.0.1:1 did not answer",
     "error:TrainerDown", True),
    ("FAILED", "Flow run encountered an exception: KeyError: 'x'", "error:KeyError", True),
    ("FAILED", "Flow run encountered an exception: StageTimeout: verify took more than 60 s", "error:StageTimeout", True),
    ("FAILED", "something went wrong", "error", True),
    ("FAILED", None, "error", True),
    # A restart can only repeat these: a person changes something first.
    ("FAILED", "Flow run encountered an exception: ResumeRefused: run rl-x changed: train.lr: 0.1 → 0.2",
     "error:ResumeRefused", False),
    ("FAILED", "Flow run encountered an exception: rlpipe.yamlio.ConfigError: train.lrr: unknown key",
     "error:ConfigError", False),
    ("FAILED", "Flow run encountered an exception: ValidationError: 1 validation error for RunConfig", "error:ValidationError",
     False),
    ("FAILED", "Flow run encountered an exception: ParameterTypeError: Flow run received invalid parameters",
     "error:ParameterTypeError", False),
    ("FAILED", "Flow run encountered an exception: DatasetInvalid: row 3: no prompt", "error:DatasetInvalid", False),
    ("FAILED", "Flow run encountered an exception: NonFiniteUpdate: iteration 4: 3/9 optimizer steps",
     "error:NonFiniteUpdate", False),
    ("FAILED", "Flow run encountered an exception: RewardCircuitOpen: 3 iterations", "error:RewardCircuitOpen", False),
])
def test_a_final_state_is_classified_by_kind_and_resumability(state, message, kind, resumable):
    got = classify(state, message)
    assert (got.kind, got.resumable) == (kind, resumable), got
    assert got.reason


@pytest.mark.parametrize("state", ["COMPLETED", "CANCELLED", "RUNNING", "SCHEDULED"])
def test_only_a_crash_or_a_failure_is_classified(state):
    with pytest.raises(ValueError, match=f"state '{state}' is not a failure"):
        classify(state, "")


def test_backoff_doubles_from_its_base_up_to_its_cap():
    p = HealPolicy(backoff_s=30, backoff_max_s=100)
    assert [backoff_s(k, p) for k in (1, 2, 3, 4)] == [30, 60, 100, 100]
    assert backoff_s(1, HealPolicy(backoff_s=0)) == 0


OOM, KILLED, KEY = Failure("oom", True, "oom"), Failure("killed", True, "k"), Failure("error:KeyError", True, "key")
REFUSED = Failure("error:ResumeRefused", False, "the resume was refused")
P = HealPolicy(max_attempts=3, backoff_s=10, backoff_max_s=1000, pause_after=3)


@pytest.mark.parametrize("chain, policy, action, attempt, delay", [
    ([KILLED], P, "relaunch", 1, 10),
    ([KILLED, OOM], P, "relaunch", 2, 20),
    ([KILLED, OOM, KEY], P, "relaunch", 3, 40),
    ([OOM, KILLED, KEY, KILLED], P, "give_up", 0, 0),  # three relaunches made: the bound
    ([OOM, OOM], P, "relaunch", 2, 20),
    ([OOM, OOM, OOM], P, "pause", 0, 0),  # the third of one kind pauses instead of a third relaunch
    ([OOM, KILLED, OOM, OOM], P, "pause", 0, 0),  # not in a row: of the same kind in the chain
    ([OOM, OOM, OOM, KILLED], P, "give_up", 0, 0),
    ([OOM, OOM], P.model_copy(update={"pause_after": 2}), "pause", 0, 0),
    ([OOM], P.model_copy(update={"pause_after": 1}), "pause", 0, 0),
    ([OOM] * 5, P.model_copy(update={"pause_after": None, "max_attempts": 5}), "relaunch", 5, 160),
    ([OOM] * 6, P.model_copy(update={"pause_after": None, "max_attempts": 5}), "give_up", 0, 0),
    ([KILLED], P.model_copy(update={"max_attempts": 0}), "give_up", 0, 0),
    ([REFUSED], P, "skip", 0, 0),  # never relaunched, whatever the counts
    ([OOM, OOM, REFUSED], P.model_copy(update={"pause_after": 1}), "skip", 0, 0),
])
def test_decide_relaunches_with_backoff_pauses_on_one_kind_and_gives_up_at_the_bound(chain, policy, action, attempt,
                                                                                      delay):
    got = decide(chain, policy)
    assert (got.action, got.attempt, got.delay_s) == (action, attempt, delay), got
    assert chain[-1].reason in got.reason


def test_the_reasons_name_the_rule_that_decided():
    assert "3 of the run's 3 failures in a row were oom (pause_after=3)" in decide([OOM] * 3, P).reason
    assert "3 relaunch(es) made, max_attempts=3" in decide([OOM, KILLED, KEY, KILLED], P).reason
    assert decide([REFUSED], P).reason.startswith("not resumable: the resume was refused")
    assert decide([KILLED], P) == Decision("relaunch", "killed: k", 1, 10.0)


def test_an_empty_chain_and_a_bad_policy_are_errors():
    with pytest.raises(ValueError, match="the chain is empty"):
        decide([], P)
    with pytest.raises(ValueError, match="max_attempts"):
        HealPolicy(max_attempts=-1)
    with pytest.raises(ValueError, match="pause_afterr"):
        HealPolicy.model_validate({"pause_afterr": 2})  # a typo is an error, not a default
