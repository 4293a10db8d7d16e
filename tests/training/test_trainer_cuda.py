"""The trainer on a CUDA device: DeepSpeed places the model on the GPU and every input follows it (micro-batches,
packed rows, the reference model, the ranks' reductions). Skipped where no GPU is present."""

import pytest
import torch

from rlpipe.config import TrainConfig
from rlpipe.storage.samples import Sample
from rlpipe.training.trainer import PolicyTrainer

pytestmark = pytest.mark.gpu


def _samples(own: list[list[float]], prompts, responses) -> list[Sample]:
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    return [Sample(p, r, lp, rewards[i], i // 4) for i, (p, r, lp) in enumerate(zip(prompts, responses, own))]


@torch.no_grad()
def _cpu_logprobs(model, pad_id: int, prompts, responses) -> list[list[float]]:
    from rlpipe.algorithms.functional import token_logprobs
    from rlpipe.training.trainer import _collate

    micro = _collate([Sample(p, r, [0.0] * len(r), 0.0, 0) for p, r in zip(prompts, responses)], {}, pad_id)
    lp = token_logprobs(model(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits[:, :-1], micro.targets)
    return [lp[i, len(p) - 1 : len(p) - 1 + len(r)].tolist() for i, (p, r) in enumerate(zip(prompts, responses))]


@pytest.mark.parametrize("pack", [False, True])
def test_an_update_on_cuda_matches_the_cpu_model(tiny_checkpoint, pack):
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = TrainConfig(batch_size=8, micro_batch_size=4, lr=1e-3, kl_coef=0.01, pack_sequences=pack)
    trainer = PolicyTrainer(model_dir=str(tiny_checkpoint), cfg=cfg, seed=0, max_new_tokens=6)
    assert trainer.device.type == "cuda" and next(trainer.module.parameters()).is_cuda
    prompts = [[5 + i, 6, 7, 8][: 2 + i % 3] for i in range(8)]
    responses = [[10 + i, 11, 12, 13, 14][: 1 + (i * 2) % 5] for i in range(8)]
    on_gpu = trainer.sequence_logprobs(prompts, responses)
    cpu = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32).eval()
    on_cpu = _cpu_logprobs(cpu, trainer.tokenizer.pad_token_id, prompts, responses)
    assert max(abs(a - b) for x, y in zip(on_gpu, on_cpu) for a, b in zip(x, y)) < 1e-4
    before = {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}
    m = trainer.update(_samples(on_cpu, prompts, responses), 0)
    assert m["optimizer_steps"] == 1 and m["nonfinite_steps"] == 0
    assert m["mismatch/abs_max"] < 1e-4  # the CPU model's log-probs are the GPU policy's
    assert m["kl"] == pytest.approx(0.0, abs=1e-5)  # the reference (moved to the GPU too) is the same model
    assert any(not torch.equal(before[k], v) for k, v in trainer.module.state_dict().items())
