"""``rlpipe rollback RUN --to ITERATION|vVERSION``: the aliases back on a save point of RUN, and a new run from it
(:mod:`rlpipe.rollback` says what moves and what the new run keeps)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from rlpipe.cli.common import refused
from rlpipe.config import settings


def rollback_cmd(
    run_id: Annotated[str, typer.Argument(help="The run to roll back.")],
    to: Annotated[str, typer.Option("--to", help="An iteration of RUN (2) or a model version of RUN (v5): a save point.")],
    new_run_id: Annotated[Optional[str], typer.Option("--run-id", help="The new run's id (default: RUN-rbITERATION).")] = None,
    dry_run: Annotated[bool, typer.Option(help="Print what would move and start; change nothing.")] = False,
) -> None:
    """Move RUN's aliases back to a save point (each move audited) and start a new run from it with RUN's config and
    dataset version; its MLflow run and versions name the parent. The registry is RLPIPE_TRACKING_URI's. Prints
    the new run's summary.json path last."""
    from rlpipe.audit import AuditError
    from rlpipe.resume import ResumeRefused
    from rlpipe.rollback import RollbackError, move_back, plan_rollback
    from rlpipe.storage import open_store
    from rlpipe.storage.layout import check_run_id
    from rlpipe.tracking.mlflow_utils import Tracker

    s = settings()
    tracker = Tracker(s)
    with refused("rlpipe rollback", (RollbackError, ValueError)):
        plan = plan_rollback(tracker, run_id, to, new_run_id and check_run_id(new_run_id))
        check_run_id(plan.new_run_id)
    for line in plan.describe():
        typer.echo(line)
    if dry_run:
        typer.echo("dry run: nothing moved, nothing started")
        return
    with refused("rlpipe rollback", (RollbackError,)):
        _check_dataset(plan)
        _check_new_run(tracker, plan)
    from tasks.audit import audit_log

    audit = audit_log(open_store(s.resolve_storage_uri(plan.config), s), s)
    with refused("rlpipe rollback", (AuditError,)):
        move_back(audit, tracker, plan)
        audit.write("run.rollback", {"run_id": plan.new_run_id, "model": plan.name, "version": plan.version},
                    {"parent_run_id": plan.run_id, "parent_iteration": plan.iteration, "moved": dict(plan.moves)})
    _start_tracking(tracker, plan)
    with refused("rlpipe rollback", (ResumeRefused,), code=4):
        summary = _run(plan)
    _tag_versions(tracker, plan)
    from rlpipe.cli.run_cmds import print_rl

    print_rl(summary)
    typer.echo(summary["_path"])


def _check_dataset(plan) -> None:
    """The new run must train on the save point's dataset version: the dataset its config names is built (and
    stored, as the run would) and compared before anything moves."""
    from rlpipe.rollback import RollbackError
    from tasks.data import prepare_dataset

    now = prepare_dataset.fn(plan.config)["version"]
    if plan.dataset_version and now != plan.dataset_version:
        raise RollbackError(
            f"task.dataset={plan.config.task.dataset} is now dataset version {now[:16]}, run {plan.run_id} trained "
            f"on {plan.dataset_version[:16]}: restore that file (the store keeps the old version under datasets/) "
            "and run the rollback again; nothing was moved")


def _check_new_run(tracker, plan) -> None:
    """A new run id already taken is refused unless it is this same rollback, run again (it resumes)."""
    from rlpipe.rollback import RollbackError

    existing = tracker.find_run(plan.config.tracking.experiment, plan.new_run_id)
    if existing is None:
        return
    parent = tracker.client.get_run(existing).data.tags.get("rlpipe.parent_version")
    if parent != f"{plan.name}/{plan.version}":
        raise RollbackError(f"run id {plan.new_run_id} is taken (MLflow run {existing}, parent {parent or 'none'}): "
                            "pass --run-id NEW_ID")


def _start_tracking(tracker, plan) -> None:
    """The new run's MLflow run, made now with the parent's tags (the flow finds it and goes on in it)."""
    from rlpipe.rollback import lineage_tags

    rid = tracker.start_run(plan.config, plan.new_run_id, "rl", plan.dataset_version or None)
    for k, v in lineage_tags(plan, "rlpipe.parent_").items():
        tracker.client.set_tag(rid, k, v)


def _run(plan) -> dict:
    from rlpipe.cli.run_cmds import run_rl

    return run_rl(plan.config, plan.new_run_id)


def _tag_versions(tracker, plan) -> None:
    """The new run's versions name the parent (its first one's ``parent_version`` is the save point already)."""
    from rlpipe.rollback import lineage_tags, run_versions

    for mv in run_versions(tracker, plan.new_run_id):
        for k, v in lineage_tags(plan, "rollback_parent_").items():
            tracker.client.set_model_version_tag(mv.name, mv.version, k, v)
