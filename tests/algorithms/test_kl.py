"""KL estimators (k1, k2, k3, low_var_kl) and the fixed / adaptive KL controllers."""

import math

import pytest
import torch

from rlpipe.algorithms import (
    KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_controller, kl_penalty,
)

D = torch.float64


def test_kl_estimators_hand_computed():
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    # log_ratio = log(ref/p) = log 0.5:
    # k1 = −log 0.5 = log 2; k2 = ½·(log 0.5)² = 0.240227; k3 = 0.5 − log 0.5 − 1 = 0.193147
    assert torch.allclose(kl_penalty(logp, ref, "k1"), torch.tensor([math.log(2)]))
    assert torch.allclose(kl_penalty(logp, ref, "k2"), torch.tensor([0.5 * math.log(0.5) ** 2]))
    assert torch.allclose(kl_penalty(logp, ref, "k3"), torch.tensor([0.5 - math.log(0.5) - 1]))
    assert torch.allclose(kl_penalty(logp, ref, "low_var_kl"), torch.tensor([0.5 - math.log(0.5) - 1]))
    assert kl_penalty(ref, ref, "k3").item() == 0.0
    # k1 is signed: the other way round it is −log 2 (k2, k3 are not symmetric but ≥ 0).
    assert torch.allclose(kl_penalty(ref, logp, "k1"), torch.tensor([-math.log(2)]))
    # log_ratio = log 2: k3 = 2 − log 2 − 1 = 0.306853
    assert torch.allclose(kl_penalty(ref, logp, "k3"), torch.tensor([1 - math.log(2)]))


def test_k3_is_unbiased_estimate_of_kl():
    # E_{a~p}[k3] = KL(p‖q): check against the exact KL on a 3-way distribution; so is k1.
    p, q = torch.tensor([0.7, 0.2, 0.1], dtype=D), torch.tensor([0.3, 0.3, 0.4], dtype=D)
    exact = float((p * (p / q).log()).sum())
    for kind in ("k1", "k3"):
        est = float((p * kl_penalty(p.log(), q.log(), kind)).sum())
        assert math.isclose(est, exact, rel_tol=1e-12), kind
    # k2 is biased: its expectation differs from the exact KL here.
    assert not math.isclose(float((p * kl_penalty(p.log(), q.log(), "k2")).sum()), exact, rel_tol=1e-3)
    assert torch.all(kl_penalty(torch.randn(100), torch.randn(100), "k3") >= 0)


def test_low_var_kl_clamps_at_ten_and_everything_stays_finite():
    logp = torch.zeros(5, dtype=D)
    # log_ratio = 20 → k3 = e^20 − 21 ≈ 4.85e8 → 10.
    # log_ratio = −30 → clamped to −20 → k3 = e^−20 + 19 ≈ 19.000000002 → 10.
    # log_ratio = 2.5 → k3 = e^2.5 − 3.5 = 8.682494 (under the clamp, unchanged).
    # log_ratio = ±1000 → still finite.
    ref = torch.tensor([20.0, -30.0, 2.5, 1000.0, -1000.0], dtype=D)
    k3 = kl_penalty(logp, ref, "k3")
    lv = kl_penalty(logp, ref, "low_var_kl")
    assert math.isclose(float(k3[0]), math.exp(20) - 21, rel_tol=1e-12)
    assert math.isclose(float(k3[1]), math.exp(-20) + 19, rel_tol=1e-12)
    assert torch.allclose(lv, torch.tensor([10.0, 10.0, math.exp(2.5) - 3.5, 10.0, 10.0], dtype=D))
    assert torch.isfinite(k3).all() and torch.isfinite(lv).all()
    for kind in KL_ESTIMATORS.names():
        x = kl_penalty(torch.tensor([0.0, -1e4]), torch.tensor([-1e4, 0.0]), kind)
        assert torch.isfinite(x).all(), kind  # k2 = ½·(1e4)² = 5e7 is large but finite
    # Gradient of low_var_kl w.r.t. logπ: zero where clamped, finite everywhere.
    lp = torch.zeros(3, dtype=D, requires_grad=True)
    kl_penalty(lp, torch.tensor([20.0, 0.5, -30.0], dtype=D), "low_var_kl").sum().backward()
    # d k3 / d logπ = −(e^{lr} − 1) at lr = 0.5 → −(1.648721 − 1) = −0.648721
    assert torch.allclose(lp.grad, torch.tensor([0.0, -(math.exp(0.5) - 1), 0.0], dtype=D))


def test_kl_estimators_match_plain_loop_reference():
    g = torch.Generator().manual_seed(7)
    logp = torch.randn(4, 9, generator=g, dtype=D) * 2 - 3
    ref = torch.randn(4, 9, generator=g, dtype=D) * 2 - 3
    want = {k: [[0.0] * 9 for _ in range(4)] for k in ("k1", "k2", "k3", "low_var_kl")}
    for i in range(4):
        for j in range(9):
            lr = float(ref[i, j]) - float(logp[i, j])  # log π_ref/π_θ
            want["k1"][i][j] = -lr
            want["k2"][i][j] = 0.5 * lr * lr
            want["k3"][i][j] = math.exp(lr) - lr - 1
            want["low_var_kl"][i][j] = min(max(math.exp(lr) - lr - 1, -10.0), 10.0)
    for kind, table in want.items():
        assert torch.allclose(kl_penalty(logp, ref, kind), torch.tensor(table, dtype=D), rtol=1e-12, atol=1e-12), kind
    assert any(v > 10 for row in want["k3"] for v in row)  # the clamp was exercised


def test_fixed_controller_never_moves():
    c = kl_controller(0.05)
    assert type(c) is FixedKLController
    assert c.update(100.0, 1000) == 0.05 and c.update(0.0, 1000) == 0.05 and c.value == 0.05
    c.load_state_dict({"value": 0.3})
    assert c.state_dict() == {"value": 0.3}


def test_adaptive_controller_hand_computed():
    # β = 0.1, target 1.0, KL 2.0: error 2/1 − 1 = 1 → clipped to 0.2; n = 100, horizon 1000
    # → β·(1 + 0.2·100/1000) = 0.1·1.02 = 0.102.
    c = kl_controller(0.1, target=1.0, horizon=1000)
    assert isinstance(c, AdaptiveKLController)
    assert math.isclose(c.update(2.0, 100), 0.102, rel_tol=1e-12) and math.isclose(c.value, 0.102, rel_tol=1e-12)
    # KL 1.1 → error 0.1 (inside the clip) → 0.102·(1 + 0.1·0.1) = 0.10302.
    assert math.isclose(c.update(1.1, 100), 0.10302, rel_tol=1e-12)
    # KL 0.5 → error −0.5 → −0.2 → 0.10302·(1 − 0.02) = 0.1009596: β falls below target.
    assert math.isclose(c.update(0.5, 100), 0.1009596, rel_tol=1e-12)
    # KL on target → unchanged.
    assert math.isclose(c.update(1.0, 100), 0.1009596, rel_tol=1e-12)


def test_adaptive_controller_matches_plain_loop_and_round_trips():
    g = torch.Generator().manual_seed(8)
    kls = (torch.rand(50, generator=g, dtype=D) * 0.2).tolist()
    ns = torch.randint(1, 500, (50,), generator=g).tolist()
    c = AdaptiveKLController(0.05, target=0.1, horizon=2000)
    beta = 0.05
    for kl, n in zip(kls, ns):
        e = kl / 0.1 - 1
        e = 0.2 if e > 0.2 else (-0.2 if e < -0.2 else e)
        beta = beta * (1 + e * n / 2000)
        assert math.isclose(c.update(kl, n), beta, rel_tol=1e-12)
    assert beta != 0.05
    d = AdaptiveKLController(1.0, target=0.1, horizon=2000)
    d.load_state_dict(c.state_dict())
    assert d.value == c.value and d.update(0.3, 10) == c.update(0.3, 10)


@pytest.mark.parametrize("target,horizon", [(0.0, 10), (-1.0, 10), (1.0, 0)])
def test_adaptive_controller_rejects_bad_settings(target, horizon):
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target, horizon)


def test_unknown_kl_estimator_lists_the_valid_ones():
    with pytest.raises(KeyError, match="k1, k2, k3, low_var_kl"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k9")
