"""The vLLM engine's sampled completions: text, log-probs and seeds (the engine decodes the text itself)."""

import math

from rlpipe.rollout.base import SamplingConfig
from rlpipe.rollout.engines import get_engine


def test_sampled_completions_carry_their_text_and_their_tokens_logprobs(tiny_checkpoint):
    engine = get_engine("vllm", tiny_checkpoint, max_model_len=64)
    tok = engine.tokenizer
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("12+34=", "7+8=", "99+1=")]
    sampling = SamplingConfig(n=4, temperature=1.0, max_new_tokens=6, seed=3)
    out = engine.generate(prompts, sampling)
    assert [len(g) for g in out] == [4, 4, 4]
    comps = [c for g in out for c in g]
    assert len({tuple(c.token_ids) for c in comps}) > 1  # sampled, not greedy
    for c in comps:
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert len(c.logprobs) == len(c.token_ids) and all(lp <= 0.0 and math.isfinite(lp) for lp in c.logprobs)
    # Each sampled log-prob is the log-prob of the token sampled there (T=1: the engine's own forward pass).
    again = engine.sequence_logprobs([p for p, g in zip(prompts, out) for _ in g], [c.token_ids for c in comps])
    assert max(abs(a - b) for c, lps in zip(comps, again) for a, b in zip(c.logprobs, lps)) < 1e-4
    # The same seed draws the same completions; another seed draws others.
    same = engine.generate(prompts, sampling)
    assert [[c.token_ids for c in g] for g in same] == [[c.token_ids for c in g] for g in out]
    other = engine.generate(prompts, SamplingConfig(n=4, temperature=1.0, max_new_tokens=6, seed=4))
    assert [[c.token_ids for c in g] for g in other] != [[c.token_ids for c in g] for g in out]
