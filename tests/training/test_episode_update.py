"""Training on multi-turn episodes: only the policy's tokens get loss.

The episodes are real (the HF engine in the calculator environment); their rewards are set by the test
so that the advantages are not all zero — what is under test is where the gradient goes."""

import pytest
import torch

from rlpipe.config import TrainConfig
from rlpipe.envs import EnvLimits, EnvSpec
from rlpipe.rollout.base import SamplingConfig
from rlpipe.rollout.multiturn import run_episodes


@pytest.fixture
def episodes(tiny_checkpoint):
    from rlpipe.rollout.hf_engine import HFEngine

    engine = HFEngine(tiny_checkpoint)
    spec = EnvSpec(env="calculator", params={"digits": 2}, limits=EnvLimits(max_steps=3))
    out = run_episodes(engine, engine.tokenizer, spec, [({}, s // 2) for s in range(8)],
                       SamplingConfig(temperature=1.0, max_new_tokens=6, seed=0), chat=True)
    samples = [r.sample(group=i // 2) for i, r in enumerate(out)]
    for i, s in enumerate(samples):
        s.reward = float(i % 2)  # one success and one failure per group: every advantage is ±1
    assert any(0 in s.loss_mask for s in samples)  # episodes with observations inside the response
    return samples


def _capture(model):
    """Record (input_ids, d loss / d final hidden states) of every forward pass that builds a graph: the final norm's
    output at position t feeds only the output layer's logits at t (those predicting token t+1), so its gradient
    there is zero exactly where those logits got none (the output layer computes none at a prompt's positions)."""
    seen, ids = [], {}

    def pre(_, args, kwargs):
        ids["now"] = kwargs["input_ids"]

    def post(_, __, out):
        if out.requires_grad:
            batch = ids["now"]
            out.register_hook(lambda g: seen.append((batch, g.detach().clone())))

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.model.norm.register_forward_hook(post)
    return seen


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_the_gradient_reaches_policy_tokens_only(tiny_checkpoint, episodes, algorithm):
    """GRPO on outcome rewards; PPO (critic, GAE) with per-step rewards on each action's last token."""
    from rlpipe.storage.samples import step_reward_tokens
    from rlpipe.training.trainer import PolicyTrainer

    torch.set_num_threads(1)
    cfg = TrainConfig(algorithm=algorithm, batch_size=8, micro_batch_size=4, lr=1e-3, kl_coef=0.1, entropy_coef=0.01)
    trainer = PolicyTrainer(model_dir=str(tiny_checkpoint), cfg=cfg, seed=0, max_new_tokens=6)
    if algorithm == "ppo":
        for s in episodes:
            runs = sum(1 for j, m in enumerate(s.loss_mask) if m and (j + 1 == len(s.loss_mask) or not s.loss_mask[j + 1]))
            s.step_rewards = step_reward_tokens(s.loss_mask, [s.reward / runs] * runs)
    seen = _capture(trainer.engine.module)
    m = trainer.update(episodes, 0)
    assert m["optimizer_steps"] == 1 and len(seen) == 2  # two micro-batches of 4
    if algorithm == "ppo":
        assert m["vf_loss"] == m["vf_loss"] and "explained_variance" in m
    masked = trained = 0
    for batch, grad in seen:
        for row, g in zip(batch.tolist(), grad):
            s = next(s for s in episodes if row[: len(s.prompt_ids) + len(s.response_ids)] == s.prompt_ids + s.response_ids)
            p = len(s.prompt_ids)
            for j, keep in enumerate(s.loss_mask):  # logits at p-1+j predict response token j
                norm = float(g[p - 1 + j].abs().max())
                if keep:
                    trained += norm > 0
                else:
                    assert norm == 0.0, f"observation token {j} got gradient {norm}"
                    masked += 1
            assert float(g[: p - 1].abs().max()) == 0.0  # nor does the prompt
    assert masked > 0 and trained > 0


def test_an_episode_that_ended_in_error_is_left_out(episodes):
    from rlpipe.envs import Episode
    from rlpipe.envs.calculator import Calculator, CalculatorParams
    from rlpipe.rollout.multiturn import EpisodeRollout

    ep = Episode(Calculator(CalculatorParams()), {"expression": "nope"}, 0, EnvLimits())
    ep.start()
    s = EpisodeRollout([], ep).sample(group=0)
    assert ep.status == "error" and s.reward is None and not s.valid
