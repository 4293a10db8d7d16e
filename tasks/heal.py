"""The heal flow's Prefect side: read a failed ``rl-train`` flow run and the relaunches that led to it, relaunch it
from its deployment, pause the deployment, and mark the subflow runs a killed process left running as Crashed.
What to do is :mod:`rlpipe.healing`'s decision; ``flows/heal.py`` puts the two together.

A relaunch is a new flow run of the failed run's deployment with its parameters (the run id filled in), job
variables and work queue, tagged ``rlpipe-heal-attempt:<n>`` and ``rlpipe-relaunch-of:<failed flow run id>``: the
second tag is how the next heal finds the chain of failures before it, whatever the runs are named.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from rlpipe.healing import Decision, Failure, classify
from rlpipe.storage.layout import check_run_id

TRAIN_FLOW = "rl-train"
ATTEMPT_TAG = "rlpipe-heal-attempt:"
RELAUNCH_OF_TAG = "rlpipe-relaunch-of:"
FAILED_STATES = ("CRASHED", "FAILED")
_UNDER_WAY = ["SCHEDULED", "PENDING", "RUNNING", "PAUSED"]


@dataclass
class Case:
    """What the heal flow found about a failed run: its run id, the decision, its failure, its deployment's name
    (``rl-train/NAME``), and the subflow runs it marked Crashed."""

    run_id: str | None
    decision: Decision
    failure: Failure | None
    deployment: str = ""
    orphans: list[str] = field(default_factory=list)


def flow_run_uuid(text: str) -> UUID:
    """The flow run id in ``prefect.flow-run.<id>`` (the triggering event's resource, what the automation passes)
    or in a bare id."""
    raw = str(text).strip().removeprefix("prefect.flow-run.")
    try:
        return UUID(raw)
    except ValueError:
        raise ValueError(f"flow_run {text!r}: expected a flow run id or prefect.flow-run.<id>") from None


def read_train_run(client: Any, flow_run_id: UUID) -> Any:
    """The flow run, checked to be an RL run (``rl-train``): no other flow is resumable by its run id."""
    run = client.read_flow_run(flow_run_id)
    flow = client.read_flow(run.flow_id)
    if flow.name != TRAIN_FLOW:
        raise ValueError(f"flow run {run.name} ({run.id}) is a run of {flow.name}, not {TRAIN_FLOW}: only RL runs "
                         "are healed (check the automation's match_related)")
    return run


def failure_of(run: Any) -> Failure | None:
    """The failure the run's final state records; None while it is not Crashed or Failed."""
    state = run.state
    if state is None or state.type.value not in FAILED_STATES:
        return None
    return classify(state.type.value, state.message)


def run_id_of(run: Any) -> str | None:
    """The RL run id: the ``run_id`` parameter, else the flow run's name (a run started without one names its
    flow run after the id it made up); None when neither is one (it crashed before it had an id)."""
    rid = (run.parameters or {}).get("run_id") or run.name
    try:
        return check_run_id(rid) if rid else None
    except ValueError:
        return None


def relaunched_from(run: Any) -> UUID | None:
    for t in run.tags or ():
        if t.startswith(RELAUNCH_OF_TAG):
            return UUID(t[len(RELAUNCH_OF_TAG):])
    return None


def failure_chain(client: Any, run: Any) -> list[Failure]:
    """The run's failures in a row, oldest first: ``run``'s and, through the relaunch tags, those of each flow run
    whose relaunch led to it. A person's new start (no tag) begins a new chain."""
    from prefect.exceptions import ObjectNotFound

    out: list[Failure] = []
    seen: set[UUID] = set()
    while run is not None and run.id not in seen and (f := failure_of(run)) is not None:
        seen.add(run.id)
        out.append(f)
        prev = relaunched_from(run)
        try:
            run = client.read_flow_run(prev) if prev else None
        except ObjectNotFound:  # deleted from the server: the chain starts after it
            run = None
    return out[::-1]


def started_again(client: Any, run: Any, run_id: str) -> list[Any]:
    """``rl-train`` flow runs of the same run id created after ``run`` (a relaunch, a person's resume), and any
    flow run relaunched from it: someone has acted already."""
    from prefect.client.schemas.filters import (
        FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterName, FlowRunFilterTags,
    )

    same = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[TRAIN_FLOW])),
                                 flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run_id])))
    tagged = client.read_flow_runs(flow_run_filter=FlowRunFilter(
        tags=FlowRunFilterTags(all_=[f"{RELAUNCH_OF_TAG}{run.id}"])))
    later = {r.id: r for r in same if r.id != run.id and r.created and run.created and r.created > run.created}
    return list((later | {r.id: r for r in tagged}).values())


def crash_orphans(client: Any, run: Any) -> list[str]:
    """The subflow runs (``rl-iteration``) still scheduled, pending or running under a crashed run: its process is
    gone, so they never end by themselves. Each is set Crashed, naming its parent; returns their names."""
    from prefect.client.schemas.filters import (
        FlowRunFilter, FlowRunFilterParentFlowRunId, FlowRunFilterState, FlowRunFilterStateType,
    )
    from prefect.states import Crashed

    kids = client.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id]),
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=_UNDER_WAY))))
    for kid in kids:
        client.set_flow_run_state(kid.id, Crashed(message=f"its parent flow run {run.name} ({run.id}) crashed: "
                                                          f"{(run.state.message or '')[:300]}"), force=True)
    return [k.name for k in kids]


def relaunch(client: Any, run: Any, run_id: str, attempt: int, delay_s: float) -> Any:
    """A new flow run of ``run``'s deployment with its parameters (``run_id`` set, so it resumes), job variables and
    work queue, scheduled ``delay_s`` from now. Idempotent per failed run: a second call returns the first's."""
    from prefect.states import Scheduled

    tags = [t for t in run.tags or () if not t.startswith((ATTEMPT_TAG, RELAUNCH_OF_TAG))]
    when = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=delay_s)
    return client.create_flow_run_from_deployment(
        run.deployment_id, parameters=dict(run.parameters or {}) | {"run_id": run_id}, name=run_id,
        tags=tags + [f"{ATTEMPT_TAG}{attempt}", f"{RELAUNCH_OF_TAG}{run.id}"], state=Scheduled(scheduled_time=when),
        idempotency_key=f"rlpipe-heal:{run.id}", work_queue_name=run.work_queue_name,
        job_variables=run.job_variables or None)


def deployment_of(client: Any, run: Any) -> Any | None:
    """The run's deployment, None when it has none or it was deleted."""
    from prefect.exceptions import ObjectNotFound

    if run.deployment_id is None:
        return None
    try:
        return client.read_deployment(run.deployment_id)
    except ObjectNotFound:
        return None


def triggered_by(client: Any) -> str:
    """What started this flow run (``AUTOMATION rlpipe-heal-failed-run``, a user, a deployment), for the record."""
    from prefect.runtime import flow_run

    me = flow_run.get_id()
    by = client.read_flow_run(me).created_by if me else None
    return f"{by.type} {by.display_value}".strip() if by else "a direct call"
