"""``rlpipe rollback``: on a real 2-iteration run (HF engine, save_interval 1), the local store, MLflow and the
Prefect test API. The alias moves back (audited), the new run starts from the save point's weights on the same
dataset version and names its parent, a redone registration of the rolled-back run does not undo the rollback, and
bad --to values say which save points there are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlpipe.audit import AuditLog, move_alias
from rlpipe.cli import app
from rlpipe.config import load_config, settings
from rlpipe.storage import TRAJECTORY_SCHEMA, open_store
from rlpipe.storage.layout import stage_prefix
from rlpipe.tracking.mlflow_utils import Tracker
from tests.flows.test_train_flow import even_task, invoke, rl_overrides  # noqa: F401 - fixture re-used


@pytest.fixture(scope="module")
def parent(prefect_harness, tiny_checkpoint, even_task):
    sets = rl_overrides(tiny_checkpoint, "rlrb", "hf", even_task)
    invoke(["run", "--run-id", "rl-rb"] + [x for s in sets for x in ("--set", s)])
    cfg = load_config(None, sets)
    tracker = Tracker(settings(), cfg)
    versions = {int(m.tags["iteration"]): m for m in
                tracker.client.search_model_versions(f"name='{cfg.registered_model}' and tags.run_id='rl-rb'")}
    assert sorted(versions) == [0, 1]
    assert tracker.version_by_alias(cfg.registered_model, "latest").version == str(versions[1].version)
    return cfg, tracker, versions


def _rollback(*args: str):
    return CliRunner().invoke(app, ["rollback", *args])


def test_bad_to_values_name_the_save_points(parent):
    cfg, tracker, v = parent
    listed = f"iteration 0 = v{v[0].version}, iteration 1 = v{v[1].version}"
    for to, says in (("5", "iteration 5 is not a registered save point"), ("v999", "version v999 is not"),
                     ("last", "expected an iteration of rl-rb")):
        res = _rollback("rl-rb", "--to", to)
        assert res.exit_code == 2 and says in res.output and listed in res.output, res.output
    res = _rollback("no-such-run", "--to", "0")
    assert res.exit_code == 2 and "run 'no-such-run' has no registered model version" in res.output
    res = _rollback("rl-rb", "--to", "1", "--run-id", "rl-rb")  # an id taken by a run that is not this rollback
    assert res.exit_code == 2 and "run id rl-rb is taken" in res.output, res.output
    assert tracker.version_by_alias(cfg.registered_model, "latest").version == str(v[1].version)


def test_a_changed_dataset_is_refused_before_anything_moves(parent):
    from dataclasses import replace

    from rlpipe.cli.rollback_cmd import _check_dataset
    from rlpipe.rollback import RollbackError, plan_rollback

    cfg, tracker, v = parent
    plan = plan_rollback(tracker, "rl-rb", "0")
    assert plan.dataset_version == v[0].tags["dataset_version"]
    _check_dataset(plan)  # the file is as the run read it
    with pytest.raises(RollbackError, match="trained on 0000000000000000: restore that file"):
        _check_dataset(replace(plan, dataset_version="0" * 64))


def test_dry_run_changes_nothing(parent):
    cfg, tracker, v = parent
    res = _rollback("rl-rb", "--to", f"v{v[0].version}", "--dry-run")
    assert res.exit_code == 0, res.output
    assert f"move @latest: v{v[1].version} -> v{v[0].version}" in res.output and "start run rl-rb-rb0" in res.output
    assert tracker.version_by_alias(cfg.registered_model, "latest").version == str(v[1].version)
    assert not AuditLog(open_store()).read(action="alias.rollback")


def test_rollback_moves_latest_back_and_starts_from_the_save_point(parent, tiny_checkpoint):
    cfg, tracker, v = parent
    res = _rollback("rl-rb", "--to", "0")
    assert res.exit_code == 0, res.output[-4000:]
    summary = json.loads(Path(res.stdout.strip().splitlines()[-1]).read_text())
    assert summary["run_id"] == "rl-rb-rb0" and summary["iterations_done"] == 2
    (moved,) = AuditLog(open_store()).read(action="alias.rollback")
    assert moved.target == {"model": cfg.registered_model, "alias": "latest", "version": str(v[0].version)}
    assert moved.details["from"] == str(v[1].version) and "rollback of run rl-rb" in moved.details["why"]
    (started,) = AuditLog(open_store()).read(action="run.rollback")
    assert started.target["run_id"] == "rl-rb-rb0" and started.details["parent_run_id"] == "rl-rb"

    new = {int(m.tags["iteration"]): m for m in
           tracker.client.search_model_versions(f"name='{cfg.registered_model}' and tags.run_id='rl-rb-rb0'")}
    assert sorted(new) == [0, 1]
    assert new[0].tags["parent_version"] == str(v[0].version)  # lineage: the new run's first version came from it
    for mv in new.values():
        assert mv.tags["dataset_version"] == v[0].tags["dataset_version"]
        assert mv.tags["rollback_parent_run_id"] == "rl-rb" and mv.tags["rollback_parent_iteration"] == "0"
        assert mv.tags["rollback_parent_version"] == f"{cfg.registered_model}/{v[0].version}"
    # The new run's first batch was sampled by the save point's weights (their hash is each row's policy_version).
    rows = open_store().read_stage(stage_prefix("rl-rb-rb0", 0, "verify"), schema=TRAJECTORY_SCHEMA).to_pylist()
    assert {r["policy_version"] for r in rows} == {v[0].tags["weights_sha256"]}
    run = tracker.client.get_run(summary["mlflow_run_id"])
    assert run.data.tags["rlpipe.parent_run_id"] == "rl-rb" and run.data.tags["rlpipe.parent_iteration"] == "0"
    assert run.data.params["task.policy_model"] == f"models:/{cfg.registered_model}/{v[0].version}"
    assert run.data.params["task.ref_model"] == str(tiny_checkpoint)  # the parent's KL reference, kept
    assert run.data.params["dataset_version"] == v[0].tags["dataset_version"]
    assert tracker.version_by_alias(cfg.registered_model, "latest").version == str(new[1].version)


def test_a_redone_registration_of_the_rolled_back_run_does_not_undo_it(parent):
    """Right after a rollback (@latest on iteration 0), iteration 1 of the old run registers again (a retry, a
    resume): its version is found, and @latest stays where the rollback put it."""
    from tasks.tracking import register_checkpoint

    cfg, tracker, v = parent
    if tracker.client.get_registered_model(cfg.registered_model).tags.get("rlpipe.rolled_back.rl-rb") is None:
        pytest.skip("needs the rollback of the test above (run the module)")
    move_alias(AuditLog(open_store()), tracker, cfg.registered_model, "latest", str(v[0].version), why="test setup")
    again = register_checkpoint.fn(cfg, "rl-rb", v[1].tags["mlflow_run_id"],
                                   {"checkpoint_uri": v[1].source, "weights_sha256": v[1].tags["weights_sha256"]},
                                   v[1].tags["dataset_version"], 1, ("latest",))
    assert again["version"] == str(v[1].version) and "last" not in again["aliases"]
    assert tracker.version_by_alias(cfg.registered_model, "latest").version == str(v[0].version)
