"""The KL reference a rollback's new run keeps (:func:`rlpipe.rollback.reference`); the rollback itself runs for
real in tests/flows/test_rollback.py."""

from rlpipe.config import load_config
from rlpipe.rollback import reference


def test_the_reference_is_the_parents_and_an_alias_is_pinned_to_where_the_parent_started():
    alias = load_config(None, ["task.policy_model=models:/rlpipe-arithmetic@base"])
    assert reference(alias, "rlpipe-arithmetic", "3") == "models:/rlpipe-arithmetic/3"
    assert reference(alias, "rlpipe-arithmetic", "sft-model/7") == "models:/sft-model/7"
    assert reference(alias, "rlpipe-arithmetic", "") == "models:/rlpipe-arithmetic@base"  # nothing recorded: as given
    folder = load_config(None, ["task.policy_model=/ckpt/base"])
    assert reference(folder, "rlpipe-arithmetic", "") == "/ckpt/base"
    pinned = load_config(None, ["task.policy_model=models:/rlpipe-arithmetic@base", "task.ref_model=/ckpt/ref"])
    assert reference(pinned, "rlpipe-arithmetic", "3") == "/ckpt/ref"
