import math

import pytest
import torch

from rlpipe.algorithms import algorithm, kl_penalty, policy_loss
from rlpipe.algorithms.functional import entropy_from_logits, masked_mean, token_logprobs


def test_ppo_clip_hand_computed():
    # ratios 1.2 (A=+1), 1.5 (A=+1), 0.5 (A=−1), 0.5 (A=+1) with ε = 0.2:
    # per-token max(−Aρ, −A·clip ρ) = −1.2, −1.2 (clipped), 0.8 (clipped), −0.5 → mean −0.525
    old = torch.log(torch.tensor([[0.5, 0.2, 0.4, 0.4]]))
    new = torch.log(torch.tensor([[0.6, 0.3, 0.2, 0.2]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    loss, m = policy_loss("ppo_clip", new, old, adv, torch.ones(1, 4), clip_ratio=0.2)
    assert math.isclose(float(loss), (-1.2 - 1.2 + 0.8 - 0.5) / 4, rel_tol=1e-5)
    assert math.isclose(float(m["clip_frac"]), 0.5)
    # A masked token changes nothing but the denominator.
    loss, _ = policy_loss("ppo_clip", new, old, adv, torch.tensor([[1, 1, 1, 0]]), clip_ratio=0.2)
    assert math.isclose(float(loss), (-1.2 - 1.2 + 0.8) / 3, rel_tol=1e-5)


def test_ppo_clip_matches_plain_loop_and_gradient_is_zero_when_clipped():
    g = torch.Generator().manual_seed(1)
    new = (torch.randn(4, 6, generator=g) * 0.3 - 1).requires_grad_()
    old = torch.randn(4, 6, generator=g) * 0.3 - 1
    adv = torch.randn(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    loss, _ = policy_loss("ppo_clip", new, old, adv, mask, clip_ratio=0.1)
    total, n = 0.0, 0
    for b in range(4):
        for t in range(6):
            if mask[b, t]:
                r = math.exp(float(new[b, t].detach()) - float(old[b, t]))
                a = float(adv[b, t])
                total += max(-a * r, -a * min(max(r, 0.9), 1.1))
                n += 1
    assert math.isclose(float(loss.detach()), total / n, rel_tol=1e-5)
    loss.backward()
    ratio = torch.exp(new.detach() - old)
    clipped_out = ((adv > 0) & (ratio > 1.1)) | ((adv < 0) & (ratio < 0.9))
    assert torch.all(new.grad[clipped_out] == 0) and torch.all(new.grad[mask == 0] == 0)


def test_ppo_on_policy_gradient_is_advantage_weighted_logprob_gradient():
    # At ρ = 1 the clipped surrogate's gradient equals −A·∇logπ / n (REINFORCE with a baseline).
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv = torch.tensor([[0.5, -2.0]])
    loss, _ = policy_loss("ppo_clip", logp, logp.detach(), adv, torch.ones(1, 2))
    loss.backward()
    assert torch.allclose(logp.grad, -adv / 2)


def test_normalizer_makes_split_batches_add_up():
    g = torch.Generator().manual_seed(2)
    new, old, adv = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.4).float()
    whole, _ = policy_loss("ppo_clip", new, old, adv, mask)
    n = mask.sum()
    parts = sum(policy_loss("ppo_clip", new[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], normalizer=n)[0] for i in (0, 2, 4))
    assert torch.allclose(whole, parts, atol=1e-6)


def test_empty_mask_is_zero_not_nan():
    loss, m = policy_loss("ppo_clip", torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert float(loss) == 0.0 and not any(math.isnan(float(v)) for v in m.values())


def test_kl_estimators_hand_computed():
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    # log_ratio = log(ref/p) = log 0.5
    assert torch.allclose(kl_penalty(logp, ref, "k1"), torch.tensor([math.log(2)]))
    assert torch.allclose(kl_penalty(logp, ref, "k2"), torch.tensor([0.5 * math.log(0.5) ** 2]))
    assert torch.allclose(kl_penalty(logp, ref, "k3"), torch.tensor([0.5 - math.log(0.5) - 1]))
    assert float(kl_penalty(ref, ref, "k3")) == 0.0


def test_k3_is_unbiased_estimate_of_kl():
    # E_{a~p}[k3] = KL(p‖q): check against the exact KL on a 3-way distribution.
    p, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.3, 0.3, 0.4])
    exact = float((p * (p / q).log()).sum())
    est = float((p * kl_penalty(p.log(), q.log(), "k3")).sum())
    assert math.isclose(est, exact, rel_tol=1e-5)
    assert torch.all(kl_penalty(torch.randn(100), torch.randn(100), "k3") >= 0)
    assert torch.isfinite(kl_penalty(torch.tensor([0.0]), torch.tensor([-1000.0]), "k3")).all()


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
    with pytest.raises(KeyError, match="valid: grpo"):
        algorithm("ppo2")
    with pytest.raises(KeyError, match="k1, k2, k3"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k9")
