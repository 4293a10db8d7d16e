"""What the stages of an iteration hand each other (rlpipe.stages), and the iteration's metrics built from them."""

import pytest

from rlpipe.stages import RolloutDone, SyncDone, UpdateDone, VerifyDone, iteration_metrics

META = {"draw": 0, "rows": 8, "policy_version": "p0", "policy_iteration": 2, "staleness": 0, "generate_s": 3.0,
        "generate_tokens_per_s": 40.0, "cursor": {"epoch": 0}, "fingerprint": "f", "rollout/replicas_live": 2.0}
SCORES = {"reward_mean": 0.5, "reward_std": 0.5, "accuracy": 0.5, "response_length_mean": 4.0, "truncated_share": 0.0,
          "status_ok": 0.75, "status_error": 0.25, "reward_by_task/math": 0.5, "groups_with_signal": 2.0,
          "verify_s": 1.0, "verify_per_s": 8.0, "rows": 8, "draw": 0, "alerts": ["flat"], "fingerprint": "f"}


def _draw(generate_s=3.0, reused=False, verify_reused=False):
    r = RolloutDone.from_meta(META | {"generate_s": generate_s}, "rollout", "t0", reused=reused)
    return r, VerifyDone.from_meta(SCORES, "verify", reused=verify_reused)


def test_a_stored_record_reads_back_typed():
    r, v = _draw()
    assert (r.rows, r.policy_iteration, r.generate_s, r.metrics["generate_tokens_per_s"]) == (8, 2, 3.0, 40.0)
    assert "policy_version" not in r.metrics and v.alerts == ["flat"] and v.groups_with_signal == 2.0
    with pytest.raises(KeyError):
        RolloutDone.from_meta({"draw": 0}, "x", "t", reused=False)  # a record without its fields is not a result


def test_iteration_metrics_by_hand():
    u = UpdateDone(metrics={"loss": 0.25, "tokens": 100.0, "dynamic/groups_kept": 4.0, "unlisted": 1.0}, update_s=2.0,
                   save_s=0.5, read_s=0.1, state_dir="s", weights_sha256="w")
    s = SyncDone(sync_s=0.5, policy_version="w", adapter_only=False, readback_tensors=3.0, probe_max_abs_diff=1e-6,
                 probe_policy_change=0.1, probe_tokens=20.0)
    # Two draws: the second was generated before a resume (reused), its scores too: neither is counted again.
    m = iteration_metrics([_draw(), _draw(9.0, reused=True, verify_reused=True)], u, s, None, None, wall=10.0)
    assert m["time/generate_s"] == 3.0 and m["time/verify_s"] == 1.0 and m["time/update_s"] == 2.0
    assert m["time/overhead_s"] == pytest.approx(10.0 - 3.0 - 1.0 - 2.0) and m["time/overhead_share"] == pytest.approx(0.4)
    assert m["throughput/train_tokens_per_s"] == 50.0 and m["loss"] == 0.25 and "unlisted" not in m
    assert m["invalid_share"] == pytest.approx(0.25) and m["alerts"] == 1.0 and m["rollout/replicas_live"] == 2.0
    assert m["reward_by_task/math"] == 0.5 and m["sync/adapter_only"] == 0.0 and "heldout_accuracy" not in m


def test_a_batch_generated_ahead_counts_only_the_wait():
    r, v = _draw()
    ahead = RolloutDone(**{**r.__dict__, "reused": True, "prefetched": True, "prefetch_wait_s": 0.25})
    u = UpdateDone(metrics={}, update_s=1.0, save_s=0.0, read_s=0.0, state_dir="s", weights_sha256="w")
    s = SyncDone(0.1, "w", True, 0.0, 0.0, 0.0, 1.0)
    ev = {"accuracy": 0.4, "eval_s": 1.0, "true_score": 0.4, "rm_score": None}
    val = {"accuracy": None, "eval_s": 0.5}
    m = iteration_metrics([(ahead, v)], u, s, ev, val, wall=5.0, ahead=r, ahead_wait=0.5)
    assert m["time/generate_s"] == 0.75 and m["rollout/prefetch_generate_s"] == 3.0 and m["rollout/ahead_generate_s"] == 3.0
    assert m["time/eval_s"] == 1.5 and m["heldout_accuracy"] == 0.4 and m["heldout_true_score"] == 0.4
    assert "validation_accuracy" not in m and "heldout_rm_score" not in m and m["sync/adapter_only"] == 1.0
