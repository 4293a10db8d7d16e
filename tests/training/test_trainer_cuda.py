"""The trainer on a CUDA device: DeepSpeed places the model on the GPU and every input follows it (micro-batches,
packed rows, the reference model, the ranks' reductions). Skipped where no GPU is present."""

import pytest
import torch

from rlpipe.config import TrainConfig
from rlpipe.training.trainer import PolicyTrainer
from tests.helpers.trainer_inputs import PROMPTS, RESPONSES, cpu_logprobs, scored_samples

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("pack", [False, True])
def test_an_update_on_cuda_matches_the_cpu_model(tiny_checkpoint, pack):
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = TrainConfig(batch_size=8, micro_batch_size=4, lr=1e-3, kl_coef=0.01, pack_sequences=pack)
    trainer = PolicyTrainer(model_dir=str(tiny_checkpoint), cfg=cfg, seed=0, max_new_tokens=6)
    assert trainer.device.type == "cuda" and next(trainer.module.parameters()).is_cuda
    on_gpu = trainer.sequence_logprobs(PROMPTS, RESPONSES)
    cpu = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32).eval()
    on_cpu = cpu_logprobs(cpu, trainer.tokenizer.pad_token_id)
    assert max(abs(a - b) for x, y in zip(on_gpu, on_cpu) for a, b in zip(x, y)) < 1e-4
    before = {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}
    m = trainer.update(scored_samples(on_cpu), 0)
    assert m["optimizer_steps"] == 1 and m["nonfinite_steps"] == 0
    assert m["mismatch/abs_max"] < 1e-4  # the CPU model's log-probs are the GPU policy's
    assert m["kl"] == pytest.approx(0.0, abs=1e-5)  # the reference (moved to the GPU too) is the same model
    assert any(not torch.equal(before[k], v) for k, v in trainer.module.state_dict().items())


def test_a_bf16_update_on_cuda_keeps_float32_weights_and_moments(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    cfg = TrainConfig(batch_size=8, micro_batch_size=4, lr=1e-3, kl_coef=0.01, precision="bf16")
    trainer = PolicyTrainer(model_dir=str(tiny_checkpoint), cfg=cfg, seed=0, max_new_tokens=6)
    cpu = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32).eval()
    m = trainer.update(scored_samples(cpu_logprobs(cpu, trainer.tokenizer.pad_token_id)), 0)
    assert m["optimizer_steps"] == 1 and m["nonfinite_steps"] == 0
    assert 1e-4 < m["mismatch/abs_max"] < 0.1  # bf16 logits: close to the float32 sampler's, not equal
    assert all(p.dtype == torch.float32 and p.is_cuda for p in trainer.module.parameters())
    moments = [v for s in trainer.engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    assert moments and all(v.dtype == torch.float32 for v in moments)


def test_bf16_weights_on_cuda_hold_bfloat16_beside_float32_masters(tiny_checkpoint):
    """train.precision bf16_weights on the GPU: the module's weights bfloat16 on the device, the optimizer's masters
    and moments float32, and the probe's float32 forward of the bfloat16 weights is a float32 model's of them."""
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = TrainConfig(batch_size=8, micro_batch_size=4, lr=1e-3, kl_coef=0.01, precision="bf16_weights", zero_stage=1)
    trainer = PolicyTrainer(model_dir=str(tiny_checkpoint), cfg=cfg, seed=0, max_new_tokens=6)
    assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in trainer.module.parameters())
    cpu = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32).eval()
    m = trainer.update(scored_samples(cpu_logprobs(cpu, trainer.tokenizer.pad_token_id)), 0)
    assert m["optimizer_steps"] == 1 and m["nonfinite_steps"] == 0 and m["grad_norm"] > 0
    masters = trainer.engine.optimizer.state_dict()["single_partition_of_fp32_groups"]
    assert all(g.dtype == torch.float32 for g in masters)
    _, tensors = trainer.policy_tensors()
    held = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32).eval()
    held.load_state_dict({k: v.float().cpu() for k, v in tensors.items()}, strict=False)
    on_gpu = trainer.sequence_logprobs(PROMPTS, RESPONSES)
    on_cpu = cpu_logprobs(held, trainer.tokenizer.pad_token_id)
    assert max(abs(a - b) for x, y in zip(on_gpu, on_cpu) for a, b in zip(x, y)) < 1e-4
