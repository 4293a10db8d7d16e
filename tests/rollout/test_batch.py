import math

import pyarrow as pa
import pytest

from rlpipe.rollout.batch import (
    apply_overlong_penalty, batch_metrics, filter_groups, group_signal, overlong_penalty, select_prompts, table_to_samples,
)
from rlpipe.storage.schemas import TRAJECTORY_SCHEMA


def row(pid, reward, n_tokens=3, status="ok", truncated=False, idx=0):
    return {
        "run_id": "r", "iteration": 0, "prompt_id": pid, "sample_index": idx, "policy_version": "v",
        "prompt_token_ids": [1, 2], "response_token_ids": list(range(n_tokens)), "response_text": "x" * n_tokens,
        "logprobs": [-1.0] * n_tokens, "loss_mask": [1] * n_tokens, "steps": None,
        "reward": reward if status == "ok" else None, "reward_status": status, "reward_reason": None,
        "verifier": "math", "verifier_version": "1", "truncated": truncated, "generate_s": 0.0, "verify_s": 0.0,
    }


def table(rows):
    return pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)


def test_overlong_penalty_follows_dapo_eq13():
    # max 8, buffer 2: no penalty up to 6 tokens, then (8 − 2 − L)/2: 7 → −0.5, 8 → −1.0
    assert [overlong_penalty(n, 8, 2) for n in (0, 5, 6, 7, 8)] == [0.0, 0.0, 0.0, -0.5, -1.0]
    assert overlong_penalty(8, 8, 4, factor=0.5) == -0.5
    assert overlong_penalty(7, 8, 4, factor=0.5) == pytest.approx(-0.375)


def test_apply_overlong_penalty_touches_scored_rows_only_and_says_why():
    t = table([row("a", 1.0, 8), row("a", 0.0, 7), row("b", 1.0, 2), row("b", None, 8, status="timeout")])
    out, m = apply_overlong_penalty(t, 8, 2)
    rows = out.to_pylist()
    assert [r["reward"] for r in rows] == [0.0, -0.5, 1.0, None]
    assert "overlong penalty -1.000" in rows[0]["reward_reason"] and rows[2]["reward_reason"] is None
    assert rows[3]["reward_status"] == "timeout" and m["overlong_penalized_share"] == 0.5


def test_group_signal_needs_two_scored_and_different_rewards():
    rows = [row("same", 1.0), row("same", 1.0), row("mixed", 1.0), row("mixed", 0.0),
            row("one", 1.0), row("one", None, status="error"), row("none", None, status="timeout")]
    assert group_signal(rows) == {"same": False, "mixed": True, "one": False, "none": False}


def test_filter_groups_keeps_first_drawn_groups_with_signal_up_to_the_batch():
    d0 = table([row("a", 1.0), row("a", 1.0), row("b", 0.0), row("b", 1.0)])
    d1 = table([row("c", 1.0), row("c", 0.0), row("d", 0.5), row("d", 0.0), row("e", 0.0), row("e", 0.0)])
    out, m = filter_groups([d0, d1], max_groups=2)
    assert [r["prompt_id"] for r in out.to_pylist()] == ["b", "b", "c", "c"]
    assert m == {"dynamic/draws": 2.0, "dynamic/groups_drawn": 5.0, "dynamic/groups_kept": 2.0,
                 "dynamic/groups_dropped": 3.0, "dynamic/samples_kept": 4.0}
    out, m = filter_groups([d0], max_groups=4)  # not enough: keeps what has signal
    assert {r["prompt_id"] for r in out.to_pylist()} == {"b"} and m["dynamic/groups_kept"] == 1.0


def test_batch_metrics_count_groups_with_signal_and_alert_on_flat_batches():
    m, alerts = batch_metrics(table([row("a", 1.0), row("a", 1.0), row("b", 1.0), row("b", 1.0, truncated=True)]))
    assert m["groups"] == 2 and m["groups_with_signal"] == 0 and m["truncated_share"] == 0.25
    assert any("no learning signal" in a for a in alerts)
    m, _ = batch_metrics(table([row("a", 1.0), row("a", 0.0)]))
    assert m["groups_with_signal"] == 1 and m["reward_mean"] == 0.5


def test_table_to_samples_groups_by_prompt_and_carries_truncation():
    samples = table_to_samples(table([row("a", 1.0), row("b", 0.0, truncated=True), row("a", None, status="error")]))
    assert [s.group for s in samples] == [0, 1, 0]
    assert [s.truncated for s in samples] == [False, True, False]
    assert samples[2].reward is None and not samples[2].valid


def test_select_prompts_is_a_function_of_the_slot():
    rows = [{"id": str(i)} for i in range(10)]
    a, cur = select_prompts(rows, 3, 4, seed=1)
    b, _ = select_prompts(rows, 3, 4, seed=1)
    assert a == b and cur == {"epoch": 1, "offset": 2}
    # One epoch's slots cover every row once before any repeats.
    first = [r["id"] for k in range(2) for r in select_prompts(rows, k, 5, seed=1)[0]]
    assert sorted(first) == [str(i) for i in range(10)]
    assert math.isclose(len(select_prompts(rows, 7, 3, seed=0)[0]), 3)


def test_flat_batch_alert_can_be_turned_off_for_dynamic_sampling():
    flat = table([row("a", 1.0), row("a", 1.0)])
    assert any("no learning signal" in a for a in batch_metrics(flat)[1])
    assert batch_metrics(flat, flat_batch_alert=False)[1] == []


def test_reward_per_task_and_its_correlation_with_length_by_hand():
    rows = [row("a", 1.0, 6), row("a", 0.0, 2), row("b", 1.0, 4), row("b", None, 9, status="timeout")]
    rows[2]["verifier"] = "code"
    m, _ = batch_metrics(table(rows))
    assert m["reward_by_task/math"] == 0.5 and m["reward_by_task/code"] == 1.0  # the timeout is in neither
    # rewards (1, 0, 1), lengths (6, 2, 4): r = cov / (sd sd) = (2/3) / (sqrt(2/9) * sqrt(8/3)) = sqrt(3) / 2
    assert m["reward_length_corr"] == pytest.approx(math.sqrt(3) / 2)
    assert batch_metrics(table([row("a", 1.0, 3), row("a", 0.0, 3)]))[0]["reward_length_corr"] == 0.0  # one length


def test_the_advantage_distribution_by_hand():
    import torch

    from rlpipe.algorithms.functional import masked_stats

    x = torch.tensor([[0.0, 1.0, 2.0, 3.0], [4.0, 0.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    st = masked_stats(x, mask)  # the values 0, 1, 2, 3, 4, 0
    assert st["mean"] == pytest.approx(10 / 6) and (st["min"], st["max"]) == (0.0, 4.0)
    assert st["p50"] == pytest.approx(1.5) and st["p10"] == pytest.approx(0.0) and st["p90"] == pytest.approx(3.5)
    assert st["zero_share"] == pytest.approx(2 / 6)
    assert masked_stats(x, torch.zeros_like(mask))["p90"] == 0.0
