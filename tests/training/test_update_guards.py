"""The update's guards: train/inference mismatch measured before the first step, truncated importance
sampling, and non-finite steps skipped without touching weights or optimizer state."""

import math

import pytest
import torch

from rlpipe.algorithms import AdvantageInput, compute_advantages
from rlpipe.config import TrainConfig
from rlpipe.storage.samples import Sample
from rlpipe.training.trainer import PolicyTrainer


def _trainer(model_dir, **cfg) -> PolicyTrainer:
    torch.set_num_threads(1)
    base = {"batch_size": 8, "micro_batch_size": 4, "lr": 1e-3}
    return PolicyTrainer(model_dir=str(model_dir), cfg=TrainConfig(**(base | cfg)), seed=0, max_new_tokens=4)


def _samples(trainer: PolicyTrainer, shift=lambda i, t: 0.0) -> list[Sample]:
    """8 samples in 2 groups whose sampling log-probs are the trainer's own plus ``shift(i, t)``."""
    prompts = [[5 + i, 6, 7] for i in range(8)]
    responses = [[10 + i, 11, 12][: 1 + i % 3] for i in range(8)]
    own = trainer.sequence_logprobs(prompts, responses)
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    return [Sample(p, r, [lp + shift(i, t) for t, lp in enumerate(own[i])], rewards[i], i // 4)
            for i, (p, r) in enumerate(zip(prompts, responses))]


@pytest.mark.parametrize("full_pass", [True, False])
def test_mismatch_is_measured_on_the_sampled_tokens_before_any_step(tiny_checkpoint, full_pass):
    # One optimizer step: its forward sees every token, so both ways measure all 15.
    trainer = _trainer(tiny_checkpoint, mismatch_full_pass=full_pass)
    # Sample 0's first token differs by 0.5, sample 3's by 0.05; 15 response tokens in all (1,2,3,1,2,3,1,2).
    shift = {(0, 0): 0.5, (3, 0): -0.05}
    m = trainer.update(_samples(trainer, lambda i, t: shift.get((i, t), 0.0)), 0)
    assert sum(1 + i % 3 for i in range(8)) == 15
    assert m["mismatch/abs_max"] == pytest.approx(0.5, abs=1e-5)
    assert m["mismatch/abs_mean"] == pytest.approx(0.55 / 15, abs=1e-5)
    assert m["mismatch/share_above"] == pytest.approx(1 / 15)  # threshold 0.1
    assert m["mismatch/kl"] == pytest.approx((0.5 - 0.05) / 15, abs=1e-5)
    # The old log-probs are the sampler's: the ratio of sample 0's first token starts at e^-0.5.
    assert m["ratio/min"] <= math.exp(-0.5) + 1e-3 and m["optimizer_steps"] == 1
    assert ("mismatch/tokens" in m) == (not full_pass)


def test_without_the_full_pass_the_first_step_measures_its_own_tokens(tiny_checkpoint):
    """Two optimizer steps of 4: the mismatch covers the first step's samples (the seeded shuffle's first 4),
    measured before any weight moved; the second step's shifted token is not seen."""
    import random

    order = list(range(8))
    random.Random(0 * 1_000_003 + 0).shuffle(order)  # PolicyTrainer._optimize's order: seed 0, iteration 0, epoch 0
    first, second = order[:4], order[4:]
    shift = {(first[0], 0): 0.5, (second[0], 0): 2.0}
    # shuffle 'samples': the order computed by hand above is that dealing's (test_sharing.py covers 'groups')
    trainer = _trainer(tiny_checkpoint, batch_size=4, micro_batch_size=2, shuffle="samples")
    m = trainer.update(_samples(trainer, lambda i, t: shift.get((i, t), 0.0)), 0)
    tokens = sum(1 + i % 3 for i in first)
    assert m["optimizer_steps"] == 2 and m["mismatch/tokens"] == tokens
    assert m["mismatch/abs_max"] == pytest.approx(0.5, abs=1e-5)  # not 2.0: that token is in the second step
    assert m["mismatch/abs_mean"] == pytest.approx(0.5 / tokens, abs=1e-5)
    assert m["mismatch/share_above"] == pytest.approx(1 / tokens)
    assert m["mismatch/kl"] == pytest.approx(0.5 / tokens, abs=1e-5)


def test_the_full_pass_changes_no_weight(tiny_checkpoint):
    """The pass before the first step only measures: with or without it, the same samples give the same weights."""
    after = []
    for full_pass in (True, False):
        trainer = _trainer(tiny_checkpoint, batch_size=4, mismatch_full_pass=full_pass)
        samples = _samples(trainer, lambda i, t: 0.1 * ((i + t) % 3))
        trainer.update(samples, 0)
        trainer.update(samples, 1)
        after.append({k: v.clone() for k, v in trainer.module.state_dict().items()})
    for k, v in after[0].items():
        assert torch.equal(v, after[1][k]), k


def test_truncated_importance_sampling_weights_each_token(tiny_checkpoint):
    cap = 2.0
    trainer = _trainer(tiny_checkpoint, tis_cap=cap)
    # Tokens of samples 0 and 2 were 3× less likely under the sampler: weight min(3, 2) = 2.
    samples = _samples(trainer, lambda i, t: -math.log(3.0) if i in (0, 2) else 0.0)
    m = trainer.update(samples, 0)
    weights = [[min(3.0, cap) if i in (0, 2) else 1.0] * len(s.response_ids) for i, s in enumerate(samples)]
    flat = [w for row in weights for w in row]
    assert m["tis/weight_mean"] == pytest.approx(sum(flat) / len(flat), abs=1e-5)
    assert m["tis/capped_share"] == pytest.approx(sum(w == cap for w in flat) / len(flat))
    # One step from the trainer's own log-probs (ratio 1): pg_loss = −Σ w·A / tokens.
    width = 3
    mask = torch.tensor([[1.0] * len(s.response_ids) + [0.0] * (width - len(s.response_ids)) for s in samples])
    adv = compute_advantages("grpo", AdvantageInput(torch.tensor([s.reward for s in samples]), torch.tensor([s.group for s in samples]),
                                                     torch.ones(8, dtype=torch.bool), mask)).advantages
    w = torch.tensor([row + [0.0] * (width - len(row)) for row in weights])
    assert m["pg_loss"] == pytest.approx(float(-(adv * w * mask).sum() / mask.sum()), abs=1e-5)


@pytest.mark.parametrize("zero", [0, 1])
def test_a_non_finite_step_is_skipped_and_leaves_no_trace(tiny_checkpoint, zero):
    a = _trainer(tiny_checkpoint, zero_stage=zero, batch_size=4)
    good = _samples(a)
    before = {k: v.clone() for k, v in a.module.state_dict().items()}
    nan = [Sample(s.prompt_ids, s.response_ids, [float("nan")] * len(s.response_ids), s.reward, s.group) for s in good]
    m = a.update(nan, 0)
    assert m["nonfinite_steps"] == 2 and m["optimizer_steps"] == 0 and "loss" not in m
    assert math.isnan(m["mismatch/abs_max"])  # the skipped first step's mismatch is kept: it says why
    for k, v in a.module.state_dict().items():
        assert torch.equal(v, before[k]), k  # weights untouched
    if zero > 0:
        return  # DeepSpeed's ZeRO optimizer skips the step itself; its internal state is its own business
    # The optimizer state is untouched too: the next update lands where a fresh trainer's does.
    a.update(good, 1)
    b = _trainer(tiny_checkpoint, zero_stage=zero, batch_size=4)
    b.update(good, 1)
    for (name, pa), (_, pb) in zip(a.module.named_parameters(), b.module.named_parameters()):
        assert torch.equal(pa, pb), name


def _hand_steps(model_dir, samples, order, step, clip, lr):
    """The update by hand, one sample per forward: token-mean PPO loss (ratio inside the clip range), the global
    gradient norm, gradients scaled by min(1, clip/(norm + 1e-6)), then torch's plain AdamW (betas 0.9, 0.99)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0, foreach=False)
    width = max(len(s.response_ids) for s in samples)
    mask = torch.tensor([[1.0] * len(s.response_ids) + [0.0] * (width - len(s.response_ids)) for s in samples])
    adv = compute_advantages("grpo", AdvantageInput(torch.tensor([s.reward for s in samples]), torch.tensor([s.group for s in samples]),
                                                     torch.ones(len(samples), dtype=torch.bool), mask)).advantages
    norms = []
    for start in range(0, len(order), step):
        idx = order[start : start + step]
        opt.zero_grad()
        terms = []
        for i in idx:
            s = samples[i]
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logp = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
            p, r = len(s.prompt_ids), len(s.response_ids)
            lp = logp[torch.arange(p - 1, p - 1 + r), ids[0, p:]]
            terms.append(-(adv[i, :r] * torch.exp(lp - torch.tensor(s.old_logprobs))).sum())
        loss = torch.stack(terms).sum() / sum(len(samples[i].response_ids) for i in idx)
        loss.backward()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
        norms.append(float(norm))
        coef = min(1.0, clip / (float(norm) + 1e-6))
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
        opt.step()
    return dict(model.named_parameters()), norms


def test_two_steps_equal_clipped_adamw_by_hand(tiny_checkpoint):
    """The trainer's update (DeepSpeed, fused AdamW, the trainer's own clipping, micro-batches laid out as the
    trainer chooses) lands where two hand-written steps land; and the clip matters: unclipped steps land elsewhere."""
    import random

    clip, lr = 0.01, 1e-3
    trainer = _trainer(tiny_checkpoint, batch_size=4, micro_batch_size=2, grad_clip=clip, lr=lr, shuffle="samples")
    samples = _samples(trainer)
    m = trainer.update(samples, 0)
    order = list(range(8))
    random.Random(0).shuffle(order)  # PolicyTrainer._optimize's order: seed 0, iteration 0, epoch 0
    want, norms = _hand_steps(tiny_checkpoint, samples, order, 4, clip, lr)
    assert m["optimizer_steps"] == 2 and m["clip_frac"] == 0.0  # ratios stayed inside the clip range
    assert min(norms) > 10 * clip  # both steps were clipped
    assert m["grad_norm"] == pytest.approx(sum(norms) / 2, rel=1e-4)
    unclipped, _ = _hand_steps(tiny_checkpoint, samples, order, 4, 1e9, lr)
    got = dict(trainer.module.named_parameters())
    worst = max(float((got[k] - want[k]).detach().abs().max()) for k in want)
    apart = max(float((unclipped[k] - want[k]).detach().abs().max()) for k in want)
    assert worst < 2e-6 and apart > 50 * worst, (worst, apart)


def test_steps_under_the_clip_equal_unclipped_adamw_by_hand(tiny_checkpoint):
    """Under the clip (the trainer's path that leaves the gradients as they are) the steps land where unclipped
    hand-written AdamW steps land, and clipped ones elsewhere."""
    import random

    clip, lr = 1e6, 1e-3
    trainer = _trainer(tiny_checkpoint, batch_size=4, micro_batch_size=2, grad_clip=clip, lr=lr, shuffle="samples")
    samples = _samples(trainer)
    trainer.update(samples, 0)
    order = list(range(8))
    random.Random(0).shuffle(order)
    want, norms = _hand_steps(tiny_checkpoint, samples, order, 4, clip, lr)
    assert max(norms) < clip / 10
    clipped, _ = _hand_steps(tiny_checkpoint, samples, order, 4, min(norms) / 10, lr)
    got = dict(trainer.module.named_parameters())
    worst = max(float((got[k] - want[k]).detach().abs().max()) for k in want)
    apart = max(float((clipped[k] - want[k]).detach().abs().max()) for k in want)
    # Unclipped, Adam's normalised step carries the summation-order noise of small gradients: 2.4e-6 measured
    assert worst < 5e-6 and apart > 100 * worst, (worst, apart)
