"""The output layer computes logits only where a response token is predicted (``logits_at``): the log-probs, the
entropy and the gradient equal those of the full logits, on both hub stand-ins (tied and untied output layers),
padded, packed and with shared prompts, under LoRA and bf16 autocast; a prompt's positions get no logits."""

import threading

import pytest
import torch

from rlpipe.algorithms.functional import entropy_from_logits, token_logprobs
from rlpipe.config import TrainConfig
from rlpipe.storage.samples import Sample
from rlpipe.training.head import check_chunked_head
from rlpipe.training.packing import collate, logits_at
from rlpipe.training.trainer import PolicyTrainer

LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _trainer(folder, **train):
    cfg = TrainConfig(**({"algorithm": "grpo", "batch_size": 8, "micro_batch_size": 8, "lr": 1e-3} | train))
    return PolicyTrainer(model_dir=str(folder), cfg=cfg, seed=3, max_new_tokens=6)


def _samples() -> list[Sample]:
    """Two groups with prompts of 9 and 5 tokens, responses of 1–6 tokens; one response has an environment's
    tokens inside it (action mask 0: predicted, not trained)."""
    out = []
    for i in range(6):
        g = i // 3
        prompt = [5 + (g * 7 + k) % 40 for k in range(9 - 4 * g)]
        response = [50 + (i * 3 + k) % 30 for k in range(1 + (i * 5) % 6)]
        s = Sample(prompt, response, [-1.0 - 0.1 * k for k in range(len(response))], float(i % 2), g)
        if len(response) >= 4:
            s.loss_mask = [1, 0, 0] + [1] * (len(response) - 3)
        out.append(s)
    return out


def _full(model, micro, autocast):
    """Log-probs and entropy from the model's own full logits, padded: what ``_forward`` computed before."""
    with autocast:
        full = model(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits[:, :-1]
    return token_logprobs(full, micro.targets) * micro.resp, entropy_from_logits(full) * micro.resp


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("layout,lora,precision,chunk", [
    ("padded", False, "fp32", None), ("packed", False, "fp32", None), ("shared", False, "fp32", None),
    ("padded", True, "fp32", None), ("shared", False, "bf16", None),
    ("padded", False, "fp32", 5), ("shared", False, "fp32", 7), ("packed", True, "fp32", 4), ("shared", False, "bf16", 6)])
def test_logits_at_response_positions_change_no_log_prob_entropy_or_gradient(arch, layout, lora, precision, chunk,
                                                                              standins):
    """And in chunks of ``chunk`` positions (train.logits_chunk, the backward recomputing each): the same."""
    torch.manual_seed(0)
    t = _trainer(standins[arch], precision=precision, logits_chunk=chunk, **({"lora": LORA} if lora else {}))
    model = t.engine.module.train()
    samples = _samples()
    micro = collate(samples, {}, t.tokenizer.pad_token_id or 0, pack=layout != "padded", share=layout == "shared")
    assert (micro.packed is not None) == (layout != "padded")
    lp_ref, ent_ref = _full(model, micro, t._autocast())
    g_ref = _grads(model, lp_ref.sum() + 0.1 * ent_ref.sum())
    shapes = []
    hook = t.engine.module.get_output_embeddings().register_forward_hook(lambda m, i, o: shapes.append(o.shape[:-1].numel()))
    lp, ent = t._forward(micro, model, entropy="train")
    hook.remove()
    g = _grads(model, lp.sum() + 0.1 * ent.sum())
    responses = sum(len(s.response_ids) for s in samples)
    assert responses == int(micro.resp.sum()) and micro.input_ids.numel() > 2 * responses
    if chunk is None:  # logits of the response's positions only: none at a prompt's
        assert shapes == [responses]
    else:  # the model's own call computes none; then the chunks, at most ``chunk`` positions each
        assert shapes[0] == 0 and sum(shapes[1:]) == responses and max(shapes) == chunk
    tol = 1e-5 if precision == "fp32" else 3e-2
    assert torch.allclose(lp, lp_ref, atol=tol) and torch.allclose(ent, ent_ref, atol=tol)
    assert float(lp.abs().sum()) > 1.0  # not all zeros
    assert sorted(g) == sorted(g_ref) and g
    for n in g:
        scale = float(g_ref[n].abs().max()) + 1e-12
        assert float((g[n] - g_ref[n]).abs().max()) <= (2e-4 if precision == "fp32" else 5e-2) * scale, n


def test_logits_at_takes_only_the_calling_threads_forward(standins):
    """The trainer's probe may run on a thread of its own: a forward there computes every position's logits."""
    t = _trainer(standins["qwen2"])
    model = t.engine.module.eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    seen = {}
    with torch.no_grad(), logits_at(model, torch.tensor([1, 3])):
        other = threading.Thread(target=lambda: seen.update(shape=tuple(model(input_ids=ids).logits.shape[:2])))
        other.start()
        other.join()
        here = model(input_ids=ids).logits
    assert seen["shape"] == (1, 5) and here.shape[:2] == (1, 2)
    with torch.no_grad():
        full = model(input_ids=ids).logits
    assert torch.allclose(here[0], full[0, [1, 3]], atol=1e-5)


def test_a_model_that_bypasses_its_output_layer_is_refused(standins, monkeypatch):
    t = _trainer(standins["llama"])
    model = t.engine.module
    monkeypatch.setattr(type(model), "get_output_embeddings", lambda self: torch.nn.Linear(2, 2))
    micro = collate(_samples(), {}, 0)
    with pytest.raises(RuntimeError, match="get_output_embeddings"):
        t._forward(micro, model)


def test_a_model_that_scales_its_logits_after_the_output_layer_cannot_chunk(standins, monkeypatch):
    """train.logits_chunk computes logits as the output layer's alone: a model that changes them after it (a logit
    scale, a soft cap) is refused at start, naming the fix."""
    t = _trainer(standins["qwen2"])
    model = t.engine.module
    assert check_chunked_head(model, "the stand-in") <= 1e-4
    forward = type(model).forward

    def scaled(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out.logits = out.logits * 0.5
        return out

    monkeypatch.setattr(type(model), "forward", scaled)
    with pytest.raises(ValueError, match="train.logits_chunk: null"):
        check_chunked_head(model, "the stand-in")


@pytest.mark.parametrize("chunk", [None, 4])
def test_chunks_keep_no_logits_for_the_backward(standins, chunk):
    """Chunked, nothing as wide as the vocabulary is kept for the backward (it recomputes each chunk's logits);
    in one piece the log-softmax's output is (what the test would see if the chunks kept theirs)."""
    t = _trainer(standins["llama"], logits_chunk=chunk)  # vocabulary 1000, hidden 256
    model = t.engine.module.train()
    micro = collate(_samples(), {}, 0, pack=True, share=True)
    vocab, hidden = model.get_output_embeddings().weight.shape
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        lp, ent = t._forward(micro, model, entropy="train")
    wide = [s for s in saved if s and s[-1] == vocab and s != (hidden, vocab)]  # not the output layer's weight
    assert (not wide) if chunk else wide
    g = _grads(model, lp.sum() + 0.1 * ent.sum())
    assert float(g["lm_head.weight"].abs().max()) > 0


def test_an_update_in_chunks_under_zero3_is_the_update_in_one_piece(standins, tmp_path):
    """ZeRO-3 gathers the partitioned output layer for each chunk it is called on (and again in the backward's
    recomputation): the same loss, entropy, gradient norm and weights as the update in one piece at ZeRO-0."""
    from safetensors.torch import load_file

    from tests.helpers.dist_update import fixed_batch

    torch.set_num_threads(1)
    whole, chunked = _trainer(standins["llama"], batch_size=16, micro_batch_size=8), \
        _trainer(standins["llama"], batch_size=16, micro_batch_size=8, zero_stage=3, logits_chunk=4)
    a, b = whole.update(fixed_batch(16), 0), chunked.update(fixed_batch(16), 0)
    for key in ("loss", "entropy", "grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-5), key
    whole.export_weights(tmp_path / "whole")
    chunked.export_weights(tmp_path / "chunked")
    x, y = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "chunked" / "model.safetensors")
    assert sorted(x) == sorted(y) and max(float((x[k] - y[k]).abs().max()) for k in x) < 1e-5  # 1% of a step
