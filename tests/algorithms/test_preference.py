"""Bradley–Terry against hand-computed values and a plain loop; the running reward normaliser."""

import math

import pytest
import torch

from rlpipe.algorithms.preference import PREFERENCE_LOSSES, RunningNorm, bradley_terry_loss, preference_loss


def _sig(x):
    return 1 / (1 + math.exp(-x))


def test_bradley_terry_by_hand():
    loss, m = bradley_terry_loss(torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0]))
    want = -(math.log(_sig(2.0)) + math.log(_sig(0.0)) + math.log(_sig(-2.0))) / 3  # 0.1269+0.6931+2.1269 → 0.9823
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert loss.item() == pytest.approx(0.9823, abs=1e-4)
    assert m["pair_accuracy"] == pytest.approx(1 / 3)  # a tie is not a win
    assert m["score_gap"] == pytest.approx((2 + 0 - 2) / 3)


def test_margin_must_be_won_and_unknown_margin_counts_zero():
    chosen, rejected = torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0])
    loss, _ = bradley_terry_loss(chosen, rejected, torch.tensor([1.0, float("nan")]))
    want = -(math.log(_sig(1.0 - 1.0)) + math.log(_sig(1.0))) / 2
    assert loss.item() == pytest.approx(want, abs=1e-6)
    plain, _ = bradley_terry_loss(chosen, rejected)
    assert loss.item() > plain.item()  # a margin asks for more


def test_bradley_terry_matches_a_loop_and_its_gradient_pushes_apart():
    torch.manual_seed(0)
    c, r, m = torch.randn(17, requires_grad=True), torch.randn(17, requires_grad=True), torch.rand(17)
    loss, _ = bradley_terry_loss(c, r, m)
    ref = sum(-math.log(_sig(float(c[i] - r[i] - m[i]))) for i in range(17)) / 17
    assert torch.allclose(loss, torch.tensor(ref, dtype=loss.dtype), atol=1e-5)
    loss.backward()
    assert (c.grad < 0).all() and (r.grad > 0).all()  # descent raises chosen, lowers rejected
    assert torch.allclose(c.grad, -r.grad)


def test_registry():
    assert preference_loss("bradley_terry") is bradley_terry_loss
    with pytest.raises(KeyError, match="valid: bradley_terry"):
        preference_loss("hinge")
    with pytest.raises(ValueError, match="already registered"):
        PREFERENCE_LOSSES.register("bradley_terry")(bradley_terry_loss)


def test_running_norm_uses_the_statistics_from_before_the_batch():
    norm = RunningNorm.seeded(mean=2.0, std=0.5, count=4)
    out = norm.normalise([2.0, 3.0, 0.0, 100.0], clip=5.0)
    assert out == pytest.approx([0.0, 2.0, -4.0, 5.0])  # (x − 2) / 0.5, the last clipped at 5
    xs = [2.5, 1.5, 2.5, 1.5, 2.0, 3.0, 0.0, 100.0]  # the seed's 4 values (mean 2, std 0.5) + the batch
    assert norm.count == 8
    assert norm.mean == pytest.approx(sum(xs) / 8)
    assert norm.std == pytest.approx(math.sqrt(sum((x - sum(xs) / 8) ** 2 for x in xs) / 8))
    restored = RunningNorm(**norm.state_dict())  # what the progress stores: a resume continues identically
    assert restored.normalise([5.0], None) == norm.normalise([5.0], None)


def test_running_norm_without_statistics_passes_scores_through():
    assert RunningNorm().normalise([3.0, -1.0], clip=None) == [3.0, -1.0]
