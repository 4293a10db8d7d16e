"""Runs that heal themselves: the ``rl-heal`` flow, which the automation ``rlpipe-heal-failed-run``
(infra/prefect/automations.yaml) starts from the ``heal`` deployment when an ``rl-train`` flow run of a deployment
ends Crashed or Failed.

It reads the failed run, classifies the failure and counts the relaunches before it (:mod:`rlpipe.healing`), and
then, writing an audit record first (``heal.relaunch`` / ``heal.pause``; ``heal.give_up`` and ``heal.skip`` say why
nothing was done):

- **relaunches** it — a new flow run of the same deployment with the same parameters and run id, so it resumes
  after its last save point — after an exponential backoff, at most ``policy.max_attempts`` times in a row;
- **pauses the deployment** instead once ``policy.pause_after`` failures of the chain are of one kind (out of
  memory three times: a fourth try would too, and the deployment's schedule would keep starting it);
- **leaves it** when a relaunch cannot help (a refused resume, a config or dataset error, a guard's stop), when
  it has no deployment or no run id yet, when the run was started again already, or when its deployment is paused.

A crashed run's process is gone, so the ``rl-iteration`` flow run it was in stays Running on the server; the heal
flow marks such subflow runs Crashed too.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from rlpipe.audit import AuditError, AuditLog, AuditRecord, set_tag
from rlpipe.config import RunConfig, settings
from rlpipe.healing import Decision, HealPolicy, decide
from tasks._log import run_logger
from tasks.audit import audit_log
from tasks.heal import (
    TRAIN_FLOW, Case, crash_orphans, deployment_of, failure_chain, failure_of, flow_run_uuid, read_train_run, relaunch,
    run_id_of, started_again, triggered_by,
)


def _heal_name() -> str:
    from prefect.runtime import flow_run

    raw = str(flow_run.parameters.get("flow_run", "")).removeprefix("prefect.flow-run.")
    return f"heal-{raw[:8]}"


@flow(name="rl-heal", flow_run_name=_heal_name)
def heal(flow_run: str = "", policy: HealPolicy = HealPolicy()) -> dict[str, Any]:
    """Relaunch a crashed or failed RL run with the same run id (it resumes after its last save point), with bounded
    attempts and backoff; pause its deployment after repeated failures of one kind; or say why it is left.

    Args:
        flow_run: The failed rl-train flow run: its id, or the event resource prefect.flow-run.<id> (what the
            automation rlpipe-heal-failed-run passes).
        policy: Relaunches in a row, their backoff, and after how many failures of one kind the deployment is paused.
    """
    from prefect.client.orchestration import get_client

    if not flow_run:
        raise ValueError("flow_run is empty: the automation rlpipe-heal-failed-run passes the failed rl-train flow "
                         "run; to heal one by hand: prefect deployment run rl-heal/heal --param flow_run=<its id>")
    with get_client(sync_client=True) as client:
        run = read_train_run(client, flow_run_uuid(flow_run))
        case = _examine(client, run, policy)
        return _act(client, run, case, policy)


def _examine(client: Any, run: Any, policy: HealPolicy) -> Case:
    """The decision for ``run``: :func:`rlpipe.healing.decide` on its chain of failures, unless there is nothing a
    relaunch from here could do."""
    failure, run_id, dep = failure_of(run), run_id_of(run), deployment_of(client, run)
    orphans = crash_orphans(client, run) if failure is not None and run.state.is_crashed() else []
    case = Case(run_id, Decision("skip", ""), failure, f"{TRAIN_FLOW}/{dep.name}" if dep else "", orphans)
    if failure is None:
        why = f"its flow run is {run.state.type.value if run.state else 'without a state'} now, not crashed or failed"
    elif dep is None:
        why = ("it was not started from a deployment (rlpipe run, a script), so no worker can start it again: "
               f"resume it with `rlpipe run --run-id {run_id or 'RUN_ID'}`")
    elif run_id is None:
        why = "it stopped before it had a run id: there is nothing to resume"
    elif again := started_again(client, run, run_id):
        why = f"run {run_id} was started again already: " + ", ".join(
            f"flow run {r.id} ({r.state.type.value if r.state else '?'})" for r in again)
    elif dep.paused:
        why = (f"its deployment {case.deployment} is paused: resume it (prefect deployment resume {case.deployment}) "
               f"and start run {run_id} again")
    else:
        case.decision = decide(failure_chain(client, run), policy)
        return case
    case.decision = Decision("skip", why)
    return case


def _act(client: Any, run: Any, case: Case, policy: HealPolicy) -> dict[str, Any]:
    """Carry the decision out, its audit record first; the log says what was done and what a person can do."""
    d, log = case.decision, run_logger()
    audit, config = _audit_for(run)
    target = {"run_id": case.run_id or run.name, "flow_run": str(run.id), "deployment": case.deployment}
    details = {"reason": d.reason, "kind": case.failure.kind if case.failure else None,
               "state": run.state.type.value if run.state else None, "max_attempts": policy.max_attempts,
               "pause_after": policy.pause_after, "triggered_by": triggered_by(client)}
    details |= ({"attempt": d.attempt, "delay_s": d.delay_s} if d.action == "relaunch" else {}) | (
        {"orphans_crashed": case.orphans} if case.orphans else {})
    what = f"run {case.run_id or run.name} (flow run {run.name}, {run.id})"
    new = None
    if d.action == "relaunch":
        with audit.change("heal.relaunch", target, details) as rec:
            new = relaunch(client, run, case.run_id, d.attempt, d.delay_s)
        log.warning("%s: %s; relaunched as flow run %s (attempt %d of %d) in %g s: it resumes after its last save "
                    "point", what, d.reason, new.id, d.attempt, policy.max_attempts, d.delay_s)
    elif d.action == "pause":
        with audit.change("heal.pause", target, details) as rec:
            client.pause_deployment(run.deployment_id)
        log.error("%s is not relaunched and deployment %s is paused: %s. Fix the cause, then `prefect deployment resume "
                  "%s` and start run %s again with its parameters (Retry on flow run %s in the Prefect UI)", what,
                  case.deployment, d.reason, case.deployment, case.run_id, run.id)
    else:
        rec = _note(audit, f"heal.{d.action}", target, details)
        log.warning("%s is not relaunched: %s", what, d.reason if d.action == "skip" else f"{d.reason}. Once the cause "
                    f"is fixed, start it again with the same parameters (Retry on flow run {run.id} in the Prefect UI, "
                    f"or a run of {case.deployment} with its config and run_id {case.run_id})")
    if case.orphans:
        log.info("marked Crashed the subflow runs the killed process left running: %s", ", ".join(case.orphans))
    _tag_run(config, case.run_id, rec)
    return {"action": d.action, "reason": d.reason, "run_id": case.run_id, "attempt": d.attempt, "delay_s": d.delay_s,
            "relaunched_flow_run": str(new.id) if new else None, "audit_id": rec.id if rec else None}


def _audit_for(run: Any) -> tuple[AuditLog, RunConfig | None]:
    """The audit log in the failed run's object store (its config's, else the settings'), and its config."""
    from rlpipe.storage import open_store

    s = settings()
    try:
        config = RunConfig.model_validate((run.parameters or {}).get("config") or {})
    except ValueError:  # a config error: the run is not relaunched, and the record goes to the default store
        config = None
    return audit_log(open_store(s.resolve_storage_uri(config), s), s), config


def _note(audit: AuditLog, action: str, target: dict[str, Any], details: dict[str, Any]) -> AuditRecord | None:
    """A record of a decision that changed nothing (no relaunch, no pause): one that cannot be written is logged."""
    try:
        rec = audit.write(action, target, details)
    except AuditError as e:
        run_logger().error("%s", e)
        return None
    audit.announce(rec)
    return rec


def _tag_run(config: RunConfig | None, run_id: str | None, rec: AuditRecord | None) -> None:
    """The record's tag on the run's MLflow run, where there is one."""
    if config is None or run_id is None or rec is None:
        return
    from rlpipe.tracking.mlflow_utils import Tracker

    try:
        tracker = Tracker(settings(), config)
        mlflow_run = tracker.find_run(config.tracking.experiment, run_id)
    except Exception as e:  # noqa: BLE001 - the store's record stands; the tag is a pointer to it
        run_logger().warning("run %s: its MLflow run could not be read (%s: %s); the audit record is %s", run_id,
                             type(e).__name__, e, rec.id)
        return
    if mlflow_run:
        set_tag(lambda k, v: tracker.client.set_tag(mlflow_run, k, v), rec, f"MLflow run {mlflow_run}")
