"""Reward mixing (rlpipe.rewards.mix) with stand-in sources: hand-computed rewards, statuses, normalisation."""

import pytest

from rlpipe.algorithms.preference import RunningNorm
from rlpipe.rewards.base import VerifyResult
from rlpipe.rewards.mix import mix_sources, seed_norm


class Pool:
    """A verifier pool scoring by a table: (verifier name, response) → VerifyResult."""

    def __init__(self, table):
        self.table, self.calls = table, []

    def score(self, items):
        self.calls.append([i.verifier for i in items])
        return [self.table[(i.verifier, i.response)] for i in items]


class RM:
    version, stats = "rm/3", {"mean": 0.5, "std": 2.0, "count": 1000.0}

    def __init__(self, scores):
        self.scores = scores

    def score(self, items):
        return [VerifyResult(self.scores[i.response], "ok") for i in items]


ROWS = [{"prompt_id": "p", "verifier": "math", "response_text": t} for t in ("a", "b", "c")]
PROMPTS = {"p": {"prompt": "1+1?", "chat": False}}
OK, WRONG = VerifyResult(1.0, "ok"), VerifyResult(0.0, "ok")


def test_the_reward_model_and_a_verifier_mixed_by_weight():
    pool = Pool({("math", "a"): OK, ("math", "b"): WRONG, ("math", "c"): VerifyResult(None, "error", "timeout"),
                 ("format", "a"): OK, ("format", "b"): OK, ("format", "c"): OK})
    mixed = mix_sources(ROWS, {"model": 0.5, "format": 2.0}, pool, {"p": "2"}, reward_model=RM({"a": 1.0, "b": -1.0, "c": 3.0}),
                        prompts=PROMPTS)
    assert [v.reward for v in mixed.verdicts] == [0.5 * 1.0 + 2.0, 0.5 * -1.0 + 2.0, 0.5 * 3.0 + 2.0]
    assert mixed.label == "rm+format" and mixed.version == "rm/3"
    # The hidden true score is each row's own verifier: 1 of 2 scored ok rows right; the error counts as wrong.
    assert mixed.stats["true_reward_mean"] == 0.5 and mixed.stats["true_accuracy"] == pytest.approx(1 / 3)
    assert mixed.stats["rm_score_mean"] == pytest.approx(1.0)
    assert pool.calls == [["math"] * 3, ["format"] * 3]


def test_a_source_that_cannot_judge_makes_the_sample_not_ok_never_a_zero():
    pool = Pool({("math", "a"): OK, ("math", "b"): VerifyResult(None, "error", "sandbox died"), ("math", "c"): WRONG})
    mixed = mix_sources(ROWS, {"": 1.0, "model": 1.0}, pool, {}, reward_model=RM({"a": 0.0, "b": 0.0, "c": 0.0}),
                        prompts=PROMPTS)
    assert [(v.status, v.reward) for v in mixed.verdicts] == [("ok", 1.0), ("error", None), ("ok", 0.0)]
    assert mixed.verdicts[1].reason == "verifier: sandbox died" and mixed.label == "verifier+rm"


def test_normalised_scores_use_the_statistics_from_before_the_batch():
    pool = Pool({("math", t): OK for t in "abc"})
    norm = seed_norm(RM.stats, batch=64)  # the registered statistics, weighted as one batch at most
    assert (norm.count, norm.mean, norm.std) == (64.0, 0.5, pytest.approx(2.0))
    mixed = mix_sources(ROWS, {"model": 1.0}, pool, {}, reward_model=RM({"a": 2.5, "b": 0.5, "c": -1.5}), prompts=PROMPTS,
                        norm=norm, clip=0.75)
    assert [v.reward for v in mixed.verdicts] == [0.75, 0.0, -0.75]  # (x - 0.5) / 2, clipped
    assert mixed.stats["reward_norm"]["count"] == 67.0  # the batch folded in after it was scaled
    assert seed_norm(None, 64) == RunningNorm()
