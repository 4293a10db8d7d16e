"""Rewards from a reward model: mixing with verifiers, normalisation, the hacking alert, and the verdict
rule when the reward model is down or fails (skipped / error, never 0)."""

import math

import pytest

from rlpipe.algorithms.preference import RunningNorm
from rlpipe.rewards.base import VerifyResult
from rlpipe.rewards.model import (
    LocalRewardModel, RMItem, RemoteRewardModel, mix_rewards, normalise_results, reward_hacking,
)
from tests.helpers.s3server import free_port

ok = lambda x: VerifyResult(x, "ok")  # noqa: E731


def test_mix_is_the_weighted_sum_when_every_source_judged():
    rm = [ok(2.0), ok(-1.0), VerifyResult(None, "skipped", "service down")]
    fmt = [ok(1.0), ok(0.0), ok(1.0)]
    out = mix_rewards({"model": rm, "format": fmt}, {"model": 1.0, "format": 0.5})
    assert [r.reward for r in out[:2]] == [2.5, -1.0] and all(r.status == "ok" for r in out[:2])
    assert out[0].reason == "model 1×2.0000 + format 0.5×1.0000"
    assert out[2].status == "skipped" and out[2].reward is None and out[2].reason == "model: service down"


def test_a_failing_verifier_in_the_mix_keeps_its_status_and_isolation():
    out = mix_rewards({"model": [ok(1.0)], "code": [VerifyResult(None, "timeout", "slow", "full")]}, {"model": 1.0, "code": 1.0})
    assert (out[0].status, out[0].reason, out[0].isolation) == ("timeout", "code: slow", "full")


def test_normalise_touches_only_scored_samples():
    norm = RunningNorm.seeded(1.0, 2.0, 10)
    out = normalise_results([ok(5.0), VerifyResult(None, "error", "x"), ok(-100.0)], norm, clip=3.0)
    assert out[0].reward == pytest.approx(2.0) and "reward model 5.0000" in out[0].reason
    assert out[1] == VerifyResult(None, "error", "x")
    assert out[2].reward == -3.0
    assert norm.count == 12


@pytest.mark.parametrize("rm,true,window,fires", [
    ([0.1, 0.5, 0.9], [0.8, 0.7, 0.6], 3, True),     # RM up, true down: hacking
    ([0.1, 0.5, 0.9], [0.5, 0.6, 0.7], 3, False),    # both up: learning
    ([0.9, 0.5, 0.1], [0.8, 0.7, 0.6], 3, False),    # both down
    ([0.1, 0.5], [0.8, 0.7], 3, False),              # not enough evaluations yet
    ([5, 0.1, 0.5, 0.9], [0, 0.8, 0.7, 0.6], 3, True),  # only the last window counts
])
def test_reward_hacking_alert(rm, true, window, fires):
    alert = reward_hacking(rm, true, window)
    assert (alert is not None) == fires
    if fires:
        assert "rose" in alert and "fell" in alert


class _Broken:
    version, stats = "rm/v1@abc", {}

    def score_texts(self, items):
        raise RuntimeError("CUDA out of memory")


def test_a_local_reward_model_that_fails_gives_error_never_zero():
    out = LocalRewardModel(_Broken()).score([RMItem("1+1=", "2")] * 3)
    assert all(r.status == "error" and r.reward is None for r in out)
    assert "rm/v1@abc failed: RuntimeError: CUDA out of memory" in out[0].reason


def test_a_reward_model_service_that_is_down_gives_skipped():
    rm = RemoteRewardModel(f"http://127.0.0.1:{free_port()}", timeout_s=2, retries=1)
    assert not rm.healthy()
    out = rm.score([RMItem("1+1=", "2"), RMItem("1+1=", "3")])
    assert [r.status for r in out] == ["skipped", "skipped"] and all(r.reward is None for r in out)
    assert "unreachable" in out[0].reason and rm.last_problem


def test_running_norm_std_of_constant_scores_is_guarded():
    norm = RunningNorm.seeded(1.0, 0.0, 5)
    assert all(math.isfinite(x) for x in norm.normalise([1.0, 2.0], clip=None))


def test_an_ok_answer_without_a_score_is_skipped_not_trusted():
    rm = RemoteRewardModel.__new__(RemoteRewardModel)
    rm.url, rm.version, rm.last_problem = "http://rm", "v", None
    out = rm._results({"results": [{"score": None, "status": "ok"}, {"score": 0.5, "status": "ok", "rm_version": "v2"},
                                   {"score": None, "status": "timeout", "reason": "slow"}]}, 3)
    assert [(r.status, r.reward) for r in out] == [("skipped", None), ("ok", 0.5), ("timeout", None)]
    assert "without a finite score" in out[0].reason
