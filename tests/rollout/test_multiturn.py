"""Multi-turn rollout on the real HF engine: masks, ids and log-probs line up turn by turn."""

import pytest

from rlpipe.envs import EnvLimits, EnvSpec, completeness_problems
from rlpipe.rollout.base import SamplingConfig
from rlpipe.rollout.multiturn import TurnFormat, run_episodes
from rlpipe.training.tiny import build_char_tokenizer


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    from rlpipe.rollout.hf_engine import HFEngine

    return HFEngine(tiny_checkpoint)


def test_observation_text_closes_the_turn_as_the_template_does():
    tok = build_char_tokenizer()
    opening = "<|im_start|>tool\n=5<|im_end|>\n<|im_start|>assistant\n"
    chat = TurnFormat.of(tok, chat=True)
    assert chat.observation_text("=5", "<|im_end|>") == "\n" + opening  # the policy wrote <|im_end|>
    assert chat.observation_text("=5", None) == "<|im_end|>\n" + opening  # cut at the token limit
    assert chat.observation_text("=5", "<|endoftext|>") == "<|im_end|>\n" + opening
    assert TurnFormat.of(tok, chat=False).observation_text("=5", None) == "=5\n"
    assert chat.end_of_turn_id(tok) == tok.convert_tokens_to_ids("<|im_end|>")
    assert TurnFormat.of(tok, chat=False).end_of_turn_id(tok) == tok.eos_token_id


def test_a_template_that_rewrites_history_is_refused():
    tok = build_char_tokenizer()
    tok.chat_template = "{{ messages | length }}"
    with pytest.raises(ValueError, match="messages in order"):
        TurnFormat.of(tok, chat=True)


def _runs(ids, mask):
    """Maximal runs of equal mask value: [(value, ids), ...]."""
    out = []
    for t, m in zip(ids, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


@pytest.mark.parametrize("chat", [True, False])
def test_episodes_interleave_policy_and_observation_tokens(engine, chat):
    tok = engine.tokenizer
    spec = EnvSpec(env="calculator", params={"digits": 2}, limits=EnvLimits(max_steps=3))
    tasks = [({}, s) for s in range(6)]
    out = run_episodes(engine, tok, spec, tasks, SamplingConfig(temperature=1.0, max_new_tokens=8, seed=0),
                       chat=chat, max_context=512)
    assert len(out) == 6
    for r in out:
        ep = r.episode
        assert ep.status == "ok" and (ep.done or ep.truncated)
        assert completeness_problems(ep.record(), done=ep.done, truncated=ep.truncated, max_steps=3) == []
        assert len(r.response_ids) == len(r.logprobs) == len(r.loss_mask)
        runs = _runs(r.response_ids, r.loss_mask)
        actions = [ids for m, ids in runs if m == 1]
        observations = [ids for m, ids in runs if m == 0]
        assert len(actions) == len(ep.steps)  # one policy run per turn
        assert len(observations) == len(ep.steps) - 1  # the last observation ends the episode: never appended
        for ids, step in zip(actions, ep.steps):
            assert tok.decode(ids, skip_special_tokens=True) == step.action
        for ids, step in zip(observations, ep.steps):
            assert step.observation in tok.decode(ids)  # the observation, wrapped as the template wraps it
        assert all(lp == 0.0 for lp, m in zip(r.logprobs, r.loss_mask) if m == 0)


def test_sampled_logprobs_are_the_engines_on_the_whole_history(engine):
    """The trainer scores the interleaved sequence as one; the policy tokens' log-probs on it must be
    the ones sampled turn by turn (no re-tokenization drift at turn boundaries)."""
    spec = EnvSpec(env="guess", params={"hi": 20}, limits=EnvLimits(max_steps=3))
    out = run_episodes(engine, engine.tokenizer, spec, [({}, s) for s in range(4)],
                       SamplingConfig(temperature=1.0, max_new_tokens=6, seed=1), chat=True)
    scored = engine.sequence_logprobs([r.prompt_ids for r in out], [r.response_ids for r in out])
    for r, lps in zip(out, scored):
        pairs = [(a, b) for a, b, m in zip(r.logprobs, lps, r.loss_mask) if m == 1]
        assert pairs and max(abs(a - b) for a, b in pairs) < 1e-4


def test_the_context_limit_cuts_and_flags_the_episode(engine):
    spec = EnvSpec(env="guess", limits=EnvLimits(max_steps=50))
    (r,) = run_episodes(engine, engine.tokenizer, spec, [({"secret": 77}, 0)],
                        SamplingConfig(temperature=1.0, max_new_tokens=8, seed=0), chat=True, max_context=80)
    assert r.episode.truncated and "max_context=80" in r.episode.reason
    assert len(r.prompt_ids) + len(r.response_ids) <= 80


def test_an_environment_that_cannot_start_gives_an_error_episode_without_tokens(engine):
    spec = EnvSpec(env="calculator")
    ok, bad = run_episodes(engine, engine.tokenizer, spec, [({}, 0), ({"expression": "import os"}, 0)],
                           SamplingConfig(temperature=1.0, max_new_tokens=4, seed=0), chat=True)
    assert bad.episode.status == "error" and bad.response_ids == [] and bad.episode.reward is None
    assert ok.episode.status == "ok"


def test_one_action_per_turn():
    with pytest.raises(ValueError, match="one action per episode"):
        run_episodes(None, None, EnvSpec(env="guess"), [], SamplingConfig(n=2))


def test_a_first_observation_longer_than_the_context_is_an_error(engine):
    (r,) = run_episodes(engine, engine.tokenizer, EnvSpec(env="calculator", params={"digits": 9}), [({}, 0)],
                        SamplingConfig(temperature=1.0, max_new_tokens=8, seed=0), chat=True, max_context=30)
    assert r.episode.status == "error" and "raise max_context" in r.episode.reason and r.response_ids == []


def test_a_demonstration_is_laid_out_as_a_sampled_episode_would_be():
    from rlpipe.envs.experts import demonstrate
    from rlpipe.rollout.multiturn import encode_episode

    tok = build_char_tokenizer()
    ep = demonstrate(EnvSpec(env="calculator"), {"expression": "1234*5678"}, 0)
    r = encode_episode(tok, ep, chat=True)
    assert tok.decode(r.prompt_ids) == "<|im_start|>user\n1234*5678<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(r.response_ids) == ("calc(1234*5678)<|im_end|>\n<|im_start|>tool\n=7006652<|im_end|>\n"
                                          "<|im_start|>assistant\nanswer(7006652)<|im_end|>")
    trained = [t for t, m in zip(r.response_ids, r.loss_mask) if m]
    assert tok.decode(trained) == "calc(1234*5678)<|im_end|>answer(7006652)<|im_end|>"
    with pytest.raises(ValueError, match="finished episode"):
        from rlpipe.envs import Episode
        encode_episode(tok, Episode(EnvSpec(env="guess").make(), {}, 0, EnvLimits()), chat=True)


@pytest.mark.parametrize("chat", [True, False])
def test_re_encoding_a_sampled_episode_gives_back_its_ids_and_mask(engine, chat):
    """SFT traces and RL episodes share one layout: an episode sampled on the engine, written out again
    from its actions and observations alone, is the same token sequence with the same mask. Greedy
    actions here: the end token at once, then a run of letters cut at the token limit."""
    from rlpipe.rollout.multiturn import encode_episode

    tok = engine.tokenizer
    spec = EnvSpec(env="calculator", params={"digits": 2}, limits=EnvLimits(max_steps=3))
    out = run_episodes(engine, tok, spec, [({}, s) for s in range(6)],
                       SamplingConfig(temperature=0.0, max_new_tokens=12, seed=0), chat=chat)
    kinds = set()
    for r in out:
        kinds |= set(r.stopped)
        again = encode_episode(tok, r.episode, chat=chat, stopped=r.stopped)
        assert (again.prompt_ids, again.response_ids, again.loss_mask) == (r.prompt_ids, r.response_ids, r.loss_mask)
    # Both ends of an action are exercised in plain mode; in chat mode this arithmetic-trained model never
    # ends a turn (the demonstration test above covers an action ended by <|im_end|>).
    assert kinds == ({False} if chat else {True, False})
