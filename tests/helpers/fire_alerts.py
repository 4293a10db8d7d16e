"""Run against a real Prefect server (PREFECT_API_URL): fire each named rule's hand-made case from
tests/test_alerts.py inside a flow run, through the same ``raise_alerts`` the rl-train flow calls after an
iteration. A cancelled run returns Cancelled, as rl-train does. ``--critical`` raises every rule at
severity critical; ``--deployment`` runs each from a deployment's flow run (what the pause-deployment
automation needs). Prints one JSON line:
{rule: {"flow_run_id", "state", "message", "deployment_id"}}."""

from __future__ import annotations

import json
import sys

from prefect import flow
from prefect.states import Cancelled

from rlpipe.alerts import evaluate
from rlpipe.config import RunConfig
from tasks.alerts import raise_alerts
from tests.test_alerts import BASE, CASES


@flow(name="fire-alert")
def fire(rule: str, critical: bool = False):
    overrides, history, firing, _ = CASES[rule]
    if critical:  # every rule can be made one the automations act on
        overrides = overrides | {rule: overrides.get(rule, {}) | {"severity": "critical"}}
    config = RunConfig.model_validate({"alerts": overrides | {"critical_grace_s": 60}})
    fired, _ = evaluate(config, BASE | firing, history)
    alerts = [a.as_dict() for a in fired if a.rule == rule]
    assert alerts, f"{rule} did not fire"
    if reason := raise_alerts(config, f"alert-{rule}{'-critical' if critical else ''}", 0, alerts):
        return Cancelled(message=reason)
    return "went on"


def _via_deployment(rule: str):
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow

    with get_client(sync_client=True) as client:
        dep = client.create_deployment(flow_id=client.create_flow(fire), name=f"alerts-{rule}")
        run = client.create_flow_run_from_deployment(dep, parameters={"rule": rule})
    return run_flow(fire, flow_run=run, parameters={"rule": rule}, return_type="state"), str(dep)


def main(rules: list[str], deployment: bool, critical: bool) -> None:
    out = {}
    for rule in rules:
        state, dep = _via_deployment(rule) if deployment else (fire(rule, critical, return_state=True), None)
        out[rule] = {"flow_run_id": str(state.state_details.flow_run_id), "state": state.type.value,
                     "message": state.message, "deployment_id": dep}
    print(json.dumps(out))


if __name__ == "__main__":
    args = sys.argv[1:]
    main([a for a in args if not a.startswith("--")], "--deployment" in args, "--critical" in args)
