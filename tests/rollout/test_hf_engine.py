"""The HF engine samples each completion from its own generator (seed + prompt index, sample number), as
vLLM seeds each prompt apart: what a prompt draws does not depend on its batch, its neighbours or a split."""

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
