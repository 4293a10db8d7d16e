"""The HF engine samples each completion from its own generator (seed + prompt index, sample number), as
vLLM seeds each prompt apart: what a prompt draws does not depend on its batch, its neighbours or a split."""

import pytest

from rlpipe.rollout.base import SamplingConfig
from rlpipe.rollout.hf_engine import HFEngine

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]


def _tokens(engine, prompts, sampling):
    return [[c.token_ids for c in o] for o in engine.generate(prompts, sampling)]


def test_a_completion_does_not_depend_on_batching_or_splitting(tiny_checkpoint):
    sampling = SamplingConfig(n=3, temperature=1.0, max_new_tokens=8, seed=42)
    whole = _tokens(HFEngine(tiny_checkpoint, batch_size=256), PROMPTS, sampling)
    assert _tokens(HFEngine(tiny_checkpoint, batch_size=4), PROMPTS, sampling) == whole  # other chunks
    tail = SamplingConfig(n=3, temperature=1.0, max_new_tokens=8, seed=42 + 2)  # prompts 2.. as their own request
    assert _tokens(HFEngine(tiny_checkpoint), PROMPTS[2:], tail) == whole[2:]
    assert len({tuple(x) for o in whole for x in o}) > 5  # sampled, not greedy: the completions differ
    other = _tokens(HFEngine(tiny_checkpoint), PROMPTS, SamplingConfig(n=3, temperature=1.0, max_new_tokens=8, seed=43))
    assert other != whole


def test_a_bf16_engine_holds_the_rounded_weights_and_reports_the_files_version(tiny_checkpoint):
    import torch

    from rlpipe.rollout.base import WeightSyncError
    from rlpipe.storage.weights import file_weights_digest

    full, half = HFEngine(tiny_checkpoint), HFEngine(tiny_checkpoint, device="cpu", dtype=torch.bfloat16)
    assert (full.dtype, half.dtype) == ("float32", "bfloat16")
    assert half.load_weights(tiny_checkpoint) == file_weights_digest(tiny_checkpoint) == full.weights_sha256()
    full.load_weights(tiny_checkpoint)
    assert half.last_readback == full.last_readback > 0  # every tensor read back
    a, b = full.sequence_logprobs(PROMPTS, PROMPTS), half.sequence_logprobs(PROMPTS, PROMPTS)
    gap = max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p, q))
    assert 0 < gap < 0.05  # rounded weights: within the probe's 16-bit tolerance of the float32 model
    load = half.model.load_state_dict

    def loses_one(tensors, strict=False):  # an engine that drops a tensor on the way in: the read-back sees it
        name = sorted(tensors)[0]
        return load({**tensors, name: tensors[name] + 1.0}, strict=strict)

    half.model.load_state_dict = loses_one
    with pytest.raises(WeightSyncError, match="different values"):
        half.load_weights(tiny_checkpoint)
