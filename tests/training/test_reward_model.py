"""The reward-model trainer (DeepSpeed): it learns a preference, keeps its best validation weights, and a
saved model scores the same in the scorer."""

import json

import pytest
import torch

from rlpipe.config import RewardModelConfig
from rlpipe.training.reward_model import REWARD_STATS, RewardModelTrainer, RewardScorer, encode_response, pair_accuracy


def test_it_learns_the_preference_on_held_out_pairs(tiny_reward_model):
    folder, result, held_out = tiny_reward_model
    # The fresh head already ranks digits over letters by a hair (a gap of ~0.04); training makes it a
    # decision: a gap wider by at least 0.5 on 50 pairs it never saw, every one ranked right. (The kept
    # weights are those of the first perfect validation check, so the gap is that check's: 0.9-2.9
    # across runs.)
    assert abs(held_out["gap_before"]) < 0.5
    assert held_out["score_gap"] > held_out["gap_before"] + 0.5
    assert held_out["pair_accuracy"] == 1.0 and held_out["n"] == 50
    assert result.best_validation_accuracy == max(e["pair_accuracy"] for e in result.evals)
    stats = json.loads((folder / REWARD_STATS).read_text())
    assert stats["count"] == 1000 and stats["std"] > 0


def test_the_saved_model_scores_the_same_in_the_scorer(tiny_reward_model):
    folder, _, _ = tiny_reward_model
    scorer = RewardScorer(folder, version="t")
    good, bad = scorer.score_texts([("12+34=", "46", False), ("12+34=", "xq", False)])
    assert good > bad
    ids = encode_response(scorer.tokenizer, "12+34=", False, "46")
    assert scorer.score_ids([ids])[0] == pytest.approx(good, abs=1e-5)
    # Batched with a longer sequence (right padding) the score does not move: padding is never read.
    assert scorer.score_ids([ids, ids + ids])[0] == pytest.approx(good, abs=1e-5)


def test_early_stopping_keeps_the_best_weights(tiny_checkpoint):
    cfg = RewardModelConfig(steps=30, lr=1e-3, batch_size=8, micro_batch_size=8, eval_every=5, patience=2)
    trainer = RewardModelTrainer(tiny_checkpoint, cfg, seed=0)
    tok = trainer.tokenizer
    from rlpipe.training.reward_model import Pair

    enc = lambda c, r: Pair(encode_response(tok, "1+1=", False, c), encode_response(tok, "1+1=", False, r))  # noqa: E731
    train = [enc("2", "z")] * 16
    validation = [enc("z", "2")] * 4  # the opposite of training: validation gets worse as training works
    result = trainer.train(train, validation)
    assert result.stopped_early and result.steps < 30
    assert result.best_step == result.evals[0]["step"]
    assert trainer.evaluate(validation)["pair_accuracy"] == result.best_validation_accuracy  # the best weights are back


def test_batch_must_split_into_micro_batches(tiny_checkpoint):
    with pytest.raises(ValueError, match="micro_batch_size"):
        RewardModelConfig(batch_size=10, micro_batch_size=4)


def test_pair_accuracy_counts_ties_as_wrong():
    assert pair_accuracy([1.0, 0.0, 2.0], [0.0, 0.0, 3.0]) == pytest.approx(1 / 3)
    assert torch.tensor(pair_accuracy([], [])) == 0


def test_reward_model_on_a_hub_checkpoint_reads_chat_as_its_template_writes_it(standins, tmp_path):
    """The RM trunk is the Llama stand-in (no pad token, EOS a list, fp16): chat pairs with Chinese prompts are
    encoded as the template's assistant turn, the RM learns them, and the saved scorer scores the same."""
    import json as _json

    from rlpipe.config import RewardModelConfig
    from rlpipe.training.reward_model import RewardModelTrainer, RewardScorer, encode_pairs, encode_response

    rows = [{"prompt": _json.dumps([{"role": "user", "content": f"计算 {a}+{b}"}]), "chat": True,
             "chosen": str(a + b), "rejected": "不知道", "margin": None} for a in range(10, 30) for b in range(10, 20)]
    trainer = RewardModelTrainer(standins["llama"], RewardModelConfig(steps=20, lr=1e-3, batch_size=16, micro_batch_size=8,
                                                                      eval_every=10, patience=3), seed=0)
    tok = trainer.tokenizer
    ids = encode_response(tok, rows[0]["prompt"], True, "20")
    assert tok.decode(ids).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n20<|eot_id|>")
    pairs = encode_pairs(tok, rows)
    trainer.train(pairs[:160], pairs[160:180])
    held = trainer.evaluate(pairs[180:])
    assert held["pair_accuracy"] >= 0.9
    trainer.save(tmp_path / "rm", trainer.reward_stats(pairs[:160]))
    scorer = RewardScorer(tmp_path / "rm", version="t")
    good, bad = scorer.score_texts([(rows[190]["prompt"], rows[190]["chosen"], True), (rows[190]["prompt"], "不知道", True)])
    assert good > bad


# The Qwen2 stand-in (tied embeddings, bf16): the Llama one's trunk is the RM test above (~17 s each).
@pytest.mark.parametrize("arch", ["qwen2"])
def test_reward_model_with_lora_trains_adapters_and_head_and_saves_merged(standins, arch, tmp_path):
    """rm.lora: only the adapters and the new scalar head train; the trunk's weights stay; the saved folder is a
    plain HF reward model of the merged weights (the scorer scores as the trained module does), adapter beside."""
    import json as _json

    from safetensors.torch import load_file

    from rlpipe.config import RewardModelConfig
    from rlpipe.training.reward_model import RewardModelTrainer, RewardScorer, encode_pairs, score_all

    torch.manual_seed(0)
    rows = [{"prompt": _json.dumps([{"role": "user", "content": f"{a}+{b}"}]), "chat": True, "chosen": str(a + b),
             "rejected": "no idea", "margin": None} for a in range(10, 30) for b in range(10, 18)]
    cfg = RewardModelConfig(steps=20, lr=3e-3, batch_size=16, micro_batch_size=8, eval_every=10, patience=3,
                            lora={"r": 8, "alpha": 16})
    trainer = RewardModelTrainer(standins[arch], cfg, seed=0)
    trainable = {n for n, p in trainer.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or ".modules_to_save." in n for n in trainable)
    assert sum(p.numel() for n, p in trainer.module.named_parameters() if n in trainable) < 0.1 * sum(
        p.numel() for p in trainer.module.parameters())
    pairs = encode_pairs(trainer.tokenizer, rows)
    trainer.train(pairs[:128], pairs[128:144])
    assert trainer.evaluate(pairs[144:])["pair_accuracy"] >= 0.9
    trainer.save(tmp_path / "rm", trainer.reward_stats(pairs[:128]))
    assert (tmp_path / "rm" / "adapter" / "adapter_config.json").exists()
    assert not any("lora" in k for k in load_file(tmp_path / "rm" / "model.safetensors"))
    scorer = RewardScorer(tmp_path / "rm", version="t")
    seqs = [p.chosen for p in pairs[144:]]
    assert scorer.score_ids(seqs) == pytest.approx(score_all(trainer.module, seqs, trainer.tokenizer.pad_token_id), abs=1e-4)


def test_reward_model_lora_target_that_matches_nothing_is_refused(standins):
    from rlpipe.config import RewardModelConfig
    from rlpipe.training.reward_model import RewardModelTrainer

    with pytest.raises(ValueError, match=r"rm.lora.target_modules: \['qkv'\] match no linear module"):
        RewardModelTrainer(standins["qwen2"], RewardModelConfig(lora={"r": 4, "target_modules": ["qkv"]}))
