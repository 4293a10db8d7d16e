"""The sync proof (rlpipe.rollout.probe) on stand-in engines: what it measures, when it refuses."""

from types import SimpleNamespace

import pytest

from rlpipe.rollout.base import WeightSyncError
from rlpipe.rollout.probe import ProbeBatch, SyncProof, load_policy, max_gap

PROBE = ProbeBatch(prompts=[[1, 2], [3]], continuations=[[4, 5], [6]])


class Scorer:
    def __init__(self, name, lps):
        self.name, self.lps = name, lps

    def sequence_logprobs(self, prompts, continuations):
        assert prompts == PROBE.prompts and continuations == PROBE.continuations
        return self.lps


def test_the_proof_measures_the_worst_token_and_the_policys_move():
    trainer = Scorer("trainer", [[-1.0, -2.0], [-0.5]])
    proof = SyncProof(PROBE, tolerance=1e-3)
    out = proof.prove(Scorer("e", [[-1.0, -2.0004], [-0.5]]), trainer, "at start")
    assert out == pytest.approx({"probe_max_abs_diff": 4e-4, "probe_policy_change": 0.0, "probe_tokens": 3.0})
    trainer.lps = [[-1.5, -2.0], [-0.5]]  # an update moved the policy; the engine follows
    out = proof.prove(Scorer("e", [[-1.5, -2.0], [-0.5]]), trainer, "iteration 0")
    assert out["probe_max_abs_diff"] == 0.0 and out["probe_policy_change"] == pytest.approx(0.5)


def test_a_stale_engine_or_one_bad_replica_is_refused_by_name():
    trainer = Scorer("trainer", [[-1.0, -2.0], [-0.5]])
    with pytest.raises(WeightSyncError, match=r"iteration 3: engine e .* max \|Δ log-prob\| 0.1 > tolerance 0.001"):
        SyncProof(PROBE, 1e-3).prove(Scorer("e", [[-1.1, -2.0], [-0.5]]), trainer, "iteration 3")
    replicas = SimpleNamespace(name="replicas", probe_each=lambda p, c: {"r0": trainer.lps, "r1": [[-1.0, -2.0], [-0.9]]})
    with pytest.raises(WeightSyncError, match="engine r1 and trainer disagree"):
        SyncProof(PROBE, 1e-3).prove(replicas, trainer, "iteration 3")
    assert max_gap([[0.0]], [[0.0, 1.0]]) == float("inf")  # a shape mismatch is never a pass


def test_load_policy_checks_the_hash_the_engine_reports(tmp_path):
    engine = SimpleNamespace(name="e", load_weights=lambda d: "aa" * 32)
    assert load_policy(engine, tmp_path, "aa" * 32, 1) == "aa" * 32
    with pytest.raises(WeightSyncError, match="iteration 1: engine e holds bbbbbbbbbbbb after reload, trainer exported aaaa"):
        load_policy(SimpleNamespace(name="e", load_weights=lambda d: "bb" * 32), tmp_path, "aa" * 32, 1)
    lora = SimpleNamespace(name="e", load_adapter=lambda d, w: "cc" * 32, weights_sha256=lambda: "aa" * 32)
    with pytest.raises(WeightSyncError, match="read adapter cccccccccccc, the trainer saved dddddddddddd"):
        load_policy(lora, tmp_path, "aa" * 32, 1, adapter_sha256="dd" * 32)
    assert load_policy(lora, tmp_path, "aa" * 32, 1, adapter_sha256="cc" * 32) == "aa" * 32
