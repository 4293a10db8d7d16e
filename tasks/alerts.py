"""Alerts as Prefect events, the automations that act on them, and a run that honours a cancel.

An alert (:mod:`rlpipe.alerts`) becomes the event ``rlpipe.alert.<rule>`` about the resource
``rlpipe.run.<run id>``, labelled with its rule and severity, related to the ``rl-train`` flow run
(so ``cancel-flow-run`` with an inferred source cancels the run) and, through Prefect's run context,
to its flow, deployment and work pool. ``infra/prefect/automations.yaml`` holds the automations
``rlpipe automations install`` puts on the server.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rlpipe.config import RunConfig
from tasks._log import run_logger

AUTOMATIONS_FILE = Path(__file__).resolve().parents[1] / "infra" / "prefect" / "automations.yaml"
EVENT_PREFIX = "rlpipe.alert."


def emit_alerts(run_id: str, iteration: int, alerts: list[dict[str, Any]], flow_run_id: str | None) -> list[str]:
    """One Prefect event per alert; returns the events' ids (none when no API accepts events)."""
    from prefect.events import emit_event

    ids = []
    related = [{"prefect.resource.id": f"prefect.flow-run.{flow_run_id}", "prefect.resource.role": "flow-run"}] \
        if flow_run_id else None
    for a in alerts:
        ev = emit_event(
            event=f"{EVENT_PREFIX}{a['rule']}",
            resource={"prefect.resource.id": f"rlpipe.run.{run_id}", "prefect.resource.name": run_id,
                      "rlpipe.rule": a["rule"], "rlpipe.severity": a["severity"]},
            related=related,
            payload={"iteration": iteration, "message": a["message"], "value": a["value"], "severity": a["severity"]},
        )
        if ev is not None:
            ids.append(str(ev.id))
    return ids


def cancel_requested(flow_run_id: str | None) -> str | None:
    """The reason when this flow run was set to Cancelling/Cancelled (an automation, the UI, the CLI)."""
    if not flow_run_id:
        return None
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
    if state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED):
        return state.message or state.name
    return None


def _automations_listening() -> bool:
    """Whether an enabled automation on the server expects rlpipe alert events (else nothing will act)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        autos = client.read_automations()
    return any(a.enabled and any(e.startswith(EVENT_PREFIX.rstrip(".")) for e in getattr(a.trigger, "expect", ()) or ())
               for a in autos)


def raise_alerts(config: RunConfig, run_id: str, iteration: int, alerts: list[dict[str, Any]]) -> str | None:
    """Emit the iteration's alerts as events; after a critical one, wait up to ``alerts.critical_grace_s``
    for an automation to cancel this run. Returns the cancellation's reason, or None to go on."""
    from prefect.runtime import flow_run

    if not alerts or not config.alerts.events:
        return None
    me = flow_run.id
    ids = emit_alerts(run_id, iteration, alerts, me)
    run_logger().info("iteration %d: %d alert event(s) emitted (%s)", iteration, len(ids),
                      ", ".join(f"{a['severity']} {a['rule']}" for a in alerts))
    if not any(a["severity"] == "critical" for a in alerts) or not config.alerts.critical_grace_s:
        return None
    try:
        if not _automations_listening():
            run_logger().warning("critical alert, but no enabled automation on the server acts on rlpipe alerts: "
                                 "the run goes on (install them: rlpipe automations install)")
            return None
    except Exception as e:  # noqa: BLE001 - no API (a bare `python -m`): nothing can act
        run_logger().warning("could not read the server's automations (%s): the run goes on", e)
        return None
    deadline = time.monotonic() + config.alerts.critical_grace_s
    while time.monotonic() < deadline:
        if reason := cancel_requested(me):
            return reason
        time.sleep(0.5)
    return None


def install_automations(path: Path = AUTOMATIONS_FILE, audit: Any = None) -> list[tuple[str, str]]:
    """Create or update (by name) every automation in ``path`` on the current Prefect API; returns
    (name, "created" | "updated" | "skipped: <why>") pairs. Repeatable: a second install changes nothing but the
    definitions. An action's ``deployment: FLOW/NAME`` is looked up and written as its ``deployment_id``; an
    automation whose deployment is not on the server is skipped, naming the command that deploys it.
    ``audit`` (an :class:`rlpipe.audit.AuditLog`) records the install, once all are valid, before any is written."""
    import yaml
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import AutomationCore

    data = yaml.safe_load(Path(path).read_text())
    items = data.get("automations") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected a top-level 'automations:' list of automations")
    with get_client(sync_client=True) as client:
        items, skipped = _resolve_deployments(items, client)
    autos = []
    for k, item in enumerate(items):  # all checked before anything is written
        try:
            autos.append(AutomationCore.model_validate(item))
        except Exception as e:
            name = item.get("name", "?") if isinstance(item, dict) else "?"
            raise ValueError(f"{path}: automation #{k} ({name}) is not valid: {e}") from None
    skips = [(name, f"skipped: {why}") for name, why in skipped]
    if audit is None:
        return _install(autos) + skips
    from prefect.settings import PREFECT_API_URL

    with audit.change("automations.install", {"prefect_api": str(PREFECT_API_URL.value() or "ephemeral"), "file": str(path)},
                      {"automations": [a.name for a in autos]} | ({"skipped": dict(skipped)} if skipped else {})):
        return _install(autos) + skips


def _resolve_deployments(items: list[Any], client: Any) -> tuple[list[Any], list[tuple[str, str]]]:
    """The automations with each action's ``deployment: FLOW/NAME`` replaced by the deployment's id (Prefect's
    run-deployment and pause-deployment actions take an id, known only once deployed), and (name, why) for each left
    out because a deployment it names is not on the server."""
    from prefect.exceptions import ObjectNotFound

    out, skipped = [], []
    for item in items:
        if not isinstance(item, dict) or not any(isinstance(a, dict) and "deployment" in a for a in item.get("actions") or ()):
            out.append(item)
            continue
        actions, missing = [], []
        for a in item["actions"]:
            if isinstance(a, dict) and "deployment" in a:
                try:
                    a = {k: v for k, v in a.items() if k != "deployment"} | {
                        "deployment_id": str(client.read_deployment_by_name(a["deployment"]).id)}
                except ObjectNotFound:
                    missing.append(str(a["deployment"]))
            actions.append(a)
        if missing:
            skipped.append((item.get("name", "?"), f"deployment {', '.join(missing)} is not on the server; deploy it "
                            f"(prefect deploy --name {' --name '.join(m.split('/')[-1] for m in missing)}) and install again"))
        else:
            out.append(item | {"actions": actions})
    return out, skipped


def _install(autos: list[Any]) -> list[tuple[str, str]]:
    from prefect.client.orchestration import get_client

    done = []
    with get_client(sync_client=True) as client:
        for auto in autos:
            existing = client.read_automations_by_name(auto.name)
            if existing:
                client.update_automation(existing[0].id, auto)
                done.append((auto.name, "updated"))
            else:
                client.create_automation(auto)
                done.append((auto.name, "created"))
    return done
