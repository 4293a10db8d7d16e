"""The output layer computes logits only where a response token is predicted (``logits_at``): the log-probs, the
entropy and the gradient equal those of the full logits, on both hub stand-ins (tied and untied output layers),
padded, packed and with shared prompts, under LoRA and bf16 autocast; a prompt's positions get no logits."""

import threading

import pytest
import torch

from rlpipe.algorithms.functional import entropy_from_logits, token_logprobs
from rlpipe.config import TrainConfig
from rlpipe.storage.samples import Sample
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
@pytest.mark.parametrize("layout,lora,precision", [("padded", False, "fp32"), ("packed", False, "fp32"),
                                                   ("shared", False, "fp32"), ("padded", True, "fp32"),
                                                   ("shared", False, "bf16")])
def test_logits_at_response_positions_change_no_log_prob_entropy_or_gradient(arch, layout, lora, precision, standins):
    torch.manual_seed(0)
    t = _trainer(standins[arch], precision=precision, **({"lora": LORA} if lora else {}))
    model = t.engine.module.train()
    samples = _samples()
    micro = collate(samples, {}, t.tokenizer.pad_token_id or 0, pack=layout != "padded", share=layout == "shared")
    assert (micro.packed is not None) == (layout != "padded")
    lp_ref, ent_ref = _full(model, micro, t._autocast())
    g_ref = _grads(model, lp_ref.sum() + 0.1 * ent_ref.sum())
    lp, logits = t._forward(micro, model)
    ent = micro.scatter(entropy_from_logits(logits), micro.predicting[1])
    g = _grads(model, lp.sum() + 0.1 * ent.sum())
    responses = sum(len(s.response_ids) for s in samples)
    assert logits.shape[0] == int(micro.resp.sum()) == responses  # none at a prompt's positions
    assert micro.input_ids.numel() > 2 * responses
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
