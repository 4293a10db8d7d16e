"""prefect.yaml's schedule and event trigger on a real local Prefect server: the nightly evaluation's
schedule creates runs at 03:00 UTC, and registering a checkpoint (rlpipe's ``rlpipe.checkpoint.registered``
event) starts an ``evaluate`` run of that version, which a process worker runs to completion and which
moves ``@best`` (no best before it)."""

import json
import subprocess
import sys
import time
from datetime import datetime

from tests.flows.test_evaluate_flow import own_answers_task
from tests.helpers.prefect_server import PREFECT, ROOT, prefect_server

NAME = "trigtest"
# A checkpoint registered the way an sft/train run does it: inside a flow run, through the task.
REGISTER = """
import sys
from prefect import flow
from rlpipe.config import RunConfig, settings
from rlpipe.tracking.mlflow_utils import Tracker
from tasks.tracking import register_checkpoint

cfg = RunConfig.model_validate_json(sys.argv[1])

@flow(name="register-for-test")
def reg():
    rid = Tracker(settings(), cfg).start_run(cfg, "trig-src", "sft")
    return register_checkpoint(cfg, "trig-src", rid, {"checkpoint_uri": sys.argv[2], "weights_sha256": "a" * 64},
                               "d" * 64, 0, aliases=("latest",))

print("VERSION", reg()["version"])
"""


def _deployment_runs(server, deployment_id):
    return server.post("/flow_runs/filter", {"deployments": {"id": {"any_": [deployment_id]}}, "sort": "EXPECTED_START_TIME_ASC"})


def _wait(what, fn, timeout=90):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got or time.monotonic() > deadline:
            assert got, f"{what}: nothing after {timeout} s"
            return got
        time.sleep(1)


def test_nightly_schedule_and_registration_trigger(tiny_checkpoint, tmp_path):
    env_extra = {"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
                 "RLPIPE_HOME": str(tmp_path / "home"), "RLPIPE_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    with prefect_server(tmp_path, env_extra) as server:
        def cli(*args, timeout=300):
            p = subprocess.run([PREFECT, *args], env=server.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
            assert p.returncode == 0, f"prefect {' '.join(args)}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
            return p.stdout

        cli("work-pool", "create", "rlpipe-local", "--type", "process")
        cli("--no-prompt", "deploy", "--name", "evaluate-nightly", "--name", "evaluate-on-registration")
        deps = {d["name"]: d for d in server.post("/deployments/filter", {})}
        nightly, on_reg = deps["evaluate-nightly"], deps["evaluate-on-registration"]

        # The schedule: the scheduler service creates the next runs, each at 03:00 UTC on consecutive days.
        runs = _wait("scheduled runs", lambda: _deployment_runs(server, nightly["id"]))
        starts = [datetime.fromisoformat(r["expected_start_time"].replace("Z", "+00:00")) for r in runs]
        assert len(runs) >= 3 and all((t.hour, t.minute, t.utcoffset().total_seconds()) == (3, 0, 0) for t in starts), starts
        assert all((b - a).days == 1 for a, b in zip(starts, starts[1:])), starts
        assert {r["state"]["type"] for r in runs} == {"SCHEDULED"}
        assert runs[0]["parameters"] == {"model": "models:/rlpipe-arithmetic@best", "suite": ["gsm8k", "math500", "humaneval", "mbpp"],
                                         "overrides": [], "experiment": "rlpipe-evals"}

        # The trigger: a registration's event starts evaluate on that version, which a worker runs.
        data = own_answers_task(tmp_path / "own.jsonl", tiny_checkpoint)
        cfg = {"task": {"name": NAME, "dataset": str(data)}, "tracking": {"experiment": NAME},
               "rollout": {"engine": "hf", "max_new_tokens": 6}, "reward": {"workers": 1}}
        out = subprocess.run([sys.executable, "-c", REGISTER, json.dumps(cfg), str(tiny_checkpoint)], env=server.env,
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        version = out.stdout.split("VERSION")[-1].strip()
        event = server.wait_events("rlpipe.checkpoint.registered", lambda e: len(e) >= 1)[0]
        assert event["payload"]["model_uri"] == f"models:/rlpipe-{NAME}/{version}"
        assert event["resource"]["rlpipe.model.kind"] == "policy"
        triggered = _wait("triggered run", lambda: _deployment_runs(server, on_reg["id"]))
        assert len(triggered) == 1 and triggered[0]["parameters"]["model"] == f"models:/rlpipe-{NAME}/{version}"
        cli("worker", "start", "--pool", "rlpipe-local", "--run-once", timeout=600)
        done = server.flow_run(triggered[0]["id"])
        assert done["state"]["type"] == "COMPLETED", done["state"]
        best = subprocess.run(
            [sys.executable, "-c", "from rlpipe.config import settings\nfrom rlpipe.tracking.mlflow_utils import Tracker\n"
             f"print(Tracker(settings()).version_by_alias('rlpipe-{NAME}', 'best').version)"],
            env=server.env, capture_output=True, text=True, timeout=120)
        assert best.stdout.strip() == version, best.stderr[-2000:]
