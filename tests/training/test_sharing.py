"""train.share_prompts: samples of a micro-batch with the same prompt share one copy of it in the packed rows
(each response attends to the prompt and to itself). The layout is exact, the forward and an update equal the
padded ones up to float rounding, a model that ignores the attention mask is refused, and the key needs packing."""

import math

import pytest
import torch

from rlpipe.config import TrainConfig
from rlpipe.storage.samples import Sample
from rlpipe.training import packing as packing_mod
from rlpipe.training.packing import check_packing, collate, pack_shared, prompt_units
from rlpipe.training.trainer import PolicyTrainer
from tests.training.test_packing import Dropping, _trainer, same_update_as_padded


def _three() -> list[Sample]:
    return [Sample([11, 12], [13, 14], [0.0] * 2, 0.0, 0), Sample([21], [22, 23], [0.0] * 2, 0.0, 1),
            Sample([11, 12], [15], [0.0], 0.0, 0)]


def test_layout_by_hand():
    """Prompt [11 12] twice, [21] once → one row: 11 12 | 13 14 | 15 | 21 | 22 23. The second response's
    positions continue the prompt's (2, not 4); each response sees its prompt and itself only; both first
    response tokens are predicted at the shared prompt's last position (flat index 1 of the row's C-1 = 7)."""
    samples = _three()
    units = prompt_units(samples)
    assert units == [([11, 12], [0, 2]), ([21], [1])]
    p = pack_shared(samples, units, width=4, pad_id=0)
    assert p.input_ids.tolist() == [[11, 12, 13, 14, 15, 21, 22, 23]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2]]
    # padded (3 samples × L-1 = 3): sample 0's tokens at 1, 2; sample 1's at 3, 4; sample 2's at 7
    assert p.src.tolist() == [1, 2, 1, 5, 6]
    assert p.dst.tolist() == [1, 2, 7, 3, 4]
    assert p.attention_mask.int()[0, 0].tolist() == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0],  # 15 sees the prompt and itself, not 13 14
        [0, 0, 0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1, 1, 1],
    ]


def test_a_full_unit_starts_another_copy_of_its_prompt(monkeypatch):
    """SHARE_UNIT 6: prompt (2) + 2 + 2 tokens fill a unit; the third response opens a second unit of the same
    prompt. Rows are SHARE_UNIT wide, a row's tail attends only to itself (no empty softmax row)."""
    monkeypatch.setattr(packing_mod, "SHARE_UNIT", 6)
    samples = [Sample([11, 12], [13 + k, 14 + k], [0.0] * 2, 0.0, 0) for k in range(3)]
    units = prompt_units(samples)
    assert units == [([11, 12], [0, 1]), ([11, 12], [2])]
    p = pack_shared(samples, units, width=4, pad_id=0)
    assert p.input_ids.tolist() == [[11, 12, 13, 14, 14, 15], [11, 12, 15, 16, 0, 0]]
    mask = p.attention_mask[1, 0]
    assert mask[4].tolist() == [False, False, False, False, True, False]
    assert bool(p.attention_mask.any(-1).all())


def test_collate_shares_only_where_it_saves():
    """GRPO-like groups share (even where every sequence has the same length); all-distinct prompts fall back
    to plain packing (no mask); share=False never shares."""
    groups = [Sample([5 + k // 4, 6, 7, 8], [9 + k % 3], [0.0], 0.0, k // 4) for k in range(8)]
    micro = collate(groups, {}, 0, pack=True, share=True)
    assert micro.packed.attention_mask is not None
    assert micro.packed.input_ids.ne(0).sum() == 2 * 4 + 8  # two prompts once each + 8 response tokens
    distinct = [Sample([5 + k, 6, 7], [9] * (1 + k % 4), [0.0] * (1 + k % 4), 0.0, k) for k in range(8)]
    assert collate(distinct, {}, 0, pack=True, share=True).packed.attention_mask is None
    assert collate(groups, {}, 0, pack=True, share=False).packed is None  # equal lengths: no padding to pack away


def _groups() -> list[Sample]:
    """2 prompts × 4 responses of 1–6 tokens (as GRPO samples them), old log-probs, rewards, and the shuffle's
    micro-batches mix the groups."""
    out = []
    for i in range(8):
        g = i // 4
        prompt = [5 + (g * 7 + k) % 20 for k in range(6 + 4 * g)]
        response = [10 + (i + k) % 15 for k in range(1 + (i * 5) % 6)]
        out.append(Sample(prompt, response, [-1.0 - 0.1 * k for k in range(len(response))], float(i % 3 == 0), g))
    return out


def test_shared_forward_equals_padded(tiny_checkpoint):
    t = _trainer(tiny_checkpoint)
    model = t.engine.module.eval()
    samples = _groups()
    with torch.no_grad():
        padded = collate(samples, {}, t.tokenizer.pad_token_id)
        shared = collate(samples, {}, t.tokenizer.pad_token_id, pack=True, share=True)
        lp_pad, ent_pad = t._forward(padded, model, entropy="stats")
        lp_sh, ent_sh = t._forward(shared, model, entropy="stats")
    assert shared.packed.attention_mask is not None
    assert shared.packed.input_ids.numel() < collate(samples, {}, 0, pack=True).packed.input_ids.numel()
    keep = padded.mask.bool()
    assert torch.allclose(lp_sh[keep], lp_pad[keep], atol=1e-5)
    assert not torch.equal(lp_sh[keep], torch.zeros_like(lp_sh[keep]))
    assert torch.allclose(ent_sh[keep], ent_pad[keep], atol=1e-5) and float(ent_pad[keep].min()) > 0


@pytest.mark.parametrize("preset", [{"loss_agg_mode": "seq_mean_token_mean", "entropy_coef": 0.01},
                                    {"algorithm": "dapo", "kl_coef": 0.05},
                                    {"algorithm": "ppo", "critic": {"lr": 1e-3}}])
def test_an_update_shared_equals_padded(tiny_checkpoint, preset, monkeypatch):
    """One optimizer step over two micro-batches of mixed groups: the same losses, statistics (the reference's
    KL and the critic's pass before the step included) and weights as padded."""
    monkeypatch.setattr(packing_mod, "PACK_MIN_SAVING", 0.0)  # share wherever a prompt repeats
    shared = []
    real = packing_mod.pack_shared
    monkeypatch.setattr(packing_mod, "pack_shared", lambda *a: shared.append(a[1]) or real(*a))
    same_update_as_padded(tiny_checkpoint, _groups(), preset, pack_sequences=True, share_prompts=True)
    assert len(shared) >= 2 and all(any(len(members) > 1 for _, members in units) for units in shared)


def test_a_model_that_ignores_the_mask_is_refused(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32)
    assert check_packing(model, "tiny", share=True) <= 1e-5
    assert check_packing(Dropping(model, "mask"), "no-mask") <= 1e-5  # plain packing needs no mask
    with pytest.raises(ValueError, match="train.share_prompts: false"):
        check_packing(Dropping(model, "mask"), "no-mask", share=True)


def test_sharing_needs_packing():
    assert TrainConfig(pack_sequences=False).share_prompts  # the default is harmless without packing
    with pytest.raises(ValueError, match="share_prompts needs train.pack_sequences"):
        TrainConfig(pack_sequences=False, share_prompts=True)


def test_the_mask_moves_with_the_micro_batch():
    micro = collate(_three(), {}, 0, pack=True, share=True)
    assert micro.packed.attention_mask is not None
    moved = micro.to(torch.device("meta"))
    assert moved.packed.attention_mask.device.type == "meta"
    assert moved.packed.attention_mask.shape == micro.packed.attention_mask.shape


def _order(shuffle: str, samples: list[Sample], seed: int) -> list[int]:
    from types import SimpleNamespace

    return PolicyTrainer._order(SimpleNamespace(cfg=TrainConfig(shuffle=shuffle), seed=seed), samples, 0, 0)


def test_shuffle_groups_deals_whole_groups():
    """3 groups × 4 (interleaved on arrival): 'groups' yields each group's samples together, the groups in a
    seeded order; 'samples' (the default) a permutation that mixes them. Both repeat for the same seed."""
    samples = [Sample([1], [2], [0.0], 0.0, i % 3) for i in range(12)]
    by_group = _order("groups", samples, 7)
    assert sorted(by_group) == list(range(12))
    blocks = [{samples[i].group for i in by_group[k : k + 4]} for k in range(0, 12, 4)]
    assert all(len(b) == 1 for b in blocks) and {g for b in blocks for g in b} == {0, 1, 2}
    assert _order("groups", samples, 7) == by_group
    assert len({tuple(_order("groups", samples, s)) for s in range(20)}) > 1  # the order of groups is shuffled
    mixed = _order("samples", samples, 7)
    assert sorted(mixed) == list(range(12)) and mixed == _order("samples", samples, 7)
    assert any(len({samples[i].group for i in mixed[k : k + 4]}) > 1 for k in range(0, 12, 4))


def test_an_update_by_groups_shares_each_prompt_once(tiny_checkpoint, monkeypatch):
    """With train.shuffle 'groups' the two micro-batches are the two groups: one unit of 4 responses each."""
    seen = []
    real = packing_mod.pack_shared
    monkeypatch.setattr(packing_mod, "pack_shared", lambda *a: seen.append(a[1]) or real(*a))
    t = _trainer(tiny_checkpoint, shuffle="groups")
    seen.clear()  # the start's check of the layout
    m = t.update(_groups(), 0)
    assert m["optimizer_steps"] == 1 and math.isfinite(m["loss"])
    assert [[len(members) for _, members in units] for units in seen] == [[4], [4]]
