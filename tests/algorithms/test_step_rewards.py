"""Per-step rewards of episodes: each step's reward sits on the last token of its own action, the
token-level estimators credit it there (hand-computed), and outcome estimators see only the total."""

import pytest
import torch

from rlpipe.algorithms.advantages import AdvantageInput, compute_advantages
from rlpipe.config import load_config
from rlpipe.storage.samples import step_reward_tokens

# Response of an episode: action 1 (3 tokens), observation (2), action 2 (2 tokens), observation (1), action 3 (1).
MASK = [1, 1, 1, 0, 0, 1, 1, 0, 1]
STEPS = [0.25, -0.5, 1.0]


def test_step_rewards_land_on_each_actions_last_token():
    assert step_reward_tokens(MASK, STEPS) == [0, 0, 0.25, 0, 0, 0, -0.5, 0, 1.0]
    with pytest.raises(ValueError, match="3 action"):
        step_reward_tokens(MASK, [1.0])


def _batch(step_rewards: bool) -> AdvantageInput:
    return AdvantageInput(
        rewards=torch.tensor([sum(STEPS)]), group_ids=torch.tensor([0]), valid=torch.tensor([True]),
        response_mask=torch.tensor([MASK], dtype=torch.float32),
        step_rewards=torch.tensor([step_reward_tokens(MASK, STEPS)]) if step_rewards else None,
        values=torch.zeros(1, len(MASK)))


def test_token_rewards_keep_the_total_and_move_it_to_the_steps():
    per_step = _batch(True).token_rewards()[0].tolist()
    outcome = _batch(False).token_rewards()[0].tolist()
    assert per_step == [0, 0, 0.25, 0, 0, 0, -0.5, 0, 1.0]
    assert outcome == [0, 0, 0, 0, 0, 0, 0, 0, 0.75]
    assert sum(per_step) == sum(outcome) == 0.75


def test_gae_credits_each_action_with_the_rewards_from_it_on():
    """γ = λ = 1, V = 0: the advantage of a token is the sum of the rewards at and after it (holes skipped)."""
    adv = compute_advantages("gae", _batch(True), gamma=1.0, lam=1.0, whiten=False).advantages[0].tolist()
    want = [0.75, 0.75, 0.75, 0, 0, 0.5, 0.5, 0, 1.0]
    assert adv == pytest.approx(want)
    flat = compute_advantages("gae", _batch(False), gamma=1.0, lam=1.0, whiten=False).advantages[0].tolist()
    assert flat == pytest.approx([0.75 if m else 0 for m in MASK])  # outcome only: every action gets the total
    half = compute_advantages("gae", _batch(True), gamma=0.5, lam=1.0, whiten=False).advantages[0].tolist()
    # Discounting counts policy tokens only: from action 2's first token, -0.5 is 1 token away, 1.0 is 2 away.
    assert half[5] == pytest.approx(0.5 * -0.5 + 0.25 * 1.0)


def test_outcome_estimators_see_the_total_only():
    a = compute_advantages("grpo", AdvantageInput(torch.tensor([0.75, 0.25]), torch.tensor([0, 0]), torch.tensor([True, True]),
                                                  torch.ones(2, 3))).advantages
    assert a[0, 0] > 0 > a[1, 0]


def test_step_rewards_need_a_token_level_estimator():
    from rlpipe.cli import AGENT_DEMO
    from rlpipe.config import ConfigError

    with pytest.raises(ConfigError, match="agent.step_rewards"):
        load_config(None, AGENT_DEMO + ["agent.step_rewards=true"])  # grpo
    cfg = load_config(None, AGENT_DEMO + ["agent.step_rewards=true", "train.algorithm=ppo"])
    assert cfg.train.resolved()["advantage"] == "gae"
