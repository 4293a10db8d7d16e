"""Run against a real Prefect server (PREFECT_API_URL), with no worker: a deployment of ``rl-train`` whose flow
runs end the way each step says (the state set on the server, as a process worker or the engine sets it), each
healed by the ``rl-heal`` flow called directly. A step acts on the latest relaunch of the chain (the first on a new
flow run of the deployment); a step with ``"again": true`` heals the flow run the step before healed once more.

    python -m tests.helpers.heal_steps '{"oom": {"deployment": "train-x", "run_id": "rl-x", "policy": {...},
                                                 "steps": [{"state": "CRASHED", "message": "..."}, ...]}, ...}'

Prints one JSON line: {scenario: {"deployment_id": ..., "steps": [{"flow_run_id": ..., "result": <heal's return>}]}}.
"""

from __future__ import annotations

import json
import sys

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectNotFound
from prefect.states import State, StateType

from flows.heal import heal
from rlpipe.config import RunConfig


def main(scenarios: dict[str, dict]) -> None:
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool("rlpipe-local")
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name="rlpipe-local", type="process"))
        flow_id = client.create_flow_from_name("rl-train")
        print(json.dumps({name: _scenario(client, flow_id, spec) for name, spec in scenarios.items()}))


def _scenario(client, flow_id, spec: dict) -> dict:
    dep = client.create_deployment(flow_id=flow_id, name=spec["deployment"], work_pool_name="rlpipe-local",
                                   parameters={}, entrypoint="flows/train.py:train")
    params = {"config": RunConfig().model_dump(mode="json"), "run_id": spec["run_id"]}
    run = client.create_flow_run_from_deployment(dep, parameters=params, name=spec["run_id"])
    out, healed = [], run
    for step in spec["steps"]:
        if not step.get("again"):
            healed = run
            client.set_flow_run_state(run.id, State(type=StateType(step["state"]), message=step["message"]), force=True)
        result = heal(flow_run=f"prefect.flow-run.{healed.id}", policy=spec["policy"])
        out.append({"flow_run_id": str(healed.id), "result": result})
        if result["relaunched_flow_run"]:
            run = client.read_flow_run(result["relaunched_flow_run"])
    return {"deployment_id": str(dep), "steps": out}


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
