import pytest

from rlpipe.config import DataConfig
from rlpipe.data import build_arithmetic, dataset_version, validate_prompts


def test_default_family_splits_are_disjoint_and_complete():
    rows = build_arithmetic(DataConfig()).to_pylist()
    assert len(rows) == 90 * 90  # every 2-digit pair
    by_split = {s: {r["prompt"] for r in rows if r["split"] == s} for s in ("train", "validation", "test")}
    assert len(by_split["test"]) == 500 and len(by_split["validation"]) == 200
    assert not by_split["train"] & by_split["test"]
    assert not by_split["train"] & by_split["validation"]
    assert not by_split["validation"] & by_split["test"]
    assert validate_prompts(build_arithmetic(DataConfig())) == []


@pytest.mark.parametrize(
    "op,prompt,answer", [("add", "12+34=", "46"), ("sub", "12-34=", "-22"), ("mul", "12*34=", "408")]
)
def test_answers_are_correct(op, prompt, answer):
    rows = {r["prompt"]: r for r in build_arithmetic(DataConfig(operations=[op])).to_pylist()}
    assert rows[prompt]["ground_truth"] == answer
    assert rows[prompt]["id"] == f"{op}-12-34" and rows[prompt]["task"] == "math"


def test_same_seed_same_version_other_seed_other_version():
    a = dataset_version(build_arithmetic(DataConfig(seed=0)))
    assert a == dataset_version(build_arithmetic(DataConfig(seed=0)))
    assert a != dataset_version(build_arithmetic(DataConfig(seed=1)))


def test_large_families_are_sampled_without_overlap():
    t = build_arithmetic(DataConfig(digits=4, operations=["mul"], train_size=1000, test_size=100, validation_size=0))
    rows = t.to_pylist()
    assert len(rows) == 1100 and len({r["prompt"] for r in rows}) == 1100
    with pytest.raises(ValueError, match="train_size"):
        build_arithmetic(DataConfig(digits=4))
    with pytest.raises(ValueError, match="only 100"):
        build_arithmetic(DataConfig(digits=1, test_size=90, validation_size=20))


def test_expression_task_has_disjoint_targets_and_valid_references():
    from rlpipe.data import build_expressions

    rows = build_expressions(DataConfig(digits=4, test_size=100, validation_size=50)).to_pylist()
    assert len(rows) == 9000 and validate_prompts(build_expressions(DataConfig(digits=4))) == []
    splits = {s: {r["ground_truth"] for r in rows if r["split"] == s} for s in ("train", "validation", "test")}
    assert len(splits["test"]) == 100 and not splits["train"] & splits["test"]
    for r in rows:  # every reference expression really has the target value
        assert eval(r["solution"], {"__builtins__": {}}) == int(r["ground_truth"]), r
        assert r["task"] == "python_expr" and r["prompt"] == f"expr {r['ground_truth']}:"


def test_rlhf_task_demonstrations_carry_a_seeded_sloppy_habit_on_train_rows_only():
    from rlpipe.data.arithmetic import SLOPPY_DEMO_SHARE, build_arithmetic_rlhf
    from rlpipe.rewards.closeness import closeness

    rows = build_arithmetic_rlhf(DataConfig()).to_pylist()
    assert {r["task"] for r in rows} == {"closeness"}
    train = [r for r in rows if r["split"] == "train"]
    assert all(r["solution"] is None for r in rows if r["split"] != "train")  # held-out rows: no demonstration
    sloppy = [r for r in train if r["solution"] != r["ground_truth"]]
    assert abs(len(sloppy) / len(train) - SLOPPY_DEMO_SHARE) < 0.02
    for r in sloppy:  # the sum with a stray 0: worth nothing to the hidden quality
        assert r["solution"] == r["ground_truth"] + "0"
        assert closeness(r["solution"], r["ground_truth"]).reward < 1e-6
    assert rows == build_arithmetic_rlhf(DataConfig()).to_pylist()
    assert validate_prompts(build_arithmetic_rlhf(DataConfig())) == []
