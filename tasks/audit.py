"""The audit trail's Prefect side (:mod:`rlpipe.audit` holds the rest): a record as the event
``rlpipe.audit.<action>``, and the log of this process, whose actor names the flow run and deployment it
runs in."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rlpipe.audit import AuditLog, AuditRecord, who
from rlpipe.config import Settings, settings

EVENT_PREFIX = "rlpipe.audit."


def resource_of(rec: AuditRecord) -> dict[str, str]:
    """The event's resource: the model or run the change touched (``rlpipe.model.<name>``, ``rlpipe.run.<id>``,
    the names the registration and alert events use), else ``rlpipe.<first word of the action>``."""
    t = rec.target
    if "model" in t:
        rid, name = f"rlpipe.model.{t['model']}", str(t["model"])
    elif "run_id" in t:
        rid, name = f"rlpipe.run.{t['run_id']}", str(t["run_id"])
    else:
        rid = name = f"rlpipe.{rec.action.split('.')[0]}"
    return {"prefect.resource.id": rid, "prefect.resource.name": name, "rlpipe.audit.id": rec.id,
            "rlpipe.identity": rec.who.get("identity", "")}


def emit_audit_event(rec: AuditRecord) -> None:
    """The record as a Prefect event, related to the flow run that made the change (when one did)."""
    from prefect.events import emit_event

    run = rec.who.get("prefect_flow_run_id")
    related = [{"prefect.resource.id": f"prefect.flow-run.{run}", "prefect.resource.role": "flow-run"}] if run else None
    emit_event(event=f"{EVENT_PREFIX}{rec.action}", resource=resource_of(rec), related=related, payload=asdict(rec))


def _prefect_actor() -> dict[str, str | None]:
    from prefect.runtime import deployment, flow_run

    return {"prefect_flow_run_id": flow_run.get_id(), "prefect_flow_run": flow_run.get_name(),
            "prefect_deployment_id": deployment.get_id()}


def audit_log(store: Any = None, s: Settings | None = None) -> AuditLog:
    """This process's audit log in ``store`` (default: the settings' store). Events go out inside a flow run and
    wherever a Prefect API is configured (``PREFECT_API_URL``, in the environment or the profile); a command run outside both sends none, rather
    than starting an ephemeral Prefect server to hold one event (the store's record is written either way)."""
    from prefect.settings import PREFECT_API_URL

    from rlpipe.storage import open_store

    s = s or settings()
    extra = _prefect_actor()
    events = bool(extra["prefect_flow_run_id"] or PREFECT_API_URL.value())
    return AuditLog(store if store is not None else open_store(None, s), actor=who(s, extra),
                    emit=emit_audit_event if events else None)
