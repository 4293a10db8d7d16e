import math

import pytest
import torch

from rlpipe.algorithms import ADVANTAGES, AdvantageInput, compute_advantages, register_advantage


def batch(rewards, groups, valid=None, T=3):
    n = len(rewards)
    return AdvantageInput(
        rewards=torch.tensor(rewards, dtype=torch.float32),
        group_ids=torch.tensor(groups),
        valid=torch.tensor(valid if valid is not None else [True] * n),
        response_mask=torch.ones(n, T),
    )


def test_grpo_hand_computed():
    # Group 0: rewards 1,0,1,0 → mean 0.5, unbiased std √(1/3) → ±0.5·√3 = ±0.8660.
    # Group 1: all equal → 0. Group 2: valid rewards 1, 0 (middle one timed out) → ±0.5/√0.5 = ±0.7071.
    adv, m = compute_advantages(
        "grpo", batch([1, 0, 1, 0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 2, 2, 2],
                      valid=[True] * 6 + [True, False, True])
    )
    s = math.sqrt(3) / 2
    expected = [s, -s, s, -s, 0, 0, 1 / math.sqrt(2), 0, -1 / math.sqrt(2)]
    assert torch.allclose(adv[:, 0], torch.tensor(expected), atol=1e-5)
    assert torch.equal(adv[:, 0:1].expand(-1, 3), adv)  # same advantage on every response token
    assert m["groups"] == 3 and m["groups_with_signal"] == 2


def test_grpo_without_std_is_mean_centred():
    adv, _ = compute_advantages("grpo", batch([3.0, 1.0, 2.0], [7, 7, 7]), norm_by_std=False)
    assert torch.allclose(adv[:, 0], torch.tensor([1.0, -1.0, 0.0]))


def loop_reference(rewards, groups, valid, eps=1e-6):
    out = []
    for i, (r, g, v) in enumerate(zip(rewards, groups, valid)):
        peers = [rewards[j] for j in range(len(rewards)) if groups[j] == g and valid[j]]
        if not v or len(peers) < 2:
            out.append(0.0)
            continue
        mean = sum(peers) / len(peers)
        std = math.sqrt(sum((p - mean) ** 2 for p in peers) / (len(peers) - 1))
        out.append((r - mean) / (std + eps))
    return out


def test_grpo_matches_plain_loop_reference():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (64,), generator=g).float() + torch.rand(64, generator=g) * 0.1
    groups = torch.arange(64) // 8
    valid = torch.rand(64, generator=g) > 0.2
    adv, _ = compute_advantages("grpo", AdvantageInput(rewards, groups, valid, torch.ones(64, 2)))
    ref = loop_reference(rewards.tolist(), groups.tolist(), valid.tolist())
    assert torch.allclose(adv[:, 0], torch.tensor(ref, dtype=torch.float32), atol=1e-5)


@pytest.mark.parametrize(
    "rewards,groups,valid",
    [
        ([1.0, 1.0, 1.0, 1.0], [0, 0, 0, 0], None),  # all equal
        ([0.0], [0], None),  # single-sample group
        ([1.0, 0.0], [0, 0], [False, False]),  # nothing valid
        ([], [], []),  # empty batch
    ],
)
def test_grpo_edge_cases_give_zero_not_nan(rewards, groups, valid):
    b = AdvantageInput(torch.tensor(rewards), torch.tensor(groups, dtype=torch.long),
                       torch.tensor(valid if valid is not None else [True] * len(rewards), dtype=torch.bool),
                       torch.ones(len(rewards), 2))
    adv, m = compute_advantages("grpo", b)
    assert not torch.isnan(adv).any() and torch.all(adv == 0)
    assert all(not math.isnan(v) for v in m.values())


def test_masked_tokens_get_no_advantage():
    b = batch([1, 0], [0, 0])
    b.response_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv, _ = compute_advantages("grpo", b)
    assert adv[0, 2] == 0 and adv[1, 1] == 0 and adv[0, 0] > 0 > adv[1, 0]


def test_registry_rejects_duplicates_and_lists_names():
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda b: None)
    with pytest.raises(KeyError, match="valid: .*grpo"):
        ADVANTAGES.get("nope")
