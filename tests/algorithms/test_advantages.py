"""Advantage estimators: hand-computed examples, plain-loop references, edge cases, properties.

The references below are written per sample / per token from the papers' formulas and never call
the implementation's helpers.
"""

import math

import pytest
import torch

from rlpipe.algorithms import ADVANTAGES, AdvantageInput, AdvantageOutput, compute_advantages, register_advantage

ALL = ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"]
GROUP = ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"]


def batch(rewards, groups, valid=None, T=3, mask=None, penalty=None, values=None):
    n = len(rewards)
    return AdvantageInput(
        rewards=torch.tensor(rewards, dtype=torch.float64),
        group_ids=torch.tensor(groups, dtype=torch.long),
        valid=torch.tensor(valid if valid is not None else [True] * n, dtype=torch.bool),
        response_mask=torch.ones(n, T) if mask is None else torch.tensor(mask, dtype=torch.float32),
        token_penalty=None if penalty is None else torch.tensor(penalty, dtype=torch.float64),
        values=None if values is None else torch.tensor(values, dtype=torch.float64),
    )


def random_batch(seed, n=24, T=7, n_groups=6, penalty=True, holes=True):
    """Random rewards/groups/validity, ragged masks (with holes), token penalty and values."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (n,), generator=g).double() + torch.rand(n, generator=g, dtype=torch.float64) * 0.3
    groups = torch.randint(0, n_groups, (n,), generator=g)
    valid = torch.rand(n, generator=g) > 0.2
    rewards = torch.where(valid, rewards, torch.full_like(rewards, float("nan")))  # an invalid reward is garbage
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    if holes:  # e.g. tool output inside an agent turn: not a response token, but the response goes on
        mask = mask * (torch.rand(n, T, generator=g) > 0.15).float()
        mask[:, 0] = 1.0
    pen = torch.rand(n, T, generator=g, dtype=torch.float64) * 0.05 if penalty else None
    values = torch.randn(n, T, generator=g, dtype=torch.float64) * 0.5
    return AdvantageInput(rewards, groups, valid, mask, pen, values)


def as_lists(b):
    n, T = b.response_mask.shape
    pen = b.token_penalty.tolist() if b.token_penalty is not None else [[0.0] * T for _ in range(n)]
    vals = b.values.tolist() if b.values is not None else [[0.0] * T for _ in range(n)]
    return b.rewards.tolist(), b.group_ids.tolist(), b.valid.tolist(), b.response_mask.tolist(), pen, vals


def whiten_reference(table, valid, mask, eps=1e-8):
    toks = [table[i][t] for i in range(len(table)) for t in range(len(table[i])) if valid[i] and mask[i][t]]
    if not toks:
        return [[0.0] * len(row) for row in table]
    mean = sum(toks) / len(toks)
    std = math.sqrt(sum((x - mean) ** 2 for x in toks) / max(len(toks) - 1, 1))
    return [[(table[i][t] - mean) / (std + eps) if valid[i] and mask[i][t] else 0.0 for t in range(len(table[i]))]
            for i in range(len(table))]


# --------------------------------------------------------------------------------------- grpo family


def test_grpo_hand_computed():
    # Group 0: rewards 1,0,1,0 → mean 0.5, unbiased std √(1/3) → ±0.5·√3 = ±0.8660.
    # Group 1: all equal → 0. Group 2: valid rewards 1, 0 (middle one timed out) → ±0.5/√0.5 = ±0.7071.
    out = compute_advantages(
        "grpo", batch([1, 0, 1, 0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 2, 2, 2],
                      valid=[True] * 6 + [True, False, True])
    )
    assert isinstance(out, AdvantageOutput) and out.returns is None
    adv, m = out.advantages, out.metrics
    s = math.sqrt(3) / 2
    expected = [s, -s, s, -s, 0, 0, 1 / math.sqrt(2), 0, -1 / math.sqrt(2)]
    assert adv.dtype == torch.float32 and adv.shape == (9, 3)
    assert torch.allclose(adv[:, 0], torch.tensor(expected), atol=1e-5)
    assert torch.equal(adv[:, 0:1].expand(-1, 3), adv)  # same advantage on every response token
    assert m["groups"] == 3 and m["groups_with_signal"] == 2


def test_grpo_without_std_is_mean_centred():
    adv = compute_advantages("grpo", batch([3.0, 1.0, 2.0], [7, 7, 7]), norm_by_std=False).advantages
    assert torch.allclose(adv[:, 0], torch.tensor([1.0, -1.0, 0.0]))


def test_dr_grpo_hand_computed():
    # Group 7: 3,1,2 → mean 2 → 1,−1,0 (its std is 1, so it cannot tell a std division apart);
    # group 8: 0,4 → mean 2 → −2,+2 with no std division (GRPO would give ∓2/(2√2 + ε) = ∓0.7071);
    # group 9: one sample → no baseline → 0.
    adv = compute_advantages("dr_grpo", batch([3, 1, 2, 0, 4, 5], [7, 7, 7, 8, 8, 9])).advantages
    assert torch.allclose(adv[:, 0], torch.tensor([1.0, -1.0, 0.0, -2.0, 2.0, 0.0]), atol=1e-6)
    assert torch.equal(adv[:, 0:1].expand(-1, 3), adv)


def test_rloo_hand_computed():
    # Group [1,0,0,1]: A_i = r_i − mean of the other three: 1 − 1/3 = 2/3, 0 − 2/3 = −2/3.
    # Group [5, NaN(invalid), 2]: the invalid one is no peer → 5 − 2 = 3, 2 − 5 = −3, invalid → 0.
    b = batch([1, 0, 0, 1, 5, float("nan"), 2], [0, 0, 0, 0, 1, 1, 1], valid=[True] * 5 + [False, True])
    adv = compute_advantages("rloo", b).advantages
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 3.0, 0.0, -3.0]
    assert torch.allclose(adv[:, 0], torch.tensor(expected), atol=1e-6)
    assert torch.isfinite(adv).all()


def group_reference(name, rewards, groups, valid, mask, pen, eps=1e-6):
    """Per-sample loop: sequence reward = r − Σ_t penalty_t over response tokens; then the group formula."""
    n = len(rewards)
    seq = [rewards[i] - sum(p for p, m in zip(pen[i], mask[i]) if m) for i in range(n)]
    out = []
    for i in range(n):
        peers = [seq[j] for j in range(n) if groups[j] == groups[i] and valid[j]]
        if not valid[i] or len(peers) < 2:
            out.append(0.0)
            continue
        mean = sum(peers) / len(peers)
        if name == "grpo":
            std = math.sqrt(sum((p - mean) ** 2 for p in peers) / (len(peers) - 1))
            a = (seq[i] - mean) / (std + eps)
        elif name == "dr_grpo":
            a = seq[i] - mean
        else:  # rloo: baseline is the mean of the *other* valid members
            a = seq[i] - (sum(peers) - seq[i]) / (len(peers) - 1)
        out.append(a)
    return [[out[i] if mask[i][t] else 0.0 for t in range(len(mask[i]))] for i in range(n)]


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_estimators_match_plain_loop_reference(name):
    b = random_batch(seed=10)
    adv = compute_advantages(name, b).advantages
    rewards, groups, valid, mask, pen, _ = as_lists(b)
    ref = torch.tensor(group_reference(name, rewards, groups, valid, mask, pen), dtype=torch.float32)
    assert torch.allclose(adv, ref, atol=1e-5)
    assert (ref != 0).sum() > 20  # the random batch really has signal


# ---------------------------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_hand_computed():
    # γ = 0.5. Row 0: outcome 1, penalty 0.1,0.2,0.3 → token rewards −0.1, −0.2, 0.7
    #   G2 = 0.7, G1 = −0.2 + 0.5·0.7 = 0.15, G0 = −0.1 + 0.5·0.15 = −0.025.
    # Row 1: outcome 0, mask 1,1,0, penalty 0.1,0.1,(5 off the response) → −0.1, −0.1
    #   G1 = −0.1, G0 = −0.1 + 0.5·(−0.1) = −0.15.
    # Whiten the 5 response tokens: mean 0.575/5 = 0.115; Σ dev² = 0.4795 → std = √(0.4795/4).
    b = batch([1.0, 0.0], [0, 0], mask=[[1, 1, 1], [1, 1, 0]], penalty=[[0.1, 0.2, 0.3], [0.1, 0.1, 5.0]])
    adv = compute_advantages("reinforce_pp", b, gamma=0.5).advantages
    std = math.sqrt(0.4795 / 4)
    G = [[-0.025, 0.15, 0.7], [-0.15, -0.1, None]]
    expected = [[(g - 0.115) / std if g is not None else 0.0 for g in row] for row in G]
    assert torch.allclose(adv, torch.tensor(expected, dtype=torch.float32), atol=1e-5)


def test_reinforce_pp_baseline_hand_computed():
    # Group 0 [1,0,0,1]: centred outcomes ±0.5 → every token's return ±0.5 (γ = 1, no penalty).
    # Group 1 [2,2]: centred 0 → returns 0 (an all-equal group carries no signal).
    # Whiten 12 tokens: mean 0, unbiased var = 8·0.25/11 = 2/11 → ±0.5/√(2/11) = ±1.1726, 0 for group 1.
    b = batch([1, 0, 0, 1, 2, 2], [0, 0, 0, 0, 1, 1], T=2)
    adv = compute_advantages("reinforce_pp_baseline", b).advantages
    a = 0.5 / math.sqrt(2 / 11)
    expected = torch.tensor([a, -a, -a, a, 0.0, 0.0]).unsqueeze(-1).expand(-1, 2)
    assert torch.allclose(adv, expected, atol=1e-5)
    # Without the baseline the whitening is over returns 1,0,0,1,2,2 — a different answer.
    plain = compute_advantages("reinforce_pp", b).advantages
    assert not torch.allclose(plain, expected, atol=1e-2)


def reinforce_pp_reference(rewards, groups, valid, mask, pen, gamma, baseline):
    n, T = len(mask), len(mask[0])
    outcome = list(rewards)
    if baseline:
        for i in range(n):
            peers = [rewards[j] for j in range(n) if groups[j] == groups[i] and valid[j]]
            outcome[i] = rewards[i] - sum(peers) / len(peers) if valid[i] else 0.0
    G = [[0.0] * T for _ in range(n)]
    for i in range(n):
        if not valid[i]:
            continue
        pos = [t for t in range(T) if mask[i][t]]
        running = 0.0
        for k, t in enumerate(reversed(pos)):  # holes are skipped: G_t = r_t + γ·G_{next response token}
            r_t = -pen[i][t] + (outcome[i] if k == 0 else 0.0)
            running = r_t + gamma * running
            G[i][t] = running
    return whiten_reference(G, valid, mask)


@pytest.mark.parametrize("name,gamma", [("reinforce_pp", 0.9), ("reinforce_pp_baseline", 1.0)])
def test_reinforce_pp_matches_plain_loop_reference(name, gamma):
    b = random_batch(seed=11)
    adv = compute_advantages(name, b, gamma=gamma).advantages
    rewards, groups, valid, mask, pen, _ = as_lists(b)
    ref = reinforce_pp_reference(rewards, groups, valid, mask, pen, gamma, baseline=name.endswith("baseline"))
    assert torch.allclose(adv, torch.tensor(ref, dtype=torch.float32), atol=1e-5)


# ------------------------------------------------------------------------------------------- GAE


def test_gae_with_unit_gamma_lambda_and_zero_values_is_the_return():
    # γ = λ = 1, V ≡ 0: A_t = Σ_{k≥t} r_k. Row 0: rewards −0.1, −0.2, −0.3 + 1 → 0.4, 0.5, 0.7.
    # Row 1 (2 tokens, outcome 2, no penalty on its tokens): 2, 2.
    b = batch([1.0, 2.0], [0, 1], mask=[[1, 1, 1], [1, 1, 0]], penalty=[[0.1, 0.2, 0.3], [0.0, 0.0, 0.0]],
              values=[[0.0] * 3] * 2)
    out = compute_advantages("gae", b, gamma=1.0, lam=1.0, whiten=False)
    expected = torch.tensor([[0.4, 0.5, 0.7], [2.0, 2.0, 0.0]])
    assert torch.allclose(out.advantages, expected, atol=1e-6)
    assert torch.allclose(out.returns, expected, atol=1e-6)


def test_gae_three_tokens_hand_computed():
    # γ = 0.9, λ = 0.8, V = 0.5, 0.4, 0.6, reward 1 on the last token (V after it is 0):
    # δ2 = 1 + 0 − 0.6 = 0.4; δ1 = 0 + 0.9·0.6 − 0.4 = 0.14; δ0 = 0 + 0.9·0.4 − 0.5 = −0.14
    # γλ = 0.72: A2 = 0.4; A1 = 0.14 + 0.72·0.4 = 0.428; A0 = −0.14 + 0.72·0.428 = 0.16816
    # returns = A + V = 0.66816, 0.828, 1.0
    b = batch([1.0], [0], values=[[0.5, 0.4, 0.6]])
    # Options the estimator does not declare (norm_by_std) are dropped by compute_advantages.
    out = compute_advantages("gae", b, gamma=0.9, lam=0.8, whiten=False, norm_by_std=False)
    assert torch.allclose(out.advantages, torch.tensor([[0.16816, 0.428, 0.4]]), atol=1e-6)
    assert torch.allclose(out.returns, torch.tensor([[0.66816, 0.828, 1.0]]), atol=1e-6)
    # Whitened: mean 0.33205, unbiased std over 3 tokens; returns are not whitened.
    w = compute_advantages("gae", b, gamma=0.9, lam=0.8).advantages
    xs = [0.16816, 0.428, 0.4]
    mu = sum(xs) / 3
    sd = math.sqrt(sum((x - mu) ** 2 for x in xs) / 2)
    assert torch.allclose(w, torch.tensor([[(x - mu) / sd for x in xs]]), atol=1e-5)


def gae_reference(rewards, valid, mask, pen, values, gamma, lam):
    n, T = len(mask), len(mask[0])
    A = [[0.0] * T for _ in range(n)]
    R = [[0.0] * T for _ in range(n)]
    for i in range(n):
        if not valid[i]:
            continue
        pos = [t for t in range(T) if mask[i][t]]
        running = 0.0
        for k in reversed(range(len(pos))):
            t = pos[k]
            r = -pen[i][t] + (rewards[i] if k == len(pos) - 1 else 0.0)
            v_next = values[i][pos[k + 1]] if k + 1 < len(pos) else 0.0
            delta = r + gamma * v_next - values[i][t]
            running = delta + gamma * lam * running
            A[i][t] = running
            R[i][t] = running + values[i][t]
    return A, R


@pytest.mark.parametrize("whiten", [False, True])
def test_gae_matches_plain_loop_reference(whiten):
    b = random_batch(seed=12)
    out = compute_advantages("gae", b, gamma=0.95, lam=0.7, whiten=whiten)
    rewards, _, valid, mask, pen, values = as_lists(b)
    A, R = gae_reference(rewards, valid, mask, pen, values, 0.95, 0.7)
    if whiten:
        A = whiten_reference(A, valid, mask)
    assert torch.allclose(out.advantages, torch.tensor(A, dtype=torch.float32), atol=1e-5)
    assert torch.allclose(out.returns, torch.tensor(R, dtype=torch.float32), atol=1e-5)


def test_gae_needs_values():
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", batch([1.0], [0]))


# ------------------------------------------------------------------------------------ edge cases


def _values_for(b):
    n, T = b.response_mask.shape
    return torch.linspace(-0.5, 0.5, n * T, dtype=torch.float64).reshape(n, T)


@pytest.mark.parametrize(
    "rewards,groups,valid",
    [
        ([1.0, 1.0, 1.0, 1.0], [0, 0, 0, 0], None),  # all equal
        ([0.0, 1.0, 3.0], [0, 1, 2], None),  # single-sample groups
        ([1.0, float("nan")], [0, 0], [True, False]),  # one valid member left
        ([float("nan"), float("nan")], [0, 0], [False, False]),  # nothing valid
        ([], [], []),  # empty batch
    ],
)
def test_group_estimators_give_zero_not_nan_without_signal(rewards, groups, valid):
    b = AdvantageInput(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups, dtype=torch.long),
                       torch.tensor(valid if valid is not None else [True] * len(rewards), dtype=torch.bool),
                       torch.ones(len(rewards), 2))
    for name in GROUP:
        out = compute_advantages(name, b)
        assert out.advantages.shape == (len(rewards), 2), name
        assert torch.all(out.advantages == 0), (name, out.advantages)
        assert all(math.isfinite(v) for v in out.metrics.values()), (name, out.metrics)
        assert out.metrics["groups_with_signal"] == 0, name


@pytest.mark.parametrize("name", ALL)
def test_invalid_rows_get_zero_and_do_not_change_the_others(name):
    base = random_batch(seed=13, n=12, penalty=True)
    base.valid[:] = True
    base.rewards = torch.nan_to_num(base.rewards, nan=0.25)
    base.values = _values_for(base)
    # Interleave 5 invalid rows (NaN reward, NaN-free garbage elsewhere) into existing groups.
    g = torch.Generator().manual_seed(99)
    k, T = 5, base.response_mask.shape[1]
    idx_bad = torch.tensor([0, 3, 7, 11, 14])
    n = 12 + k
    is_bad = torch.zeros(n, dtype=torch.bool)
    is_bad[idx_bad] = True

    def merge(good, bad):
        out = torch.empty((n, *good.shape[1:]), dtype=good.dtype)
        out[~is_bad], out[is_bad] = good, bad
        return out

    big = AdvantageInput(
        rewards=merge(base.rewards, torch.full((k,), float("nan"), dtype=torch.float64)),
        group_ids=merge(base.group_ids, base.group_ids[:k]),
        valid=merge(base.valid, torch.zeros(k, dtype=torch.bool)),
        response_mask=merge(base.response_mask, torch.ones(k, T)),
        token_penalty=merge(base.token_penalty, torch.rand(k, T, generator=g, dtype=torch.float64) * 9),
        values=merge(base.values, torch.randn(k, T, generator=g, dtype=torch.float64) * 9),
    )
    small_out = compute_advantages(name, base, gamma=0.9, lam=0.9)
    big_out = compute_advantages(name, big, gamma=0.9, lam=0.9)
    assert torch.isfinite(big_out.advantages).all()
    assert torch.all(big_out.advantages[is_bad] == 0)
    assert torch.allclose(big_out.advantages[~is_bad], small_out.advantages, atol=1e-6)
    assert small_out.advantages.abs().sum() > 1  # there is something to change
    if name == "gae":
        assert torch.isfinite(big_out.returns).all() and torch.all(big_out.returns[is_bad] == 0)
        assert torch.allclose(big_out.returns[~is_bad], small_out.returns, atol=1e-6)
    assert all(math.isfinite(v) for v in big_out.metrics.values())


@pytest.mark.parametrize("name", ALL)
def test_zero_length_responses_and_fully_masked_batches(name):
    b = random_batch(seed=14, n=10)
    b.values = _values_for(b)
    # Row 2 and a valid row of group 0 have no response tokens (e.g. the model emitted EOS at once).
    b.response_mask[2] = 0
    b.valid[2] = True
    b.rewards[2] = 1.0
    out = compute_advantages(name, b, gamma=0.9)
    assert torch.isfinite(out.advantages).all() and torch.all(out.advantages[2] == 0)
    assert torch.all(out.advantages[b.response_mask == 0] == 0)
    assert all(math.isfinite(v) for v in out.metrics.values())
    if name in ("reinforce_pp", "gae"):  # no tokens → no part in the batch whitening
        drop = torch.arange(10) != 2
        sub = AdvantageInput(b.rewards[drop], b.group_ids[drop], b.valid[drop], b.response_mask[drop],
                             b.token_penalty[drop], b.values[drop])
        assert torch.allclose(compute_advantages(name, sub, gamma=0.9).advantages, out.advantages[drop], atol=1e-6)
    # The whole batch masked out: everything 0, nothing NaN.
    b.response_mask.zero_()
    out = compute_advantages(name, b)
    assert torch.all(out.advantages == 0)
    if out.returns is not None:
        assert torch.all(out.returns == 0)
    assert all(math.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("name", ALL)
def test_batch_with_no_response_columns(name):
    # Every response empty and the aligned tensors (N, 0): nothing to train on, but no crash and no NaN.
    b = AdvantageInput(torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0, 0]),
                       torch.tensor([True, True]), torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.float64),
                       torch.zeros(2, 0, dtype=torch.float64))
    out = compute_advantages(name, b)
    assert out.advantages.shape == (2, 0)
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_masked_tokens_get_no_advantage():
    b = batch([1, 0], [0, 0], mask=[[1, 1, 0], [1, 0, 0]])
    adv = compute_advantages("grpo", b).advantages
    assert adv[0, 2] == 0 and adv[1, 1] == 0 and adv[1, 2] == 0 and adv[0, 0] > 0 > adv[1, 0]


# ---------------------------------------------------------------------- KL in the reward (penalty)


def test_token_penalty_enters_grpo_as_the_summed_penalty():
    # Both rewards 1; penalties sum to 0.3 and 0.1 on the response (the 9.0 is off it):
    # sequence rewards 0.7, 0.9 → mean 0.8, std √0.02 → ∓0.1/(0.141421 + 1e-6) on every token.
    b = batch([1.0, 1.0], [0, 0], mask=[[1, 1, 1], [1, 1, 0]], penalty=[[0.1, 0.1, 0.1], [0.05, 0.05, 9.0]])
    adv = compute_advantages("grpo", b).advantages
    a = 0.1 / (math.sqrt(0.02) + 1e-6)
    assert torch.allclose(adv, torch.tensor([[-a, -a, -a], [a, a, 0.0]]), atol=1e-5)
    # Only the sum matters: moving penalty between tokens of a row changes nothing.
    b2 = batch([1.0, 1.0], [0, 0], mask=[[1, 1, 1], [1, 1, 0]], penalty=[[0.3, 0.0, 0.0], [0.0, 0.1, 0.0]])
    assert torch.allclose(compute_advantages("grpo", b2).advantages, adv, atol=1e-6)
    # Without the penalty the group is all-equal → 0.
    assert torch.all(compute_advantages("grpo", batch([1.0, 1.0], [0, 0])).advantages == 0)


def test_token_penalty_enters_reinforce_pp_per_token():
    # γ = 1, one row of 3 tokens, outcome 0 plus a second row with outcome 1 and no penalty.
    # Row 0 penalty 0.3 on token 0 → returns −0.3, 0, 0; penalty 0.3 on token 2 → −0.3, −0.3, −0.3.
    # Same summed penalty, different per-token returns → different advantages (GRPO could not tell them apart).
    early = batch([0.0, 1.0], [0, 0], penalty=[[0.3, 0.0, 0.0], [0.0, 0.0, 0.0]])
    late = batch([0.0, 1.0], [0, 0], penalty=[[0.0, 0.0, 0.3], [0.0, 0.0, 0.0]])
    a_early = compute_advantages("reinforce_pp", early).advantages
    a_late = compute_advantages("reinforce_pp", late).advantages
    # early: returns −0.3, 0, 0, 1, 1, 1 → mean 0.45, Σdev² = 0.5625 + 2·0.2025 + 3·0.3025 = 1.875, std √0.375
    s = math.sqrt(1.875 / 5)
    exp_early = [[(-0.3 - 0.45) / s, -0.45 / s, -0.45 / s], [0.55 / s] * 3]
    assert torch.allclose(a_early, torch.tensor(exp_early), atol=1e-5)
    assert torch.allclose(a_late[0], a_late[0, :1].expand(3), atol=1e-6)  # −0.3 on every token
    assert not torch.allclose(a_early[0], a_late[0], atol=1e-3)
    assert torch.allclose(compute_advantages("grpo", early).advantages, compute_advantages("grpo", late).advantages)


# ------------------------------------------------------------------------------------- registry


def test_compute_advantages_passes_only_declared_options():
    b = batch([1, 0, 0, 1], [0, 0, 0, 0])
    # rloo declares no options: foreign ones are dropped, not an error.
    adv = compute_advantages("rloo", b, gamma=0.5, lam=0.1, norm_by_std=False, whiten=True).advantages
    assert torch.allclose(adv[:, 0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]), atol=1e-6)
    # grpo does declare norm_by_std: it is honoured (mean-centred ±0.5 instead of ±0.866).
    adv = compute_advantages("grpo", b, norm_by_std=False, gamma=0.5).advantages
    assert torch.allclose(adv[:, 0], torch.tensor([0.5, -0.5, -0.5, 0.5]), atol=1e-6)


def test_registry_rejects_duplicates_and_lists_names():
    assert set(ALL) <= set(ADVANTAGES.names())
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda b: None)
    with pytest.raises(KeyError, match="valid: .*grpo"):
        ADVANTAGES.get("nope")


@pytest.mark.parametrize("value", [0.7, 0.1, 1e-3, 123.456])
def test_all_equal_float64_group_is_exactly_zero(value):
    # The group mean of equal values can carry a rounding error; the advantage must still be exactly 0.
    b = AdvantageInput(torch.tensor([value] * 3, dtype=torch.float64), torch.zeros(3, dtype=torch.long),
                       torch.ones(3, dtype=torch.bool), torch.ones(3, 2))
    for name in ("grpo", "dr_grpo", "rloo"):
        out = compute_advantages(name, b)
        assert torch.all(out.advantages == 0) and out.metrics["groups_with_signal"] == 0, name
