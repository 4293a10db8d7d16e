"""Each alert rule fires on the metrics that should fire it, stays quiet just inside its threshold and is
left out when the run lacks its inputs; the hand-made cases here are also fired on a real Prefect server
(tests/flows/test_alert_automations.py)."""

from __future__ import annotations

import math

import pytest

from rlpipe.alerts import RULES, evaluate, guard_alert
from rlpipe.config import RunConfig

BASE = {"reward_mean": 0.4, "reward_std": 0.3, "status_ok": 1.0}
GPU_PEAK = "resource/gpu_mem_peak_bytes/"


def cfg(**alerts) -> RunConfig:
    return RunConfig.model_validate({"alerts": alerts})


def hist(*rows: dict) -> list[dict]:
    return [{"iteration": k} | BASE | r for k, r in enumerate(rows)]


# rule -> (config overrides, history, metrics that fire it, metrics just inside the threshold)
CASES = {
    "reward_flat": ({"reward_flat": {"for_iterations": 2}}, hist({"reward_mean": 0.0, "reward_std": 0.0}),
                    {"reward_mean": 0.0, "reward_std": 0.0, "status_ok": 1.0},
                    {"reward_mean": 1.0, "reward_std": 0.0, "status_ok": 1.0}),  # all 1 after all 0: not one streak
    "kl_high": ({}, [], {"kl": 0.51}, {"kl": 0.5}),
    "entropy_collapse": ({"entropy_collapse": {"window": 3, "drop": 0.5}},
                         hist({"entropy": 2.0, "reward_mean": 0.2}, {"entropy": 1.5, "reward_mean": 0.3}),
                         {"entropy": 0.99, "reward_mean": 0.5}, {"entropy": 1.0, "reward_mean": 0.5}),
    "nonfinite_loss": ({}, [], {"nonfinite_steps": 1.0, "loss": 0.3}, {"nonfinite_steps": 0.0, "loss": 0.3}),
    "verifier_errors": ({}, [], {"status_ok": 0.85}, {"status_ok": 0.9}),
    "throughput_drop": ({}, hist(*({"throughput/generate_tokens_per_s": x} for x in (100.0, 120.0, 80.0, 30.0, 45.0))),
                        {"throughput/generate_tokens_per_s": 49.0}, {"throughput/generate_tokens_per_s": 50.0}),
    "memory_growth": ({"memory_growth": {"iterations": 2, "mb": 100}},
                      hist({"resource/rss_bytes": 1000 * 2**20}, {"resource/rss_bytes": 1050 * 2**20}),
                      {"resource/rss_bytes": 1101 * 2**20}, {"resource/rss_bytes": 1100 * 2**20}),
    "mismatch": ({}, [], {"mismatch/share_above": 0.11}, {"mismatch/share_above": 0.1}),
    "reward_hacking": ({}, hist({"heldout_rm_score": 0.1, "heldout_true_score": 0.6},
                                {"heldout_rm_score": 0.3, "heldout_true_score": 0.5}),
                       {"heldout_rm_score": 0.5, "heldout_true_score": 0.4},
                       {"heldout_rm_score": 0.5, "heldout_true_score": 0.6}),
    "kl_rise": ({"kl_rise": {"window": 3, "max_rate": 0.0625}}, hist({"kl": 0.0625}, {"kl": 0.125}),
                {"kl": 0.19}, {"kl": 0.1875}),  # slope (0.1875 - 0.0625) / 2 = 0.0625 exactly
    "gpu_memory_growth": ({"gpu_memory_growth": {"iterations": 2, "mb": 100}},
                          hist({GPU_PEAK + "update": 1000 * 2**20, GPU_PEAK + "generate": 400 * 2**20},
                               {GPU_PEAK + "update": 1050 * 2**20}),
                          {GPU_PEAK + "update": 1101 * 2**20}, {GPU_PEAK + "update": 1100 * 2**20}),
    "gpu_util_low": ({"gpu_util_low": {"for_iterations": 2, "min_util": 0.25}},
                     hist({"resource/gpu0_util": 0.1, "resource/gpu1_util": 0.2}),
                     {"resource/gpu0_util": 0.24, "resource/gpu1_util": 0.05},
                     {"resource/gpu0_util": 0.25, "resource/gpu1_util": 0.05}),  # one GPU at the threshold: not idle
    "loss_divergence": ({}, hist(*({"loss": x} for x in (0.125, -0.25, 0.125, 0.25, -0.125, 3.0))),
                        {"loss": -1.26}, {"loss": -1.25}),  # median |loss| 0.125 × factor 10
}


def test_every_rule_has_a_case_and_a_config_section():
    assert set(CASES) == set(RULES)
    assert all(hasattr(RunConfig().alerts, r) for r in RULES)


@pytest.mark.parametrize("rule", sorted(CASES))
def test_rule_fires_and_stays_quiet_inside_its_threshold(rule):
    overrides, history, firing, quiet = CASES[rule]
    config = cfg(**overrides)
    fired, flags = evaluate(config, BASE | firing, history)
    mine = [a for a in fired if a.rule == rule]
    assert len(mine) == 1 and flags[f"alerts/{rule}"] == 1.0, (fired, flags)
    assert mine[0].severity == getattr(config.alerts, rule).severity and mine[0].message
    fired, flags = evaluate(config, BASE | quiet, history)
    assert rule not in {a.rule for a in fired} and flags[f"alerts/{rule}"] == 0.0


def test_hand_computed_values_and_messages():
    fired, _ = evaluate(cfg(), BASE | {"throughput/generate_tokens_per_s": 40.0},
                        hist(*({"throughput/generate_tokens_per_s": x} for x in (100.0, 120.0, 80.0, 30.0, 45.0))))
    (a,) = fired
    assert a.value == pytest.approx(0.45) and "median 100" in a.message  # the window's best, 45, of median(80, 100, 120)
    # A one-iteration dip is not a drop: the two before it were at the median.
    dip = hist(*({"throughput/generate_tokens_per_s": x} for x in (100.0, 120.0, 80.0, 100.0, 100.0)))
    assert evaluate(cfg(), BASE | {"throughput/generate_tokens_per_s": 10.0}, dip)[0] == []
    fired, _ = evaluate(cfg(entropy_collapse={"window": 3}), BASE | {"entropy": 0.5, "reward_mean": 0.5},
                        hist({"entropy": 2.0, "reward_mean": 0.2}, {"entropy": 1.5, "reward_mean": 0.3}))
    assert fired[0].value == pytest.approx(0.75) and "2.000 → 0.500" in fired[0].message
    # KL against an adaptive target: kl_target × factor, not max_kl.
    c = RunConfig.model_validate({"train": {"kl_coef": 0.01, "kl_target": 0.02}, "alerts": {"kl_high": {"factor": 2}}})
    assert [a.rule for a in evaluate(c, BASE | {"kl": 0.041}, [])[0]] == ["kl_high"]
    assert evaluate(c, BASE | {"kl": 0.04}, [])[0] == []
    fired, _ = evaluate(cfg(), BASE | {"nonfinite_steps": 0.0, "loss": math.nan}, [])
    assert [a.rule for a in fired] == ["nonfinite_loss"] and fired[0].severity == "critical"
    # A service's own error rate counts too, and the message names the service.
    fired, _ = evaluate(cfg(), BASE | {"service/verifier/error_rate": 0.5}, [])
    assert fired[0].rule == "verifier_errors" and "service verifier" in fired[0].message


def test_kl_rise_is_the_slope_over_its_window():
    c = cfg(kl_rise={"window": 4, "max_rate": 0.01})
    rising = hist(*({"kl": x} for x in (0.01, 0.02, 0.05)))
    (a,) = [a for a in evaluate(c, BASE | {"kl": 0.06}, rising)[0] if a.rule == "kl_rise"]
    assert a.value == pytest.approx(0.018) and "0.01 → 0.06" in a.message  # least squares over 0.01 0.02 0.05 0.06
    # Noisy but level, with one high point: a jump is kl_high's, not a rise; too short a history: quiet.
    noisy = hist(*({"kl": x} for x in (0.05, 0.02, 0.06)))
    assert evaluate(c, BASE | {"kl": 0.03}, noisy)[1]["alerts/kl_rise"] == 0.0
    assert evaluate(c, BASE | {"kl": 0.5}, rising[-2:])[1]["alerts/kl_rise"] == 0.0


def test_loss_divergence_needs_a_streak_and_reads_the_gradient_norm_too():
    steady = hist(*({"loss": x, "grad_norm": 1.0} for x in (0.1, -0.2, 0.1, 0.2, -0.1, 0.1)))
    # One spike is not a divergence (for_iterations 2): the iteration before was at the median.
    assert evaluate(cfg(), BASE | {"loss": 5.0, "grad_norm": 1.0}, steady)[1]["alerts/loss_divergence"] == 0.0
    spiking = steady + hist({"loss": 0.1, "grad_norm": 40.0})
    (a,) = evaluate(cfg(), BASE | {"loss": 0.1, "grad_norm": 30.0}, spiking)[0]
    assert a.rule == "loss_divergence" and a.value == pytest.approx(30.0) and "|grad_norm|" in a.message
    # A non-finite loss is nonfinite_loss's alert; too little history: not evaluated.
    fired, flags = evaluate(cfg(), BASE | {"loss": math.nan, "nonfinite_steps": 1.0}, steady)
    assert [a.rule for a in fired] == ["nonfinite_loss"] and "alerts/loss_divergence" not in flags
    assert "alerts/loss_divergence" not in evaluate(cfg(), BASE | {"loss": 9.0}, steady[:3])[1]


def test_gpu_rules_need_a_streak_or_a_steady_rise():
    c = cfg(gpu_util_low={"for_iterations": 3})
    idle = {"resource/gpu0_util": 0.1}
    assert evaluate(c, BASE | idle, hist(idle, idle))[0][0].rule == "gpu_util_low"
    assert evaluate(c, BASE | idle, hist(idle, {"resource/gpu0_util": 0.9}))[1]["alerts/gpu_util_low"] == 0.0
    assert cfg().alerts.gpu_util_low.severity == "info"  # slow, not broken
    # A plateau after warm-up is not a leak: the peak must rise at each iteration.
    plateau = hist(*({GPU_PEAK + "update": x * 2**30} for x in (10, 20, 20, 20, 20)))
    assert evaluate(cfg(), BASE | {GPU_PEAK + "update": 30 * 2**30}, plateau)[1]["alerts/gpu_memory_growth"] == 0.0
    leak = hist(*({GPU_PEAK + "update": x * 2**30} for x in (10, 11, 12, 13, 14)))
    (a,) = evaluate(cfg(), BASE | {GPU_PEAK + "update": 15 * 2**30}, leak)[0]
    assert "peak allocated GPU memory grew" in a.message and a.value == 15 * 2**30


def test_gpu_rules_say_when_this_machine_cannot_feed_them():
    """On a machine without CUDA the GPU rules are not evaluated: the doctor's (and each run's preflight)
    alert-inputs line names them, instead of their passing as quiet."""
    import torch

    from rlpipe.config import settings
    from rlpipe.doctor import run_checks

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the GPU rules get their inputs")
    (check,) = [c for c in run_checks(cfg(), settings(), engine=False, timeout_s=30) if c.component == "alert-inputs"]
    assert check.status == "skip" and "alerts.gpu_memory_growth (no CUDA GPU" in check.detail
    assert "alerts.gpu_util_low (no CUDA GPU: no resource/gpu<i>_util metrics)" in check.detail
    off = cfg(gpu_memory_growth={"enabled": False}, gpu_util_low={"enabled": False})
    (check,) = [c for c in run_checks(off, settings(), engine=False, timeout_s=30) if c.component == "alert-inputs"]
    assert check.detail == "no GPU alert rule enabled"


def test_flat_rewards_need_a_streak_of_the_same_value():
    c = cfg(reward_flat={"for_iterations": 3})
    flat0 = {"reward_mean": 0.0, "reward_std": 0.0}
    assert evaluate(c, BASE | flat0, hist(flat0, flat0))[0][0].value == 3.0
    assert evaluate(c, BASE | flat0, hist(flat0, {}))[1]["alerts/reward_flat"] == 0.0  # streak broken
    # An all-equal batch of 0.5s is not "all 0 or all 1"; a batch nothing could score is not flat either.
    assert evaluate(c, BASE | {"reward_mean": 0.5, "reward_std": 0.0}, hist(flat0, flat0))[0] == []
    assert evaluate(c, BASE | flat0 | {"status_ok": 0.0}, hist(flat0, flat0))[1]["alerts/reward_flat"] == 0.0


def test_missing_inputs_and_disabled_rules_are_left_out():
    _, flags = evaluate(cfg(), dict(BASE), [])
    # No KL, entropy, update, throughput history, RSS, mismatch or held-out scores in these metrics.
    assert set(flags) == {"alerts/reward_flat", "alerts/verifier_errors"}
    fired, flags = evaluate(cfg(mismatch={"enabled": False}), BASE | {"mismatch/share_above": 0.9}, [])
    assert fired == [] and "alerts/mismatch" not in flags


def test_severity_comes_from_the_config_and_guards_alert_at_it():
    fired, _ = evaluate(cfg(kl_high={"severity": "critical"}), BASE | {"kl": 9.0}, [])
    assert fired[0].severity == "critical"
    assert guard_alert(cfg(), "nonfinite_loss", "stopped").severity == "critical"
    assert guard_alert(cfg(verifier_errors={"enabled": False}), "verifier_errors", "x") is None
    with pytest.raises(ValueError, match="severity"):
        cfg(kl_high={"severity": "page-me"})


def test_alert_keys_may_change_on_a_resume():
    from rlpipe.resume import config_changes, resume_fingerprint

    a, b = RunConfig(), cfg(kl_high={"max_kl": 0.1}, critical_grace_s=0)
    assert resume_fingerprint(a) == resume_fingerprint(b) and config_changes(a.flat(), b.flat()) == []
    assert config_changes(a.flat(), RunConfig.model_validate({"train": {"lr": 0.5}}).flat()) != []


def test_a_bad_automations_file_is_refused_before_anything_is_written(tmp_path):
    from typer.testing import CliRunner

    from rlpipe.cli import app

    bad = tmp_path / "a.yaml"
    bad.write_text("automations:\n  - name: x\n    trigger: {type: event, expect: [rlpipe.alert.*], posture: Sideways}\n"
                   "    actions: [{type: cancel-flow-run}]\n")
    res = CliRunner().invoke(app, ["automations", "install", "--file", str(bad)])
    assert res.exit_code == 2 and f"{bad}: automation #0 (x) is not valid" in res.output
    bad.write_text("- just a list\n")
    res = CliRunner().invoke(app, ["automations", "install", "--file", str(bad)])
    assert res.exit_code == 2 and "expected a top-level 'automations:' list" in res.output


def test_the_mismatch_rule_is_left_out_where_the_sampler_is_an_update_behind():
    """With rollout.async_steps: 1 the sampler's log-probs are the previous policy's: a gap the update made, not
    the engine's numerics. The rule is not evaluated (it fired at 40 of 47 iterations of a 113M async run, 10–32% of
    tokens, and never on-policy at that seed), the metric stays logged, and the alert-inputs line says so."""
    from rlpipe.config import settings
    from rlpipe.doctor import run_checks

    gap = BASE | {"mismatch/share_above": 0.3}
    assert [a.rule for a in evaluate(cfg(), gap, [])[0]] == ["mismatch"]
    off_policy = RunConfig.model_validate({"rollout": {"async_steps": 1, "prefetch": False}})
    fired, flags = evaluate(off_policy, gap, [])
    assert "mismatch" not in [a.rule for a in fired] and "alerts/mismatch" not in flags
    (check,) = [c for c in run_checks(off_policy, settings(), engine=False, timeout_s=30) if c.component == "alert-inputs"]
    assert check.status == "skip" and "alerts.mismatch (rollout.async_steps: 1" in check.detail
