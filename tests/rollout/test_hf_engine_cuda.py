"""The HF engine on a CUDA device: bfloat16 by default, each completion still drawn from its own generator (one
uniform per row, the inverse CDF on the device), and its log-probs within the weight-sync probe's 16-bit
tolerance of the trainer's float32 ones. Skipped where no GPU is present."""

import pytest
import torch

from rlpipe.rollout.base import SamplingConfig
from rlpipe.rollout.hf_engine import HFEngine, _draw
from rlpipe.rollout.probe import HALF_TOLERANCE

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]


def _tokens(engine, prompts, sampling):
    return [[c.token_ids for c in o] for o in engine.generate(prompts, sampling)]


def test_the_draw_on_cuda_follows_the_distribution_and_never_picks_a_zero():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25], device="cuda").repeat(4000, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    picked = _draw(probs, gens).cpu()
    counts = torch.bincount(picked, minlength=5).double() / 4000
    assert counts[0] == counts[2] == 0
    assert torch.allclose(counts[[1, 3, 4]], torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64), atol=0.03)
    again = _draw(probs, [torch.Generator().manual_seed(i) for i in range(4000)]).cpu()
    assert torch.equal(picked, again)  # each row's token is its generator's


def test_a_completion_on_cuda_does_not_depend_on_batching(tiny_checkpoint):
    torch.backends.cuda.matmul.allow_tf32 = False
    sampling = SamplingConfig(n=3, temperature=1.0, max_new_tokens=8, seed=42)
    engine = HFEngine(tiny_checkpoint, dtype=torch.float32)
    assert engine.device.type == "cuda"
    whole = _tokens(engine, PROMPTS, sampling)
    engine.batch_size = 4
    assert _tokens(engine, PROMPTS, sampling) == whole
    assert len({tuple(x) for o in whole for x in o}) > 5


def test_the_bf16_engine_on_cuda_is_within_the_probes_tolerance_of_float32(tiny_checkpoint):
    cpu, gpu = HFEngine(tiny_checkpoint, device="cpu"), HFEngine(tiny_checkpoint)
    assert (gpu.device.type, gpu.dtype) == ("cuda", "bfloat16")
    assert gpu.load_weights(tiny_checkpoint) == cpu.weights_sha256()
    a, b = cpu.sequence_logprobs(PROMPTS, PROMPTS), gpu.sequence_logprobs(PROMPTS, PROMPTS)
    assert max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p, q)) < HALF_TOLERANCE
    outs = gpu.generate(PROMPTS, SamplingConfig(n=4, temperature=1.0, max_new_tokens=8, seed=1))
    assert all(len(c.token_ids) == len(c.logprobs) > 0 for o in outs for c in o)
