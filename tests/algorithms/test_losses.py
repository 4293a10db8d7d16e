"""Policy losses (ppo_clip with clip-higher / dual-clip, gspo), value loss, explained variance, helpers."""

import math

import pytest
import torch

from rlpipe.algorithms import LossAgg, algorithm, explained_variance, policy_loss, value_loss
from rlpipe.algorithms.functional import entropy_from_logits, masked_mean, token_logprobs

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


def one_token(name, ratio, adv, **options):
    """Loss and d loss / d logπ for a single token with the given ratio and advantage."""
    old = t([[math.log(0.1)]])
    new = (old + math.log(ratio)).requires_grad_()
    loss, m = policy_loss(name, new, old, t([[adv]]), torch.ones(1, 1), **options)
    loss.backward()
    return loss.item(), float(new.grad), float(m["clip_frac"])


# ------------------------------------------------------------------------------------------ ppo_clip


def test_ppo_clip_hand_computed():
    # ratios 1.2 (A=+1), 1.5 (A=+1), 0.5 (A=−1), 0.5 (A=+1) with ε = 0.2:
    # per-token max(−Aρ, −A·clip ρ) = −1.2, −1.2 (clipped), 0.8 (clipped), −0.5 → mean −0.525
    old = torch.log(torch.tensor([[0.5, 0.2, 0.4, 0.4]]))
    new = torch.log(torch.tensor([[0.6, 0.3, 0.2, 0.2]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    loss, m = policy_loss("ppo_clip", new, old, adv, torch.ones(1, 4), clip_low=0.2)
    assert math.isclose(loss.item(), (-1.2 - 1.2 + 0.8 - 0.5) / 4, rel_tol=1e-5)
    assert math.isclose(float(m["clip_frac"]), 0.5)
    # A masked token changes nothing but the denominator.
    loss, _ = policy_loss("ppo_clip", new, old, adv, torch.tensor([[1, 1, 1, 0]]), clip_low=0.2)
    assert math.isclose(loss.item(), (-1.2 - 1.2 + 0.8) / 3, rel_tol=1e-5)
    # ε = 0.6 clips nothing here: −1.2, −1.5, 0.5, −0.5.
    loss, m = policy_loss("ppo_clip", new, old, adv, torch.ones(1, 4), clip_low=0.6)
    assert math.isclose(loss.item(), (-1.2 - 1.5 + 0.5 - 0.5) / 4, rel_tol=1e-5) and float(m["clip_frac"]) == 0.0


def test_clip_higher_only_widens_the_upper_side():
    # ρ = 1.25, A = +1: ε_high = 0.28 → 1.25 ≤ 1.28, not clipped: loss −1.25, d/dlogπ = −A·ρ = −1.25.
    loss, grad, cf = one_token("ppo_clip", 1.25, 1.0, clip_low=0.2, clip_high=0.28)
    assert math.isclose(loss, -1.25, rel_tol=1e-9) and math.isclose(grad, -1.25, rel_tol=1e-9) and cf == 0.0
    # ε_high = 0.2 (or left to default to ε_low): clipped at 1.2, no gradient.
    for opts in ({"clip_low": 0.2, "clip_high": 0.2}, {"clip_low": 0.2}):
        loss, grad, cf = one_token("ppo_clip", 1.25, 1.0, **opts)
        assert math.isclose(loss, -1.2, rel_tol=1e-9) and grad == 0.0 and cf == 1.0
    # The low side still uses ε_low: ρ = 0.75, A = −1 → clip at 0.8 → loss max(0.75, 0.8) = 0.8, no gradient.
    loss, grad, cf = one_token("ppo_clip", 0.75, -1.0, clip_low=0.2, clip_high=0.28)
    assert math.isclose(loss, 0.8, rel_tol=1e-9) and grad == 0.0 and cf == 1.0
    # ε_low = 0.3 lets ρ = 0.75 through: loss 0.75, d/dlogπ = −A·ρ = 0.75.
    loss, grad, cf = one_token("ppo_clip", 0.75, -1.0, clip_low=0.3, clip_high=0.28)
    assert math.isclose(loss, 0.75, rel_tol=1e-9) and math.isclose(grad, 0.75, rel_tol=1e-9) and cf == 0.0


def test_dual_clip_bounds_the_loss_for_negative_advantages():
    # A = −1, ρ = 5, c = 3: plain PPO gives max(−Aρ, −A·clip(ρ)) = max(5, 1.2) = 5 with gradient 5;
    # the dual clip caps it at −A·c = 3 (no gradient).
    assert one_token("ppo_clip", 5.0, -1.0, clip_low=0.2)[:2] == pytest.approx((5.0, 5.0))
    loss, grad, cf = one_token("ppo_clip", 5.0, -1.0, clip_low=0.2, dual_clip=3.0)
    assert math.isclose(loss, 3.0, rel_tol=1e-9) and grad == 0.0 and cf == 1.0
    # A = −2: the bound scales with |A| → 6.
    assert math.isclose(one_token("ppo_clip", 5.0, -2.0, clip_low=0.2, dual_clip=3.0)[0], 6.0, rel_tol=1e-9)
    # Below the bound nothing changes: ρ = 2, A = −1 → 2 with gradient 2.
    assert one_token("ppo_clip", 2.0, -1.0, clip_low=0.2, dual_clip=3.0)[:2] == pytest.approx((2.0, 2.0))
    # A > 0 is never touched by the dual clip: ρ = 5 → −1.2 (upper clip).
    assert one_token("ppo_clip", 5.0, 1.0, clip_low=0.2, dual_clip=3.0)[0] == pytest.approx(-1.2)
    # The bound holds for any ratio.
    old = torch.zeros(1, 200, dtype=D)
    new = torch.linspace(-5, 15, 200, dtype=D).unsqueeze(0)
    adv = -torch.rand(1, 200, dtype=D) - 0.1
    per_seq = LossAgg("seq_mean_token_sum", num_seqs=1.0)
    for j in range(200):
        loss, _ = policy_loss("ppo_clip", new[:, j:j + 1], old[:, j:j + 1], adv[:, j:j + 1], torch.ones(1, 1),
                              agg=per_seq, dual_clip=3.0)
        assert loss.item() <= -3.0 * float(adv[0, j]) + 1e-12


def ppo_reference(new, old, adv, mask, clip_low, clip_high, dual_clip):
    total, n = 0.0, 0
    for b in range(len(mask)):
        for k in range(len(mask[b])):
            if not mask[b][k]:
                continue
            r, a = math.exp(new[b][k] - old[b][k]), adv[b][k]
            loss = max(-a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high))
            if dual_clip is not None and a < 0:
                loss = min(loss, -a * dual_clip)
            total += loss
            n += 1
    return total / n


@pytest.mark.parametrize("clip_low,clip_high,dual_clip", [(0.1, None, None), (0.2, 0.28, None), (0.2, 0.28, 1.5)])
def test_ppo_clip_matches_plain_loop_and_gradient_is_zero_when_clipped(clip_low, clip_high, dual_clip):
    g = torch.Generator().manual_seed(1)
    new = (torch.randn(6, 8, generator=g, dtype=D) * 0.4 - 1).requires_grad_()
    old = torch.randn(6, 8, generator=g, dtype=D) * 0.4 - 1
    adv = torch.randn(6, 8, generator=g, dtype=D)
    mask = (torch.rand(6, 8, generator=g) > 0.3).float()
    loss, m = policy_loss("ppo_clip", new, old, adv, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    hi = clip_low if clip_high is None else clip_high
    ref = ppo_reference(new.tolist(), old.tolist(), adv.tolist(), mask.tolist(), clip_low, hi, dual_clip)
    assert math.isclose(loss.item(), ref, rel_tol=1e-10)
    loss.backward()
    ratio = torch.exp(new.detach() - old)
    clipped_out = ((adv > 0) & (ratio > 1 + hi)) | ((adv < 0) & (ratio < 1 - clip_low))
    if dual_clip is not None:
        clipped_out |= (adv < 0) & (ratio > dual_clip)
    assert clipped_out[mask > 0].any() and (~clipped_out[mask > 0]).any()
    assert torch.all(new.grad[clipped_out] == 0) and torch.all(new.grad[mask == 0] == 0)
    # Elsewhere the gradient is −A·ρ / (number of tokens).
    live = ~clipped_out & (mask > 0)
    assert torch.allclose(new.grad[live], (-adv * ratio / mask.sum())[live])
    assert math.isclose(float(m["clip_frac"]), float(clipped_out[mask > 0].double().mean()), rel_tol=1e-9)


def test_ppo_on_policy_gradient_is_advantage_weighted_logprob_gradient():
    # At ρ = 1 the clipped surrogate's gradient equals −A·∇logπ / n (REINFORCE with a baseline).
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv = torch.tensor([[0.5, -2.0]])
    loss, _ = policy_loss("ppo_clip", logp, logp.detach(), adv, torch.ones(1, 2))
    loss.backward()
    assert torch.allclose(logp.grad, -adv / 2)


def test_token_counts_make_split_batches_add_up():
    g = torch.Generator().manual_seed(2)
    new, old, adv = (torch.randn(6, 5, generator=g, dtype=D) for _ in range(3))
    mask = (torch.rand(6, 5, generator=g) > 0.4).float()
    whole, _ = policy_loss("ppo_clip", new, old, adv, mask)
    agg = LossAgg("token_mean", num_tokens=float(mask.sum()))
    parts = sum(policy_loss("ppo_clip", new[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], agg=agg)[0]
                for i in (0, 2, 4))
    assert torch.allclose(whole, parts, atol=1e-12)
    naive = sum(policy_loss("ppo_clip", new[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2])[0] for i in (0, 2, 4))
    assert not torch.allclose(whole, naive, atol=1e-3)  # the counts are what makes it work


def test_empty_mask_is_zero_not_nan():
    loss, m = policy_loss("ppo_clip", torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert loss.item() == 0.0 and not any(math.isnan(float(v)) for v in m.values())


def test_policy_loss_passes_only_declared_options():
    # ρ = 1.25, A = 1: the old `clip_ratio` spelling and foreign options are ignored (default ε = 0.2
    # applies → −1.2), while the declared clip_high is honoured (→ −1.25).
    old = t([[math.log(0.4)]])
    new = t([[math.log(0.5)]])
    kw = {"clip_ratio": 0.5, "gamma": 0.9, "kl_coef": 1.0}
    assert math.isclose(float(policy_loss("ppo_clip", new, old, t([[1.0]]), torch.ones(1, 1), **kw)[0]), -1.2)
    loss, _ = policy_loss("ppo_clip", new, old, t([[1.0]]), torch.ones(1, 1), clip_high=0.28, **kw)
    assert math.isclose(loss.item(), -1.25)


# ---------------------------------------------------------------------------------------------- gspo


def test_gspo_hand_computed():
    # log ρ_t = 0.1, −0.3, 0.5 → sequence log-ratio 0.1 → s = e^0.1 = 1.105171 on every token.
    old = torch.log(t([[0.5, 0.5, 0.5]]))
    new = (old + t([[0.1, -0.3, 0.5]])).requires_grad_()
    adv = t([[1.0, 1.0, 1.0]])
    s = math.exp(0.1)
    # ε = 0.2 on both sides: not clipped; loss −A·s = −1.105171; d/dlogπ_t = −A·s/|o| = −s/3 on each token.
    loss, m = policy_loss("gspo", new, old, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.2,
                          agg=LossAgg("seq_mean_token_mean"))
    loss.backward()
    assert math.isclose(loss.item(), -s, rel_tol=1e-12) and float(m["clip_frac"]) == 0.0
    assert torch.allclose(new.grad, torch.full((1, 3), -s / 3, dtype=D))
    # PPO-clip would clip token 2 (ρ = e^0.5 = 1.65) and not token 0; GSPO clips whole sequences.
    # The paper's ranges (the defaults, 3e-4 / 4e-4): s is clipped to 1.0004 → loss −1.0004, no gradient.
    new.grad = None
    loss, m = policy_loss("gspo", new, old, adv, torch.ones(1, 3), agg=LossAgg("seq_mean_token_mean"))
    loss.backward()
    assert math.isclose(loss.item(), -1.0004, rel_tol=1e-12) and float(m["clip_frac"]) == 1.0
    assert torch.all(new.grad == 0)
    # Mask 1,1,0 → log s = (0.1 − 0.3)/2 = −0.1, s = 0.904837; A = −1: clip at 1 − 3e-4 = 0.9997 → loss 0.9997.
    loss, _ = policy_loss("gspo", new, old, -adv, t([[1.0, 1.0, 0.0]]), agg=LossAgg("seq_mean_token_mean"))
    assert math.isclose(loss.item(), 0.9997, rel_tol=1e-12)
    # GSPO-token with token-level advantages A = 1, 2, −1 (no clipping): loss mean_t(−A_t·s) = −(2/3)·s and
    # d/dlogπ_t = −A_t·s/|o| = −s/3, −2s/3, +s/3 (each token keeps its own advantage; the gradient of the
    # plain sequence formula would give every token −mean(A)·s/|o| = −2s/9 instead).
    new.grad = None
    loss, _ = policy_loss("gspo", new, old, t([[1.0, 2.0, -1.0]]), torch.ones(1, 3), clip_low=0.2, clip_high=0.2,
                          agg=LossAgg("seq_mean_token_mean"))
    loss.backward()
    assert math.isclose(loss.item(), -2 * s / 3, rel_tol=1e-12)
    assert torch.allclose(new.grad, t([[-s / 3, -2 * s / 3, s / 3]]), rtol=1e-12)


def gspo_reference(new, old, adv, mask, lo, hi):
    """Per sequence s_i = exp(mean of log ρ over its tokens); per token max(−A s, −A clip(s)); seq-mean-token-mean."""
    per_seq = []
    for i in range(len(mask)):
        toks = [k for k in range(len(mask[i])) if mask[i][k]]
        if not toks:
            continue
        s = math.exp(sum(new[i][k] - old[i][k] for k in toks) / len(toks))
        sc = min(max(s, 1 - lo), 1 + hi)
        per_seq.append(sum(max(-adv[i][k] * s, -adv[i][k] * sc) for k in toks) / len(toks))
    return sum(per_seq) / len(per_seq)


def test_gspo_matches_plain_loop_reference():
    g = torch.Generator().manual_seed(3)
    old = torch.randn(8, 6, generator=g, dtype=D) - 1
    new = old + torch.randn(8, 6, generator=g, dtype=D) * 0.15
    adv = torch.randn(8, 6, generator=g, dtype=D)  # token-level advantages are allowed (GSPO-token)
    mask = (torch.rand(8, 6, generator=g) > 0.3).float()
    mask[:, 0] = 1
    mask[5] = 0  # a fully masked row is no sequence
    loss, m = policy_loss("gspo", new, old, adv, mask, clip_low=0.03, clip_high=0.04, agg=LossAgg("seq_mean_token_mean"))
    ref = gspo_reference(new.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.03, 0.04)
    assert math.isclose(loss.item(), ref, rel_tol=1e-10)
    assert 0.0 < float(m["clip_frac"]) < 1.0  # some sequences clipped, some not


def test_gspo_gradient_is_sequence_ratio_times_mean_logprob_gradient():
    # With a per-sequence advantage and no clipping active, GSPO's gradient is
    # ∇ (1/G) Σ_i −A_i·s_i  =  −(1/G) Σ_i A_i·s_i·∇(mean_t logπ_θ(y_{i,t})).
    g = torch.Generator().manual_seed(4)
    B, T = 5, 7
    old = torch.randn(B, T, generator=g, dtype=D) - 2
    theta = old + torch.randn(B, T, generator=g, dtype=D) * 0.2
    seq_adv = torch.randn(B, generator=g, dtype=D)
    lengths = torch.tensor([7, 3, 1, 5, 6])
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(D)
    adv = seq_adv.unsqueeze(-1).expand(B, T)

    new = theta.clone().requires_grad_()
    loss, m = policy_loss("gspo", new, old, adv, mask, clip_low=5.0, clip_high=5.0, agg=LossAgg("seq_mean_token_mean"))
    loss.backward()
    assert float(m["clip_frac"]) == 0.0

    explicit = theta.clone().requires_grad_()
    s = torch.exp(((explicit - old) * mask).sum(-1) / mask.sum(-1))
    ref_loss = (-seq_adv * s).mean()
    ref_loss.backward()
    assert math.isclose(loss.item(), ref_loss.item(), rel_tol=1e-12)
    assert torch.allclose(new.grad, explicit.grad, atol=1e-14)
    # And element by element: −A_i·s_i/(|o_i|·G) on the response, 0 off it.
    for i in range(B):
        s_i = math.exp(sum(float(theta[i, k] - old[i, k]) for k in range(int(lengths[i]))) / int(lengths[i]))
        for k in range(T):
            want = -float(seq_adv[i]) * s_i / (int(lengths[i]) * B) if k < lengths[i] else 0.0
            assert math.isclose(float(new.grad[i, k]), want, rel_tol=1e-9, abs_tol=1e-15)
    # Token-level PPO weights each token by its own ρ_t instead: a different gradient.
    ppo = theta.clone().requires_grad_()
    policy_loss("ppo_clip", ppo, old, adv, mask, clip_low=5.0, agg=LossAgg("seq_mean_token_mean"))[0].backward()
    assert not torch.allclose(ppo.grad, new.grad, atol=1e-4)


# ------------------------------------------------------------------------------------------ value loss


def test_value_loss_hand_computed():
    # V = 1.0, 2.0; V_old = 0.5, 2.0; R = 2.0, 0.0; c = 0.2.
    # token 0: (V−R)² = 1; V_clip = 0.5 + clip(0.5) = 0.7 → (0.7−2)² = 1.69 → ½·1.69 = 0.845 (clipped)
    # token 1: (2−0)² = 4; V_clip = 2 → 4 → ½·4 = 2.  mean = 1.4225; clip frac ½; value mse (1+4)/2 = 2.5
    v = t([[1.0, 2.0]]).requires_grad_()
    old, ret, mask = t([[0.5, 2.0]]), t([[2.0, 0.0]]), torch.ones(1, 2)
    loss, m = value_loss(v, old, ret, mask, clip=0.2)
    loss.backward()
    assert math.isclose(loss.item(), 1.4225, rel_tol=1e-12)
    assert float(m["vf_clip_frac"]) == 0.5 and math.isclose(float(m["value_mse"]), 2.5)
    # The clipped token has no gradient; token 1: d/dV ½(V−R)²/2 = (2−0)/2 = 1.
    assert torch.allclose(v.grad, t([[0.0, 1.0]]))
    # Unclipped: ½·(1 + 4)/2 = 1.25, gradient (V − R)/2 = −0.5, 1.
    v.grad = None
    loss, m = value_loss(v, old, ret, mask, clip=None)
    loss.backward()
    assert math.isclose(loss.item(), 1.25, rel_tol=1e-12) and float(m["vf_clip_frac"]) == 0.0
    assert torch.allclose(v.grad, t([[-0.5, 1.0]]))


@pytest.mark.parametrize("clip", [0.2, None])
def test_value_loss_matches_plain_loop_reference(clip):
    g = torch.Generator().manual_seed(5)
    v, old, ret = (torch.randn(4, 6, generator=g, dtype=D) for _ in range(3))
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    total, n = 0.0, 0
    for i in range(4):
        for k in range(6):
            if mask[i, k]:
                e = (float(v[i, k]) - float(ret[i, k])) ** 2
                if clip is not None:
                    vc = float(old[i, k]) + min(max(float(v[i, k] - old[i, k]), -clip), clip)
                    e = max(e, (vc - float(ret[i, k])) ** 2)
                total += 0.5 * e
                n += 1
    loss, _ = value_loss(v, old, ret, mask, clip=clip, agg=LossAgg("token_mean"))
    assert math.isclose(loss.item(), total / n, rel_tol=1e-12)


# --------------------------------------------------------------------------------- explained variance


def test_explained_variance_hand_computed():
    r = t([1.0, 2.0, 3.0, 4.0])
    ones = torch.ones(4)
    assert explained_variance(r, r, ones) == 1.0  # perfect critic
    assert math.isclose(explained_variance(torch.full((4,), 2.5, dtype=D), r, ones), 0.0, abs_tol=1e-12)  # constant
    # V = R + (1,−1,1,−1): Var(R − V) = 1, Var(R) = 1.25 (population) → 1 − 0.8 = 0.2
    assert math.isclose(explained_variance(r + t([1, -1, 1, -1]), r, ones), 0.2, rel_tol=1e-12)
    # A masked entry is ignored however wrong it is: R = 1,2,3 (Var 2/3), V = R except the masked one.
    v = t([1.0, 2.0, 3.0, 100.0])
    assert explained_variance(v, r, t([1, 1, 1, 0])) == 1.0
    # Worse than a constant is negative: V = −R → Var(2R) = 4·Var(R) → 1 − 4 = −3.
    assert math.isclose(explained_variance(-r, r, ones), -3.0, rel_tol=1e-12)


def test_explained_variance_matches_plain_loop_reference_and_degenerate_cases():
    g = torch.Generator().manual_seed(6)
    r = torch.randn(3, 5, generator=g, dtype=D)
    v = r + torch.randn(3, 5, generator=g, dtype=D) * 0.5
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    pairs = [(float(r[i, k]), float(v[i, k])) for i in range(3) for k in range(5) if mask[i, k]]

    def pvar(xs):
        mu = sum(xs) / len(xs)
        return sum((x - mu) ** 2 for x in xs) / len(xs)

    want = 1 - pvar([a - b for a, b in pairs]) / pvar([a for a, _ in pairs])
    assert math.isclose(explained_variance(v, r, mask), want, rel_tol=1e-10)
    # Undefined (documented as NaN, never an exception or inf): < 2 entries, or constant returns.
    assert math.isnan(explained_variance(v, r, torch.zeros(3, 5)))
    one = torch.zeros(3, 5)
    one[1, 2] = 1
    assert math.isnan(explained_variance(v, r, one))
    assert math.isnan(explained_variance(v, torch.ones(3, 5), torch.ones(3, 5)))


# ------------------------------------------------------------------------------------ helpers, names


def test_token_logprobs_and_entropy():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [math.log(3), 0.0, 0.0, 0.0]]])
    lp = token_logprobs(logits, torch.tensor([[2, 0]]))
    assert torch.allclose(lp, torch.tensor([[math.log(0.25), math.log(0.5)]]))
    assert torch.allclose(token_logprobs(logits, torch.tensor([[2, 0]]), temperature=2.0)[0, 1],
                          torch.tensor(math.log(math.sqrt(3) / (math.sqrt(3) + 3))))
    ent = entropy_from_logits(logits)
    assert torch.allclose(ent[0, 0], torch.tensor(math.log(4)))
    assert math.isclose(float(masked_mean(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 0.0]))), 0.0)


def test_unknown_names_list_the_valid_ones():
    assert algorithm("dr_grpo") == {"advantage": "dr_grpo", "policy_loss": "ppo_clip", "loss_agg_mode": "constant"}
    with pytest.raises(KeyError, match="valid: .*grpo"):
        algorithm("ppo2")
    with pytest.raises(KeyError, match="valid: gspo, ppo_clip"):
        policy_loss("ppo3", torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1))
