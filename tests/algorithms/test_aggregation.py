"""Loss aggregation (token_mean, seq_mean_token_sum, seq_mean_token_mean, constant) and masked batches."""

import math

import pytest
import torch

from rlpipe.algorithms import AGG_MODES, LossAgg, aggregate, policy_loss, value_loss

D = torch.float64
MODES = ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant"]


def agg_for(mode, **counts):
    return LossAgg(mode, constant=4.0 if mode == "constant" else None, **counts)


def test_every_mode_hand_computed():
    # x = [[1,2,3],[4,5,6],[7,8,9]], mask [[1,1,0],[1,0,0],[0,0,0]] (the last row is fully masked):
    # token_mean          (1 + 2 + 4) / 3 tokens          = 7/3
    # seq_mean_token_sum  (3 + 4) / 2 sequences           = 3.5    (a masked row is no sequence)
    # seq_mean_token_mean (3/2 + 4/1) / 2                 = 2.75
    # constant (c = 4)    (1 + 2 + 4) / (3 sequences · 4) = 7/12  (Dr.GRPO: every sequence counts, masked or not)
    x = torch.arange(1.0, 10.0, dtype=D).reshape(3, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    want = {"token_mean": 7 / 3, "seq_mean_token_sum": 3.5, "seq_mean_token_mean": 2.75, "constant": 7 / 12}
    for mode in MODES:
        assert math.isclose(float(aggregate(x, mask, agg_for(mode))), want[mode], rel_tol=1e-12), mode
    assert math.isclose(float(aggregate(x, mask)), 7 / 3, rel_tol=1e-12)  # default is token_mean
    # Explicit counts replace this call's own: 7 / 10 tokens; 7 / 5 sequences; 5.5 / 5; 7 / (5·4).
    given = {"token_mean": 0.7, "seq_mean_token_sum": 1.4, "seq_mean_token_mean": 1.1, "constant": 0.35}
    for mode in MODES:
        got = float(aggregate(x, mask, agg_for(mode, num_tokens=10.0, num_seqs=5.0)))
        assert math.isclose(got, given[mode], rel_tol=1e-12), mode


def aggregate_reference(x, mask, mode, constant=4.0):
    rows = [[x[i][k] for k in range(len(x[i])) if mask[i][k]] for i in range(len(x))]
    if mode == "constant":
        return sum(sum(r) for r in rows) / (len(x) * constant)  # Dr.GRPO: every row counts, masked or not
    rows = [r for r in rows if r]
    tokens = sum(len(r) for r in rows)
    if mode == "token_mean":
        return sum(sum(r) for r in rows) / tokens
    if mode == "seq_mean_token_sum":
        return sum(sum(r) for r in rows) / len(rows)
    if mode == "seq_mean_token_mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    raise ValueError(mode)


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_matches_plain_loop_reference(mode):
    g = torch.Generator().manual_seed(20)
    x = torch.randn(7, 9, generator=g, dtype=D)
    mask = (torch.rand(7, 9, generator=g) > 0.5).float()
    mask[3] = 0
    want = aggregate_reference(x.tolist(), mask.tolist(), mode)
    assert math.isclose(float(aggregate(x, mask, agg_for(mode))), want, rel_tol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_aggregation_is_split_invariant_with_the_whole_batch_counts(mode):
    # Halves with different token and sequence counts (half 2 has a fully masked row and short rows).
    g = torch.Generator().manual_seed(21)
    x = torch.randn(8, 6, generator=g, dtype=D)
    lengths = torch.tensor([6, 5, 6, 4, 1, 0, 2, 3])
    mask = (torch.arange(6).unsqueeze(0) < lengths.unsqueeze(1)).float()
    whole = aggregate(x, mask, agg_for(mode))
    # 27 tokens; row 5 is no sequence, except for the constant normaliser, which counts all 8 rows
    counts = {"num_tokens": float(mask.sum()), "num_seqs": 8.0 if mode == "constant" else 7.0}
    for cut in (4, 1, 7):  # halves, and a lopsided split
        agg = agg_for(mode, **counts)
        parts = aggregate(x[:cut], mask[:cut], agg) + aggregate(x[cut:], mask[cut:], agg)
        assert torch.allclose(parts, whole, rtol=1e-12, atol=0), (mode, cut)
    # With each half's own counts the sum is wrong: the counts are what make the split work.
    naive = aggregate(x[:4], mask[:4], agg_for(mode)) + aggregate(x[4:], mask[4:], agg_for(mode))
    assert not torch.allclose(naive, whole, atol=1e-3)


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_batch_gives_zero_loss_and_finite_gradient_for_every_loss(mode):
    g = torch.Generator().manual_seed(22)
    old = torch.randn(3, 4, generator=g, dtype=D) - 1
    adv = torch.randn(3, 4, generator=g, dtype=D)
    returns = torch.randn(3, 4, generator=g, dtype=D)
    mask = torch.zeros(3, 4)
    # Own counts (0 → clamped) and a micro-batch of an all-masked mini-batch (counts 0 given explicitly).
    for agg in (agg_for(mode), agg_for(mode, num_tokens=0.0, num_seqs=0.0)):
        for name, opts in (("ppo_clip", {"clip_high": 0.28, "dual_clip": 3.0}), ("gspo", {})):
            new = (old + torch.randn(3, 4, generator=g, dtype=D)).requires_grad_()
            loss, m = policy_loss(name, new, old, adv, mask, agg=agg, **opts)
            loss.backward()
            assert loss.item() == 0.0, (name, mode)
            assert torch.isfinite(new.grad).all() and torch.all(new.grad == 0), (name, mode)
            assert all(math.isfinite(float(v)) for v in m.values()), (name, mode, m)
        for clip in (0.2, None):
            v = torch.randn(3, 4, generator=g, dtype=D).requires_grad_()
            loss, m = value_loss(v, v.detach() + 0.5, returns, mask, clip=clip, agg=agg)
            loss.backward()
            assert loss.item() == 0.0 and torch.all(v.grad == 0), ("value", mode)
            assert all(math.isfinite(float(x)) for x in m.values())


def test_fully_masked_rows_change_no_loss_in_any_mode():
    g = torch.Generator().manual_seed(23)
    old = torch.randn(4, 5, generator=g, dtype=D) - 1
    new = old + torch.randn(4, 5, generator=g, dtype=D) * 0.3
    adv = torch.randn(4, 5, generator=g, dtype=D)
    mask = (torch.rand(4, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1
    # Two extra rows with wild (finite) values and no response tokens.
    pad = lambda x, fill: torch.cat([x, torch.full((2, 5), fill, dtype=x.dtype)])  # noqa: E731
    for mode in MODES:
        agg = agg_for(mode)
        # Dr.GRPO's constant normaliser counts the two empty rows too (4 → 6 sequences): the values
        # of the masked tokens still change nothing.
        scale = 4 / 6 if mode == "constant" else 1.0
        for name in ("ppo_clip", "gspo"):
            a = policy_loss(name, new, old, adv, mask, agg=agg, clip_low=0.1)[0]
            b = policy_loss(name, pad(new, 5.0), pad(old, -30.0), pad(adv, 1e6), pad(mask, 0.0), agg=agg, clip_low=0.1)[0]
            assert torch.allclose(a * scale, b, rtol=1e-12, atol=0), (name, mode)
        a = value_loss(new, old, adv, mask, agg=agg)[0]
        b = value_loss(pad(new, 1e3), pad(old, -1e3), pad(adv, 1e6), pad(mask, 0.0), agg=agg)[0]
        assert torch.allclose(a * scale, b, rtol=1e-12, atol=0), ("value", mode)


def test_loss_agg_validates_its_settings():
    assert tuple(MODES) == AGG_MODES
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        LossAgg("mean")
    with pytest.raises(ValueError, match="constant"):
        LossAgg("constant")
    with pytest.raises(ValueError, match="constant"):
        LossAgg("constant", constant=0)
    # The loss functions use the mode they are given: Dr.GRPO's constant divides by sequences × L_max.
    loss, _ = policy_loss("ppo_clip", torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3),
                          torch.tensor([[1, 1, 1], [1, 0, 0]]), agg=LossAgg("constant", constant=8.0))
    assert math.isclose(loss.item(), -4 / 16, rel_tol=1e-6)  # per token −A·ρ = −1, 4 tokens / (2 · 8)


def test_loss_agg_rejects_a_negative_constant():
    with pytest.raises(ValueError, match="positive constant"):
        LossAgg("constant", constant=-4.0)
