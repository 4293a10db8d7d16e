"""Learning-rate warm-up (``train.warmup_steps``): the k-th optimizer step of a run uses lr × min(1, k/N),
for the policy and the critic, and a resumed run continues the schedule where it stopped."""

import pytest
import torch

from rlpipe.config import TrainConfig
from rlpipe.training.trainer import PolicyTrainer
from tests.helpers.dist_update import fixed_batch


def _trainer(model_dir, resume_dir=None, **cfg) -> PolicyTrainer:
    torch.set_num_threads(1)
    base = {"batch_size": 16, "micro_batch_size": 8, "lr": 1e-3, "warmup_steps": 4}
    return PolicyTrainer(model_dir=str(model_dir), cfg=TrainConfig(**(base | cfg)), seed=0,
                         resume_dir=resume_dir and str(resume_dir), max_new_tokens=5)


def _weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.module.named_parameters()}


def test_each_step_takes_its_share_of_the_learning_rate(tiny_checkpoint):
    t = _trainer(tiny_checkpoint)
    batch = fixed_batch(16)  # one optimizer step per update
    before = _weights(t)
    lrs = [t.update(batch, k)["lr"] for k in range(6)]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    # Adam's first step moves a weight by at most about its lr (exactly lr·sign(g) where g ≠ 0): with the
    # warm-up that is a quarter of 1e-3, where without it the first step would move weights by 1e-3.
    first = _trainer(tiny_checkpoint)
    start = _weights(first)
    first.update(batch, 0)
    moved = max(float((p.detach() - start[k]).abs().max()) for k, p in first.module.named_parameters())
    assert 2.4e-4 < moved <= 2.5e-4 * 1.001
    assert any(not torch.equal(before[k], p) for k, p in t.module.named_parameters())


def test_without_warmup_the_first_step_takes_the_whole_learning_rate(tiny_checkpoint):
    t = _trainer(tiny_checkpoint, warmup_steps=0)
    start = _weights(t)
    m = t.update(fixed_batch(16), 0)
    moved = max(float((p.detach() - start[k]).abs().max()) for k, p in t.module.named_parameters())
    assert m["lr"] == 1e-3 and 0.99e-3 < moved <= 1.001e-3


def test_the_critic_warms_up_with_its_own_learning_rate(tiny_checkpoint):
    t = _trainer(tiny_checkpoint, algorithm="ppo", critic={"lr": 2e-3})
    t.update(fixed_batch(16), 0)
    assert t.critic.optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 / 4)
    t.update(fixed_batch(16), 1)
    assert t.critic.optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 / 2)


def test_a_resumed_run_continues_the_schedule(tiny_checkpoint, tmp_path):
    batch = fixed_batch(16)
    a = _trainer(tiny_checkpoint)
    for k in range(2):
        a.update(batch, k)
    a.save(tmp_path / "state")
    m_a = a.update(batch, 2)
    b = _trainer(tiny_checkpoint, resume_dir=tmp_path / "state")
    m_b = b.update(batch, 2)
    assert m_a["lr"] == m_b["lr"] == pytest.approx(7.5e-4)  # step 3 of 4, not step 1 again
    for (name, pa_), (_, pb) in zip(a.module.named_parameters(), b.module.named_parameters()):
        assert torch.equal(pa_, pb), name
