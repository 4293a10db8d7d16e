"""Alerts as Prefect events on a real local Prefect server, and the shipped automations acting on them:
every rule fired deliberately lands as an event with its severity; a critical one cancels the flow run
and pauses its deployment; a real RL run is cancelled between iterations and resumes afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlpipe.alerts import RULES
from rlpipe.config import RunConfig, settings
from rlpipe.history import read_history
from tests.flows.test_train_flow import even_task, rl_overrides  # noqa: F401 - fixture re-used
from tests.helpers.prefect_server import ROOT, prefect_server

NAMES = ["rlpipe-cancel-run-on-critical-alert", "rlpipe-pause-deployment-on-critical-alert"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with prefect_server(tmp_path_factory.mktemp("prefect-real")) as s:
        yield s


def py(server, code_or_args: list[str], timeout: int = 600, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *code_or_args], env=server.env | {"OMP_NUM_THREADS": "1"} | env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def rlpipe(server, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    code = "import sys; from rlpipe.cli import main; sys.argv = ['rlpipe'] + sys.argv[1:]; main()"
    return py(server, ["-c", code, *args], timeout=timeout)


@pytest.fixture(scope="module")
def installed(server):
    first, again = rlpipe(server, "automations", "install"), rlpipe(server, "automations", "install")
    assert first.returncode == 0 and again.returncode == 0, first.stderr[-3000:] + again.stderr[-3000:]
    autos = server.post("/automations/filter", {})
    return first.stdout, again.stdout, {a["name"]: a for a in autos}


def test_doctor_says_whether_automations_act_on_alerts(server, monkeypatch):
    from rlpipe.doctor import _prefect_api

    monkeypatch.setenv("PREFECT_API_URL", server.api)
    assert "no automation acts on rlpipe alerts (install them: rlpipe automations install)" in _prefect_api(RunConfig(), settings())


def test_install_creates_the_automations_once_and_updates_them_after(installed, server, monkeypatch):
    from rlpipe.doctor import _prefect_api

    monkeypatch.setenv("PREFECT_API_URL", server.api)
    assert f"2 automation(s) act on rlpipe alerts ({', '.join(NAMES)})" in _prefect_api(RunConfig(), settings())
    first, again, autos = installed
    assert first.split() == ["created", NAMES[0], "created", NAMES[1]]
    assert again.split() == ["updated", NAMES[0], "updated", NAMES[1]]
    assert sorted(autos) == sorted(NAMES) and all(a["enabled"] for a in autos.values())  # no duplicates
    assert [x["type"] for x in autos[NAMES[0]]["actions"]] == ["cancel-flow-run"]


def test_every_rule_fires_an_event_and_a_critical_one_cancels_its_run(server, installed):
    _, _, autos = installed
    res = py(server, ["-m", "tests.helpers.fire_alerts", *sorted(RULES)], timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    runs = json.loads(res.stdout.strip().splitlines()[-1])
    want = {f"rlpipe.run.alert-{rule}" for rule in RULES}
    found = server.wait_events("rlpipe.alert.", lambda evs: want <= {e["resource"]["prefect.resource.id"] for e in evs})
    events = {e["resource"]["prefect.resource.id"]: e for e in found}
    defaults = RunConfig().alerts
    for rule in RULES:
        ev = events[f"rlpipe.run.alert-{rule}"]
        severity = getattr(defaults, rule).severity
        assert ev["event"] == f"rlpipe.alert.{rule}" and ev["resource"]["rlpipe.severity"] == severity
        assert ev["payload"]["message"] and ev["payload"]["iteration"] == 0
        # The run's flow run is the first related flow run: what an inferred action acts on.
        flow_runs = [r["prefect.resource.id"] for r in ev["related"] if r["prefect.resource.id"].startswith("prefect.flow-run.")]
        assert flow_runs[0] == f"prefect.flow-run.{runs[rule]['flow_run_id']}"
        state = server.flow_run(runs[rule]["flow_run_id"])["state"]
        if severity == "critical":
            assert runs[rule]["state"] == "CANCELLED" == state["type"], (rule, runs[rule])
            assert f"Cancelled by Automation {autos[NAMES[0]]['id']}" in runs[rule]["message"]
        else:
            assert runs[rule]["state"] == "COMPLETED" == state["type"], (rule, runs[rule])
    assert {r for r in RULES if getattr(defaults, r).severity == "critical"} == {"reward_flat", "nonfinite_loss"}


def test_every_rule_raised_as_critical_is_acted_on(server, installed):
    """Any rule a config sets to critical reaches the automation: each of its runs is cancelled by it."""
    _, _, autos = installed
    res = py(server, ["-m", "tests.helpers.fire_alerts", "--critical", *sorted(RULES)], timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    runs = json.loads(res.stdout.strip().splitlines()[-1])
    for rule, run in runs.items():
        assert run["state"] == "CANCELLED" == server.flow_run(run["flow_run_id"])["state"]["type"], (rule, run)
        assert f"Cancelled by Automation {autos[NAMES[0]]['id']}" in run["message"]
    want = {f"rlpipe.run.alert-{rule}-critical" for rule in RULES}
    found = server.wait_events("rlpipe.alert.", lambda evs: want <= {e["resource"]["prefect.resource.id"] for e in evs})
    assert {e["resource"]["rlpipe.severity"] for e in found if e["resource"]["prefect.resource.id"] in want} == {"critical"}


def test_a_critical_alert_pauses_the_deployment_its_run_came_from(server, installed):
    res = py(server, ["-m", "tests.helpers.fire_alerts", "--deployment", "nonfinite_loss"], timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    run = json.loads(res.stdout.strip().splitlines()[-1])["nonfinite_loss"]
    assert run["state"] == "CANCELLED"
    deadline = time.monotonic() + 60  # the pause acts on its own schedule, not the run's
    while not server.get(f"/deployments/{run['deployment_id']}")["paused"] and time.monotonic() < deadline:
        time.sleep(1)
    assert server.get(f"/deployments/{run['deployment_id']}")["paused"] is True


@pytest.fixture(scope="module")
def zero_task(even_task) -> Path:
    """The even task's prompts scored by a verifier that always gives 0: every batch is flat."""
    path = even_task.with_name("zero.jsonl")
    rows = [json.loads(line) | {"task": "test_zero"} for line in even_task.read_text().splitlines()]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_a_real_run_is_cancelled_by_the_automation_and_resumes(server, installed, tiny_checkpoint, zero_task):
    sets = rl_overrides(tiny_checkpoint, "rlalert", "hf", zero_task, iterations=3)
    args = ["run", "--run-id", "rl-alerted"] + [x for s in sets for x in ("--set", s)]
    res = rlpipe(server, *args, "--set", "alerts.reward_flat.for_iterations=1", "--set", "alerts.critical_grace_s=60")
    assert res.returncode == 5, res.stdout[-3000:] + res.stderr[-3000:]
    assert "cancelled after iteration 0" in res.stderr and "Cancelled by Automation" in res.stderr
    progress = json.loads((settings().run_dir("rl-alerted") / "progress.json").read_text())
    assert progress["completed_iteration"] == 0 and read_history(settings().run_dir("rl-alerted"))[0]["alerts/reward_flat"] == 1.0
    runs = {r["name"]: r["state"]["type"] for r in server.post("/flow_runs/filter", {})}
    assert runs["rl-alerted"] == "CANCELLED" and runs["rl-alerted-iter-0"] == "COMPLETED" and "rl-alerted-iter-1" not in runs
    from rlpipe.tracking.mlflow_utils import Tracker

    tracker = Tracker(settings(), RunConfig())
    mlrun = tracker.client.get_run(tracker.find_run("rlalert", "rl-alerted"))
    assert mlrun.info.status == "KILLED" and mlrun.data.metrics["alerts/reward_flat"] == 1.0
    # The same run id resumes after iteration 0; the alert's keys may change on a resume (they steer nothing).
    res = rlpipe(server, *args, "--set", "alerts.reward_flat.enabled=false")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads(Path(res.stdout.strip().splitlines()[-1]).read_text())
    assert summary["iterations_done"] == 3 and summary["heldout_accuracy_final"] is not None
    assert summary["alerts_fired"].get("reward_flat") == 1  # iteration 0's; the rule was off after the resume
    assert tracker.client.get_run(mlrun.info.run_id).info.status == "FINISHED"
