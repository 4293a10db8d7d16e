"""train.precision: bf16 runs the forward passes under bfloat16 autocast while weights, gradients and Adam moments
stay float32 (as TRL's bf16=True); fp32 runs them in float32. Measured against log-probs from a plain float32
forward of the same checkpoint, which the samples carry as the sampler's."""

import pytest
import torch

from rlpipe.config import TrainConfig
from rlpipe.training.trainer import PolicyTrainer
from tests.helpers.trainer_inputs import cpu_logprobs, scored_samples


def _update(tiny_checkpoint, precision: str) -> tuple[dict, set, PolicyTrainer]:
    from transformers import AutoModelForCausalLM

    cfg = TrainConfig(batch_size=8, micro_batch_size=4, lr=1e-3, kl_coef=0.01, precision=precision)
    trainer = PolicyTrainer(model_dir=str(tiny_checkpoint), cfg=cfg, seed=0, max_new_tokens=6)
    seen: set[torch.dtype] = set()
    hook = trainer.module.lm_head.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32).eval()
    metrics = trainer.update(scored_samples(cpu_logprobs(plain, trainer.tokenizer.pad_token_id)), 0)
    hook.remove()
    return metrics, seen, trainer


def test_bf16_runs_the_forward_in_bf16_and_keeps_float32_weights_and_moments(tiny_checkpoint):
    m, seen, trainer = _update(tiny_checkpoint, "bf16")
    assert seen == {torch.bfloat16}  # the policy's and the reference's logits
    assert m["optimizer_steps"] == 1 and m["nonfinite_steps"] == 0
    assert 1e-4 < m["mismatch/abs_max"] < 0.1  # rounded logits: near the float32 sampler's log-probs, not equal
    assert all(p.dtype == torch.float32 for p in trainer.module.parameters())
    moments = [v for s in trainer.engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    assert moments and all(v.dtype == torch.float32 for v in moments)


def test_fp32_is_the_float32_forward(tiny_checkpoint):
    m, seen, _ = _update(tiny_checkpoint, "fp32")
    assert seen == {torch.float32}
    assert m["mismatch/abs_max"] < 1e-5


def test_an_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp16")
