"""Which prompts a draw takes, its sampling, and when a stored batch may be reused (rlpipe.rollout.batch)."""

import pyarrow as pa

from rlpipe.config import RunConfig
from rlpipe.rollout.batch import draw_sampling, prompt_slot, reuse_expectation, with_column


def test_prompt_slots_reserve_every_extra_draw_so_a_resume_draws_the_same():
    plain = RunConfig().rollout
    dapo = RunConfig.model_validate({"rollout": {"dynamic_sampling": True, "max_extra_draws": 2}}).rollout
    assert [prompt_slot(plain, k, 0) for k in range(3)] == [0, 1, 2]
    # 1 + 2 slices per iteration: iteration 1's draws are slices 3, 4, 5 whether or not iteration 0 drew 3 times.
    assert [prompt_slot(dapo, 1, d) for d in range(3)] == [3, 4, 5] and prompt_slot(dapo, 2, 0) == 6


def test_each_draw_samples_with_a_seed_of_its_own():
    r = RunConfig().rollout
    seeds = {draw_sampling(r, 7, k, d).seed for k in range(4) for d in range(3)}
    assert len(seeds) == 12 and draw_sampling(r, 7, 1, 2).seed == 7 * 1_000_003 + 10_007 + 202
    s = draw_sampling(r, 0, 0, 0)
    assert (s.n, s.temperature, s.max_new_tokens) == (r.samples_per_prompt, r.temperature, r.max_new_tokens)


def test_reuse_expectation_pins_the_engines_policy_or_the_staleness():
    assert reuse_expectation(0, "now", {"policy_iteration": 1}, 5) == {"policy_version": "now"}
    assert reuse_expectation(1, "now", {"policy_iteration": 3}, 5) == {"staleness": 1}
    assert reuse_expectation(1, "now", {"policy_iteration": 1}, 5) == {"staleness": "at most 1"}  # never matches


def test_with_column_sets_or_replaces_an_int_column():
    t = with_column(pa.table({"a": [1, 2]}), "staleness", 3)
    assert t.column("staleness").to_pylist() == [3, 3] and t.schema.field("staleness").type == pa.int32()
    t = with_column(t, "staleness", 0)
    assert t.column_names == ["a", "staleness"] and t.column("staleness").to_pylist() == [0, 0]
