import math

import pytest
import torch

from rlpipe.config import ModelConfig, SFTConfig
from rlpipe.data import build_arithmetic
from rlpipe.training.sft import IGNORE, collate, encode_example, evaluate_accuracy, sft_loss, train_sft
from rlpipe.training.tiny import build_char_tokenizer, build_tiny_model


def test_prompt_tokens_carry_no_labels():
    tok = build_char_tokenizer()
    ids, labels = encode_example(tok, "12+34=", "46")
    assert len(ids) == 6 + 2 + 1 and ids[-1] == tok.eos_token_id
    assert labels[:6] == [IGNORE] * 6 and labels[6:] == ids[6:]


def test_loss_hand_computed():
    # Position t predicts the label at t+1. Labels at positions 1 and 2 are scored by the
    # uniform logits of positions 0 and 1 (V=4): CE = ln 4 each, mean ln 4.
    V = 4
    logits = torch.zeros(1, 4, V)
    logits[0, 2, 1] = 10.0  # position 2 is confident in token 1
    labels = torch.tensor([[IGNORE, 3, 1, IGNORE]])
    loss, m = sft_loss(logits, labels)
    assert m["tokens"] == 2
    assert math.isclose(float(loss), math.log(4), rel_tol=1e-6)
    # Only the label at position 3 (=1), scored by position 2: CE = log(1 + 3 e^-10).
    labels = torch.tensor([[IGNORE, IGNORE, IGNORE, 1]])
    loss, m = sft_loss(logits, labels)
    assert m["tokens"] == 1 and math.isclose(float(loss), math.log(1 + 3 * math.exp(-10)), abs_tol=1e-6)


def test_prompt_positions_get_no_gradient():
    tok = build_char_tokenizer()
    batch = collate([encode_example(tok, "12+34=", "46"), encode_example(tok, "1+2=", "3")], tok.pad_token_id)
    logits = torch.randn(*batch["input_ids"].shape, len(tok), requires_grad=True)
    loss, _ = sft_loss(logits, batch["labels"])
    loss.backward()
    grad_per_pos = logits.grad.abs().sum(-1)
    # Position t carries loss for label t+1: prompt positions before the last prompt token and
    # all padding get exactly zero gradient.
    assert torch.all(grad_per_pos[0, :5] == 0) and torch.all(grad_per_pos[0, 5:8] > 0)
    assert torch.all(grad_per_pos[1, :3] == 0) and torch.all(grad_per_pos[1, 3:5] > 0) and torch.all(grad_per_pos[1, 5:] == 0)


def test_loss_matches_plain_loop_reference():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11)
    labels = torch.randint(0, 11, (3, 7))
    labels[torch.rand(3, 7) < 0.4] = IGNORE
    labels[:, 1] = 5  # at least some labelled
    loss, _ = sft_loss(logits, labels)
    total, n = 0.0, 0
    for b in range(3):
        for t in range(6):
            y = int(labels[b, t + 1])
            if y != IGNORE:
                total += -float(torch.log_softmax(logits[b, t], -1)[y])
                n += 1
    assert math.isclose(float(loss), total / n, rel_tol=1e-5)


def test_all_ignored_is_zero_not_nan():
    loss, m = sft_loss(torch.randn(2, 3, 5, requires_grad=True), torch.full((2, 3), IGNORE))
    assert float(loss.detach()) == 0.0 and m["tokens"] == 0


def test_short_sft_lowers_loss_and_is_deterministic():
    tok = build_char_tokenizer()
    rows = [r for r in build_arithmetic().to_pylist() if r["split"] == "train"][:512]
    cfg = SFTConfig(steps=30, batch_size=32, lr=2e-3, warmup_steps=5, stop_at_accuracy=None)
    small = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    runs = []
    for _ in range(2):
        model = build_tiny_model(small, tok, seed=0)
        res = train_sft(model, tok, rows, cfg, seed=0)
        runs.append(res)
    assert runs[0].history[-1]["loss"] < runs[0].history[0]["loss"] * 0.6
    assert [h["loss"] for h in runs[0].history] == [h["loss"] for h in runs[1].history]
    ev = evaluate_accuracy(model, tok, rows[:16], max_new_tokens=4)
    assert ev["n"] == 16 and 0.0 <= ev["accuracy"] <= 1.0


def test_a_demonstrated_episode_trains_on_the_policys_tokens_only():
    from rlpipe.envs import EnvSpec
    from rlpipe.envs.experts import demonstrate
    from rlpipe.rollout.multiturn import encode_episode
    from rlpipe.training.sft import IGNORE, episode_example
    from rlpipe.training.tiny import build_char_tokenizer

    assert episode_example([7, 8], [1, 2, 3, 4], [1, 0, 0, 1]) == ([7, 8, 1, 2, 3, 4], [IGNORE, IGNORE, 1, IGNORE, IGNORE, 4])
    tok = build_char_tokenizer()
    r = encode_episode(tok, demonstrate(EnvSpec(env="calculator"), {"expression": "12*34"}, 0), chat=True)
    ids, labels = episode_example(r.prompt_ids, r.response_ids, r.loss_mask)
    assert tok.decode([t for t in labels if t != IGNORE]) == "calc(12*34)<|im_end|>answer(408)<|im_end|>"
    assert len(ids) == len(labels) and "=408" in tok.decode(ids)  # the tool's answer is context, not a target


@pytest.mark.parametrize("arch,end", [("qwen2", "<|im_end|>"), ("llama", "<|eot_id|>")])
def test_chat_sft_loss_is_on_the_assistant_turn_and_its_end_token_only(standins, arch, end):
    import json

    from rlpipe.tokens import load_tokenizer
    from rlpipe.training.sft import encode_row

    tok = load_tokenizer(standins[arch])
    msgs = [{"role": "system", "content": "你是助手。"}, {"role": "user", "content": "12+34=?"},
            {"role": "assistant", "content": "<tool_call>calc</tool_call>"}, {"role": "tool", "content": "46"}]
    ids, labels = encode_row(tok, {"prompt": json.dumps(msgs), "chat": True, "solution": "答案是 46", "ground_truth": "46"})
    trained = [t for t, lab in zip(ids, labels) if lab != IGNORE]
    assert tok.decode(trained) == "答案是 46" + end
    assert trained[-1] == tok.convert_tokens_to_ids(end) and labels[-1] == ids[-1]
    full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "答案是 46"}], tokenize=False)
    assert full.startswith(tok.decode(ids))  # the same text the template writes, up to its end token
    assert "<tool_call>calc</tool_call>" in tok.decode(ids[: labels.index(next(lab for lab in labels if lab != IGNORE))])


@pytest.mark.parametrize("extra", [{"micro_batch_size": 2}, {"micro_batch_size": 4, "gradient_checkpointing": True}])
def test_accumulated_micro_batches_give_the_one_pass_update(extra):
    """Examples of unequal length: the accumulated step normalises by the batch's tokens, as one pass does."""
    from rlpipe.training.sft import train_sft_examples
    from rlpipe.training.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    examples = [encode_example(tok, f"{a}+{b}=", str(a + b) * (1 + a % 3)) for a, b in [(12, 3), (7, 45), (99, 1), (5, 5),
                                                                                    (23, 17), (8, 80), (61, 2), (4, 40)]]
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    models = [build_tiny_model(cfg, tok, seed=0) for _ in range(2)]
    base = SFTConfig(steps=2, batch_size=8, lr=1e-2, warmup_steps=0, stop_at_accuracy=None)
    a = train_sft_examples(models[0], tok, examples, base, seed=0)
    b = train_sft_examples(models[1], tok, examples, base.model_copy(update=extra), seed=0)
    assert a.history[0]["loss"] == pytest.approx(b.history[0]["loss"], rel=1e-5)
    for (name, p), (_, q) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.allclose(p, q, atol=1e-5), name


def _chat_examples(tok, n=12):
    import json

    from rlpipe.training.sft import encode_row

    rows = [{"prompt": json.dumps([{"role": "user", "content": f"{a}+{b}=?" + "请" * (a % 5)}]), "chat": True,
             "solution": f"{a + b}", "ground_truth": str(a + b)} for a, b in [(i * 7 % 90, i * 13 % 50) for i in range(n)]]
    return [encode_row(tok, r) for r in rows]


def test_packed_sft_and_bf16_on_a_hub_checkpoint(standins):
    """On the llama stand-in (fp16 weights, no pad token): packed micro-batches give the padded update;
    bf16 autocast trains (float32 master weights) to nearly the same loss."""
    from transformers import AutoModelForCausalLM

    from rlpipe.tokens import load_tokenizer
    from rlpipe.training.sft import train_sft_examples

    torch.set_num_threads(1)
    tok = load_tokenizer(standins["llama"])
    examples = _chat_examples(tok)
    base = SFTConfig(steps=2, batch_size=12, micro_batch_size=6, lr=1e-3, warmup_steps=0, stop_at_accuracy=None)
    runs = {}
    for name, extra in {"padded": {}, "packed": {"pack_sequences": True}, "bf16": {"precision": "bf16"}}.items():
        model = AutoModelForCausalLM.from_pretrained(standins["llama"], dtype=torch.float32)
        runs[name] = (model, train_sft_examples(model, tok, examples, base.model_copy(update=extra), seed=0))
    (pm, pr), (km, kr), (bm, br) = runs["padded"], runs["packed"], runs["bf16"]
    assert kr.history[0]["loss"] == pytest.approx(pr.history[0]["loss"], rel=1e-5)
    gap = max(float((p - q).abs().max()) for p, q in zip(pm.parameters(), km.parameters()))
    assert gap < 5e-5  # two Adam steps of 1e-3 each: rounding, which Adam magnifies on tiny gradients (1.1e-5 seen)
    assert kr.history[1]["loss"] == pytest.approx(pr.history[1]["loss"], rel=1e-4)
    assert next(bm.parameters()).dtype == torch.float32
    assert br.history[0]["loss"] == pytest.approx(pr.history[0]["loss"], rel=2e-2)


def test_sft_on_two_ranks_gives_the_one_rank_update(standins):
    """sft.nproc 2 (two DeepSpeed ranks, each every other example of the batch): the weights of one rank, up to
    float rounding; rank 0's logged points reach the caller's log."""
    from transformers import AutoModelForCausalLM

    from rlpipe.tokens import load_tokenizer
    from rlpipe.training.sft import train_sft_examples
    from rlpipe.training.sft_ranks import train_sft_ranks

    torch.set_num_threads(1)
    tok = load_tokenizer(standins["qwen2"])
    examples = _chat_examples(tok)
    cfg = SFTConfig(steps=4, batch_size=12, micro_batch_size=3, lr=1e-3, warmup_steps=2, stop_at_accuracy=None)
    one = AutoModelForCausalLM.from_pretrained(standins["qwen2"], dtype=torch.float32)
    a = train_sft_examples(one, tok, examples, cfg, seed=0)
    two = AutoModelForCausalLM.from_pretrained(standins["qwen2"], dtype=torch.float32)
    points = []
    b = train_sft_ranks(two, tok, examples, cfg.model_copy(update={"nproc": 2}), seed=0,
                        log=lambda step, m: points.append((step, m)))
    assert [p["loss"] for p in b.history] == pytest.approx([p["loss"] for p in a.history], rel=1e-5)
    assert points and points[-1][0] == 4 and points[-1][1]["loss"] == pytest.approx(a.history[-1]["loss"], rel=1e-5)
    moved = max(float((p - q).abs().max()) for p, q in zip(one.parameters(), AutoModelForCausalLM.from_pretrained(standins["qwen2"]).parameters()))
    assert moved > 1e-3
    for (name, p), (_, q) in zip(one.named_parameters(), two.named_parameters()):
        assert torch.allclose(p, q, atol=2e-5), name


def test_micro_batch_must_divide_the_batch():
    with pytest.raises(ValueError, match="does not divide sft.batch_size 8"):
        SFTConfig(batch_size=8, micro_batch_size=3)
