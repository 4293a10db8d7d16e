"""The rescore report's arithmetic on hand-checkable rows, and its argument parsing."""

import pytest

from rlpipe.lineage import parse_model_version
from rlpipe.rescore import RescoreError, advantage_change, advantages, parse_iterations, parse_verifier, verdict_changes


def row(prompt: str, status: str, reward: float | None, tokens: int = 3) -> dict:
    return {"prompt_id": prompt, "reward_status": status, "reward": reward, "response_token_ids": [1] * tokens}


def test_verdict_changes_count_transitions_rewards_and_means():
    before = [row("a", "ok", 1.0), row("a", "ok", 0.0), row("b", "ok", 1.0), row("b", "timeout", None)]
    after = [row("a", "ok", 0.0), row("a", "ok", 0.0), row("b", "error", None), row("b", "ok", 1.0)]
    got = verdict_changes(before, after)
    assert got["rows"] == 4 and got["verdicts_changed"] == 3 and got["reward_changed"] == 3
    assert got["status_changes"] == {"ok→error": 1, "timeout→ok": 1}
    assert got["mean_reward_before"] == pytest.approx(2 / 3) and got["mean_reward_after"] == pytest.approx(1 / 3)


def test_advantage_change_on_a_flipped_group_and_a_steady_one():
    before = [row("a", "ok", 1.0), row("a", "ok", 0.0), row("b", "ok", 1.0), row("b", "ok", 0.0)]
    after = [row("a", "ok", 0.0), row("a", "ok", 1.0), row("b", "ok", 1.0), row("b", "ok", 0.0)]
    adv_b, adv_a = advantages(before, "grpo", {}), advantages(after, "grpo", {})
    assert adv_b[0] > 0 > adv_b[1] and adv_a[0] < 0 < adv_a[1] and adv_a[2:] == pytest.approx(adv_b[2:])
    got = advantage_change(adv_b, adv_a)
    assert got["advantage_sign_flip_share"] == 0.5  # group a's two rows of four
    assert got["advantage_max_abs_delta"] == pytest.approx(2 * adv_b[0])
    # A row that lost its verdict takes no part: advantage 0, so its group of one other carries no signal.
    lost = advantages([row("a", "ok", 1.0), row("a", "error", None)], "grpo", {})
    assert lost == [0.0, 0.0]


def test_parsing_and_its_errors():
    assert parse_verifier("math@2") == ("math", "2") and parse_verifier("math") == ("math", None)
    assert parse_iterations("1:2", [0, 1, 2, 3]) == [1, 2] and parse_iterations("2:", [0, 1, 2, 3]) == [2, 3]
    assert parse_iterations(":0", [0, 1]) == [0] and parse_iterations("1", [0, 1]) == [1]
    with pytest.raises(RescoreError, match="selects none"):
        parse_iterations("5:6", [0, 1])
    with pytest.raises(RescoreError, match="A:B"):
        parse_iterations("x:y", [0, 1])
    assert parse_model_version("models:/m@champion") == ("m", None, "champion")
    assert parse_model_version("m/3") == ("m", "3", None) and parse_model_version("models:/m/3") == ("m", "3", None)
    with pytest.raises(ValueError, match="NAME/VERSION"):
        parse_model_version("m")
