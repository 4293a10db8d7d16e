"""train.pack_sequences: the policy's forward runs on sequences laid end to end in rows (no compute on
padding); the layout is exact, the losses and the update equal the padded ones up to float rounding, and a
model that would attend across packed sequences is refused at start."""

import pytest
import torch

from rlpipe.config import TrainConfig
from rlpipe.storage.samples import Sample
from rlpipe.training import packing as packing_mod
from rlpipe.training.packing import check_packing, collate, pack_rows
from rlpipe.training.trainer import PolicyTrainer


def test_layout_by_hand(monkeypatch):
    """Lengths 5, 2, 2 with rows of 6 (PACK_ROW lowered): 9 tokens → 2 rows; longest first into the least
    filled → [s0] and [s1 s2 + a 1-token tail], as wide as the fullest (5); every position that predicts a
    token of its own sequence maps to its padded place."""
    monkeypatch.setattr(packing_mod, "PACK_ROW", 6)
    p = pack_rows([[11, 12, 13, 14, 15], [21, 22], [31, 32]], width=5, pad_id=0)
    assert p.input_ids.tolist() == [[11, 12, 13, 14, 15], [21, 22, 31, 32, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 1, 0]]
    # packed (R, C-1 = 4) flat → padded (b, L-1 = 4) flat: s0 t0..3, s1 t0, s2 t0
    assert p.src.tolist() == [0, 1, 2, 3, 4, 6]
    assert p.dst.tolist() == [0, 1, 2, 3, 4, 8]


def test_unpack_places_each_position_and_passes_gradients(monkeypatch):
    """Lengths 5, 2, 3 → rows [s0] and [s2 s1]."""
    monkeypatch.setattr(packing_mod, "PACK_ROW", 6)
    samples = [Sample([11, 12], [13, 14, 15], [0.0] * 3, 0.0, 0), Sample([21], [22], [0.0], 0.0, 0),
               Sample([31, 32], [33], [0.0], 0.0, 0)]
    micro = collate(samples, {}, 0, pack=True)
    assert micro.packed.input_ids.tolist() == [[11, 12, 13, 14, 15], [31, 32, 33, 21, 22]]
    x = torch.arange(8, dtype=torch.float32).view(2, 4).requires_grad_(True)
    out = micro.unpack(x)
    assert out.tolist() == [[0, 1, 2, 3], [7, 0, 0, 0], [4, 5, 0, 0]]
    out.sum().backward()
    assert x.grad.tolist() == [[1, 1, 1, 1], [1, 1, 0, 1]]  # the position before s1 (s2's end) gets none
    # The packed targets at the kept positions are the padded targets.
    packed_targets = micro.unpack(micro.packed.input_ids[:, 1:].float())
    keep = micro.attention_mask[:, 1:].bool()
    assert torch.equal(packed_targets[keep], micro.targets[keep].float())


def _trainer(model_dir, **cfg) -> PolicyTrainer:
    torch.set_num_threads(1)
    base = {"batch_size": 8, "micro_batch_size": 4, "lr": 1e-3}
    return PolicyTrainer(model_dir=str(model_dir), cfg=TrainConfig(**(base | cfg)), seed=0, max_new_tokens=6)


def _samples() -> list[Sample]:
    """8 samples of very different lengths (prompts 2–9 tokens, responses 1–6), 2 groups."""
    out = []
    for i in range(8):
        prompt = [5 + (i * 3 + k) % 20 for k in range(2 + i)]
        response = [10 + (i + k) % 15 for k in range(1 + (i * 5) % 6)]
        out.append(Sample(prompt, response, [-1.0 - 0.1 * k for k in range(len(response))], float(i % 3 == 0), i // 4))
    return out


def test_packed_forward_equals_padded(tiny_checkpoint):
    t = _trainer(tiny_checkpoint)
    model = t.engine.module.eval()
    samples = _samples()
    with torch.no_grad():
        padded = collate(samples, {}, t.tokenizer.pad_token_id)
        packed = collate(samples, {}, t.tokenizer.pad_token_id, pack=True)
        lp_pad, ent_pad = t._forward(padded, model, entropy="stats")
        lp_pack, ent_pack = t._forward(packed, model, entropy="stats")
    keep = padded.resp.bool()
    assert packed.packed.input_ids.numel() < padded.input_ids.numel()  # fewer positions computed
    assert torch.allclose(lp_pack[keep], lp_pad[keep], atol=1e-5)
    assert torch.allclose(ent_pack[keep], ent_pad[keep], atol=1e-5) and float(ent_pad[keep].min()) > 0


def same_update_as_padded(model_dir, samples: list[Sample], preset: dict, **layout) -> None:
    """One update padded and one in ``layout`` (TrainConfig keys) from the same checkpoint and samples: the same
    losses and statistics (the reference's KL and the critic's where the preset has them) and weights, up to float
    rounding."""
    runs = []
    for cfg in ({"pack_sequences": False}, layout):
        t = _trainer(model_dir, **cfg, **preset)
        m = t.update(samples, 0)
        runs.append((m, {k: v.detach().clone() for k, v in t.engine.module.state_dict().items()}))
    (m0, w0), (m1, w1) = runs
    assert m0["optimizer_steps"] == m1["optimizer_steps"] == 1 and m0["tokens"] == m1["tokens"]
    keys = ["loss", "pg_loss", "entropy", "clip_frac", "mismatch/abs_mean", "grad_norm"]
    if "kl_coef" in preset:
        keys += ["kl", "kl_loss"]
    if preset.get("algorithm") == "ppo":  # the critic's pass before the first step and its loss, in the layout too
        keys += ["vf_loss", "value_mse", "explained_variance"]
    for key in keys:
        assert m1[key] == pytest.approx(m0[key], rel=1e-4, abs=1e-6), key
    # AdamW's first step moves each weight by about lr·sign(g) (lr 1e-3): a coordinate whose gradient is at
    # rounding level may move differently; the losses and the gradient norm above agree to 1e-4.
    moved = max(float((w1[k] - w0[k]).abs().max()) for k in w0)
    assert moved < 5e-5


@pytest.mark.parametrize("preset", [{"loss_agg_mode": "seq_mean_token_mean", "entropy_coef": 0.01},
                                    {"algorithm": "dapo"}, {"algorithm": "ppo", "critic": {"lr": 1e-3}}])
def test_an_update_packed_equals_padded(tiny_checkpoint, preset):
    """One optimizer step of two micro-batches: the same losses, statistics and weights (float rounding)."""
    same_update_as_padded(tiny_checkpoint, _samples(), preset, pack_sequences=True)


class Dropping(torch.nn.Module):
    """A model whose forward drops an input a packed layout relies on: ``"position_ids"`` (packed sequences would
    attend to each other) or ``"mask"``, a 4D attention mask (a response would attend to its neighbours)."""

    def __init__(self, inner, drop: str):
        super().__init__()
        self.inner, self.drop = inner, drop

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        if self.drop == "position_ids":
            position_ids = None
        elif attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = None
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache)


def test_a_model_that_mixes_packed_sequences_is_refused(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32)
    assert check_packing(model, "tiny") <= 1e-5
    with pytest.raises(ValueError, match="train.pack_sequences: false"):
        check_packing(Dropping(model, "position_ids"), "unpacked-model")


def test_a_micro_batch_moves_whole_to_the_engines_device(monkeypatch):
    """Every tensor of a micro-batch, its per-token inputs and its packed rows follow it to the device (the
    meta device stands in for a GPU here); on its own device it is returned as is."""
    monkeypatch.setattr(packing_mod, "PACK_ROW", 6)
    samples = [Sample([11, 12], [13, 14, 15], [0.0] * 3, 0.0, 0), Sample([21], [22], [0.0], 0.0, 0),
               Sample([31, 32], [33], [0.0], 0.0, 0)]
    micro = collate(samples, {"advantages": [[1.0] * 3, [1.0], [1.0]]}, 0, pack=True)
    assert micro.to(torch.device("cpu")) is micro
    moved = micro.to(torch.device("meta"))
    tensors = [moved.input_ids, moved.attention_mask, moved.targets, moved.mask, moved.action, *moved.tok.values(),
               moved.packed.input_ids, moved.packed.position_ids, moved.packed.src, moved.packed.dst]
    assert len(tensors) == 10 and all(t.device.type == "meta" for t in tensors)
    assert moved.packed.src.shape == micro.packed.src.shape and moved.tok["advantages"].shape == (3, 4)


def test_token_bins_by_hand():
    """First fit, longest first: packed bins cost the sum of lengths, padded ones rows × the longest; a sequence
    over the budget is a bin alone."""
    from rlpipe.training.packing import token_bins

    lengths, ids = [5, 9, 3, 4, 12, 2], ["a", "b", "c", "d", "e", "f"]
    assert token_bins(lengths, ids, 12, packed=True) == [["e"], ["b", "c"], ["a", "d", "f"]]
    # padded: b,a → 2×9 > 12, so a opens a bin; d joins a (2×5 ≤ 12); c: 3×5 > 12 → new bin with f
    assert token_bins(lengths, ids, 12, packed=False) == [["e"], ["b"], ["a", "d"], ["c", "f"]]
    assert token_bins([20, 3], ["x", "y"], 10, packed=True) == [["x"], ["y"]]
