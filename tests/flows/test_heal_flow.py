"""Runs that heal themselves, on a real local Prefect server: the `train` and `heal` deployments of prefect.yaml, the
shipped automations, and a process worker. The worker's flow-run process is SIGKILLed in the middle of iteration 1;
the automation starts the heal flow, which relaunches the run with the same run id: it resumes after iteration 0 and
completes once, with one model version per iteration. A second test drives the heal flow over flow runs whose final
states are set on the server: repeated failures of one kind pause the deployment instead of relaunching forever."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from rlpipe.audit import AuditLog
from rlpipe.config import load_config, settings
from rlpipe.procs import stop_group
from rlpipe.storage import open_store
from tests.flows.test_train_flow import even_task, rl_overrides  # noqa: F401 - fixture re-used
from tests.helpers.prefect_server import PREFECT, ROOT, PrefectServer, prefect_server
from tests.test_healing import OOM_137, SIGKILL

TEST_POLICY = {"max_attempts": 3, "backoff_s": 1.0, "backoff_max_s": 10.0, "pause_after": 3}


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """An RLPIPE_HOME of this test's own, the worker's and this process's: the gate's glob sees only this run."""
    path = tmp_path / "home"
    path.mkdir()
    monkeypatch.setenv("RLPIPE_HOME", str(path))
    return path


@pytest.fixture
def gated_task(even_task, tmp_path) -> Path:
    path = tmp_path / "gated.jsonl"
    rows = [json.loads(line) | {"task": "test_gated"} for line in even_task.read_text().splitlines()]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def _call(server: PrefectServer, method: str, path: str, body: dict | None = None):
    req = urllib.request.Request(f"{server.api}{path}", data=json.dumps(body).encode() if body is not None else None,
                                 method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read()
    return json.loads(text) if text else None


def _runs(server: PrefectServer, flow: str) -> list[dict]:
    return server.post("/flow_runs/filter", {"flows": {"name": {"any_": [flow]}}, "sort": "EXPECTED_START_TIME_ASC"})


def _cli(env: dict[str, str], *args: str, timeout: int = 300) -> str:
    p = subprocess.run([PREFECT, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"prefect {' '.join(args)}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def _install(server: PrefectServer) -> subprocess.CompletedProcess:
    code = "import sys; from rlpipe.cli import main; sys.argv = ['rlpipe', 'automations', 'install']; main()"
    return subprocess.run([sys.executable, "-c", code], env=server.env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def _deploy(server: PrefectServer) -> str:
    """The pool, the train and heal deployments (the heal policy's backoff shortened), the automations; returns the
    train deployment's id."""
    _cli(server.env, "work-pool", "create", "rlpipe-local", "--type", "process")
    _cli(server.env, "--no-prompt", "deploy", "--name", "train", "--name", "heal")
    heal = server.get("/deployments/name/rl-heal/heal")
    _call(server, "PATCH", f"/deployments/{heal['id']}", {"parameters": {"policy": TEST_POLICY}})
    res = _install(server)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "created  rlpipe-heal-failed-run" in res.stdout and "skipped" not in res.stdout + res.stderr
    return server.get("/deployments/name/rl-train/train")["id"]


def _wait(what: str, until, timeout: float, log: Path, poll: float = 0.3):
    """``until()`` once it is not None. A poll the server is too busy to answer in time (seen once in CI: a filter
    request past 30 s while the relaunch started on 2 cores) is a poll that saw nothing yet, not a failure: the
    deadline alone decides. The failure message carries the worker's and the server's log tails."""
    deadline, slow = time.monotonic() + timeout, []
    while (got := _poll(until, slow)) is None:
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s ({len(slow)} polls timed out); " \
            "worker log:\n" + log.read_text(errors="replace")[-6000:] + "\nserver log:\n" + _server_log(log)[-4000:]
        time.sleep(poll)
    return got


def _poll(until, slow: list):
    try:
        return until()
    except urllib.error.HTTPError:
        raise
    except (TimeoutError, urllib.error.URLError) as e:
        if isinstance(e, urllib.error.URLError) and not isinstance(e.reason, TimeoutError):
            raise  # refused, reset: the server is gone, and waiting out the deadline would only hide it
        slow.append(e)
        print(f"poll timed out: {e!r}", file=sys.stderr)
        return None


def _server_log(worker_log: Path) -> str:
    path = worker_log.parent / "server.log"
    return path.read_text(errors="replace") if path.exists() else "(none)"


def _completed(server: PrefectServer) -> list[dict] | None:
    """The completed rl-train runs, once there is one; fails at once when the heal flow or the relaunch fails."""
    train, heals = _runs(server, "rl-train"), _runs(server, "rl-heal")
    bad = [(r["name"], r["state"]["type"], r["state"]["message"]) for r in train[1:] + heals
           if r["state"]["type"] in ("FAILED", "CRASHED")]
    assert not bad, bad
    return [r for r in train if r["state"]["type"] == "COMPLETED"] or None


def _kill_flow_run_process(worker: subprocess.Popen) -> tuple[int, list[psutil.Process]]:
    """SIGKILL the worker's one flow-run process (what the kernel's OOM killer does); returns its pid and the
    processes it had started (the verifier pool), orphaned now."""
    runs = [c for c in psutil.Process(worker.pid).children() if "prefect.engine" in " ".join(c.cmdline())]
    assert len(runs) == 1, [c.cmdline() for c in psutil.Process(worker.pid).children()]
    below = runs[0].children(recursive=True)
    runs[0].send_signal(signal.SIGKILL)
    runs[0].wait(30)
    return runs[0].pid, below


def test_a_killed_run_is_relaunched_by_the_automation_and_completes_once(tiny_checkpoint, gated_task, home, tmp_path):
    start, log = time.monotonic(), tmp_path / "worker.log"
    with prefect_server(tmp_path, {"RLPIPE_HOME": str(home), "OMP_NUM_THREADS": "1"}) as server:
        train_dep = _deploy(server)
        sets = rl_overrides(tiny_checkpoint, "rlheal", "hf", gated_task, iterations=2) + [
            "reward.plugins=[tests.helpers.slow_verifiers,tests.helpers.gated_verifiers]"]
        cfg = load_config(None, sets)
        with log.open("w") as out:
            worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "rlpipe-local"], cwd=ROOT,
                                      env=server.env | {"PREFECT_WORKER_QUERY_SECONDS": "1"}, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        try:
            (home / "heal-gate").touch()
            first = _call(server, "POST", f"/deployments/{train_dep}/create_flow_run",
                          {"parameters": {"config": cfg.model_dump(mode="json")}})  # no run id: the default
            _wait("iteration 1 held", lambda: (home / "heal-gate.held").exists() or None, 400, log)
            run_id = server.flow_run(first["id"])["name"]  # the id the run made up, its flow run named after it
            assert _versions(cfg, run_id) == [0]  # iteration 0's, registered before the kill
            pid, orphans = _kill_flow_run_process(worker)
            (home / "heal-gate").unlink()
            for p in orphans:  # the verifier pool of the killed process: stopped by pid, the test's own
                if p.is_running():
                    p.kill()
            done = _wait("the relaunch completed", lambda: _completed(server), 400, log, 1)
            events = server.wait_events("rlpipe.audit.heal", lambda e: len(e) >= 1)
            train, heals, iters = _runs(server, "rl-train"), _runs(server, "rl-heal"), _runs(server, "rl-iteration")
        finally:
            stop_group(worker, grace_s=15)  # a worker busy shutting down under load (seen: > 60 s) is killed
    wall = time.monotonic() - start
    _check_healed(cfg, run_id, first["id"], train, heals, iters, done, events, pid)
    print(f"\nkilled flow-run process {pid}; relaunched and completed; test wall {wall:.0f} s")


def _versions(cfg, run_id: str) -> list[int]:
    """The iterations of the run's registered model versions, one entry per version."""
    from rlpipe.tracking.mlflow_utils import Tracker

    versions = Tracker(settings(), cfg).client.search_model_versions(f"name='{cfg.registered_model}'")
    return sorted(int(v.tags["iteration"]) for v in versions if v.tags.get("run_id") == run_id)


def _check_healed(cfg, run_id, crashed_id, train, heals, iters, done, events, pid) -> None:
    assert run_id.startswith("rl-") and [r["name"] for r in train] == [run_id, run_id]
    crashed, relaunch = train
    assert crashed["id"] == crashed_id and crashed["state"]["type"] == "CRASHED", crashed["state"]
    assert "non-zero status code -9" in crashed["state"]["message"]
    assert done == [relaunch] and relaunch["parameters"]["run_id"] == run_id  # completed once, with the same run id
    assert {"rlpipe-heal-attempt:1", f"rlpipe-relaunch-of:{crashed_id}"} <= set(relaunch["tags"])
    assert [(h["state"]["type"], h["created_by"]["type"]) for h in heals] == [("COMPLETED", "AUTOMATION")]
    states = sorted((r["name"], r["state"]["type"]) for r in iters)
    assert states == [(f"{run_id}-iter-0", "COMPLETED"), (f"{run_id}-iter-1", "COMPLETED"),
                      (f"{run_id}-iter-1", "CRASHED")]  # the killed process's subflow, marked by the heal flow
    summary = json.loads((settings().run_dir(run_id) / "summary.json").read_text())
    assert summary["iterations_done"] == 2
    assert _versions(cfg, run_id) == [0, 1]  # one model version per iteration: iteration 0's was not redone
    (rec,) = AuditLog(open_store()).read(action="heal")
    assert rec.action == "heal.relaunch" and rec.target == {"run_id": run_id, "flow_run": crashed_id,
                                                            "deployment": "rl-train/train"}
    assert rec.details["kind"] == "killed" and rec.details["attempt"] == 1 and rec.details["delay_s"] == 1.0
    assert rec.details["triggered_by"].startswith("AUTOMATION") and rec.details["orphans_crashed"] == [f"{run_id}-iter-1"]
    assert rec.who["prefect_flow_run_id"] == heals[0]["id"]
    assert [e["payload"]["id"] for e in events] == [rec.id]
    from rlpipe.tracking.mlflow_utils import Tracker

    tracker = Tracker(settings(), cfg)
    mlrun = tracker.client.get_run(tracker.find_run(cfg.tracking.experiment, run_id))
    assert rec.id in mlrun.data.tags["rlpipe.audit.heal.relaunch"] and mlrun.info.status == "FINISHED"


def _scenarios(server: PrefectServer, scenarios: dict[str, dict]) -> dict[str, dict]:
    res = subprocess.run([sys.executable, "-m", "tests.helpers.heal_steps", json.dumps(scenarios)], env=server.env,
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _crash(code: int) -> dict:
    return {"state": "CRASHED", "message": f"Flow run infrastructure exited with non-zero status code {code}. ..."}


def _fail(exc: str) -> dict:
    return {"state": "FAILED", "message": f"Flow run encountered an exception: {exc}"}


def test_failures_of_one_kind_pause_the_deployment_and_a_refused_resume_is_left(home, tmp_path):
    """No worker runs here: the relaunches stay scheduled, and each step sets the latest one's final state."""
    policy = {"max_attempts": 5, "backoff_s": 2.0, "backoff_max_s": 3.0, "pause_after": 3}
    with prefect_server(tmp_path, {"RLPIPE_HOME": str(home)}) as server:
        installed = _install(server)  # before the heal deployment exists: skipped, saying how to fix it
        got = _scenarios(server, {
            "oom": {"deployment": "train-oom", "run_id": "rl-oom", "policy": policy, "steps": [
                {"state": "CRASHED", "message": OOM_137}, _fail("OutOfMemoryError: CUDA out of memory."), _crash(137),
                {"again": True}]},
            "mixed": {"deployment": "train-mixed", "run_id": "rl-mixed", "policy": policy | {"max_attempts": 2},
                      "steps": [{"state": "CRASHED", "message": SIGKILL}, _crash(137), _fail("KeyError: 'x'")]},
            "refused": {"deployment": "train-refused", "run_id": "rl-refused", "policy": policy, "steps": [
                _fail("ResumeRefused: run rl-refused changed: train.lr: 0.1 → 0.2")]},
            "twice": {"deployment": "train-twice", "run_id": "rl-twice", "policy": policy, "steps": [
                _crash(-9), {"again": True}]}})
        deps = {d["name"]: d for d in server.post("/deployments/filter", {})}
        train = _runs(server, "rl-train")
    oom, mixed, refused, twice = got["oom"], got["mixed"], got["refused"], got["twice"]
    assert installed.returncode == 0 and "rlpipe-heal-failed-run" not in installed.stdout, installed.stderr[-3000:]
    assert ("skipped  rlpipe-heal-failed-run: deployment rl-heal/heal is not on the server; deploy it (prefect deploy "
            "--name heal) and install again") in installed.stderr
    (rec,) = AuditLog(open_store()).read(action="automations.install")
    assert "rlpipe-heal-failed-run" not in rec.details["automations"] and "rlpipe-heal-failed-run" in rec.details["skipped"]
    acts = {name: [(s["result"]["action"], s["result"]["attempt"], s["result"]["delay_s"]) for s in g["steps"]]
            for name, g in got.items()}
    assert acts["oom"] == [("relaunch", 1, 2.0), ("relaunch", 2, 3.0), ("pause", 0, 0.0), ("skip", 0, 0.0)]
    assert acts["mixed"] == [("relaunch", 1, 2.0), ("relaunch", 2, 3.0), ("give_up", 0, 0.0)]
    assert acts["refused"] == [("skip", 0, 0.0)] and acts["twice"] == [("relaunch", 1, 2.0), ("skip", 0, 0.0)]
    assert deps["train-oom"]["paused"] is True and not any(deps[d]["paused"] for d in ("train-mixed", "train-refused",
                                                                                       "train-twice"))
    by_name = {n: [r for r in train if r["name"] == n] for n in ("rl-oom", "rl-mixed", "rl-refused", "rl-twice")}
    assert [len(v) for v in by_name.values()] == [3, 3, 1, 2]  # a relaunch per "relaunch", nothing more
    last = by_name["rl-oom"][-1]
    assert last["state"]["type"] == "CRASHED" and "rlpipe-heal-attempt:2" in last["tags"]
    assert all(r["parameters"]["run_id"] == "rl-oom" for r in by_name["rl-oom"])
    relaunched = by_name["rl-twice"][-1]  # scheduled after the backoff, never run (no worker)
    assert relaunched["state"]["type"] == "SCHEDULED" and relaunched["id"] == twice["steps"][0]["result"]["relaunched_flow_run"]
    _check_pause_records(oom, mixed, refused, twice)


def _check_pause_records(oom, mixed, refused, twice) -> None:
    records = AuditLog(open_store()).read(action="heal")
    by_run = {}
    for r in records:
        by_run.setdefault(r.target["run_id"], []).append(r)
    assert [r.action for r in by_run["rl-oom"]] == ["heal.relaunch", "heal.relaunch", "heal.pause", "heal.skip"]
    assert [r.details["kind"] for r in by_run["rl-oom"]] == ["oom"] * 4
    assert "3 of the run's 3 failures in a row were oom (pause_after=3)" in by_run["rl-oom"][2].details["reason"]
    assert by_run["rl-oom"][2].target["deployment"] == "rl-train/train-oom"
    assert "deployment rl-train/train-oom is paused" in by_run["rl-oom"][3].details["reason"]
    assert [r.action for r in by_run["rl-mixed"]] == ["heal.relaunch", "heal.relaunch", "heal.give_up"]
    assert [r.details["kind"] for r in by_run["rl-mixed"]] == ["killed", "oom", "error:KeyError"]
    assert "2 relaunch(es) made, max_attempts=2" in by_run["rl-mixed"][2].details["reason"]
    (skip,) = by_run["rl-refused"]
    assert skip.action == "heal.skip" and skip.details["kind"] == "error:ResumeRefused"
    assert skip.details["reason"].startswith("not resumable: the resume was refused")
    assert [r.action for r in by_run["rl-twice"]] == ["heal.relaunch", "heal.skip"]
    assert "rl-twice was started again already: flow run " + twice["steps"][0]["result"]["relaunched_flow_run"] \
        in by_run["rl-twice"][1].details["reason"]
    assert [s["result"]["audit_id"] for s in oom["steps"]] == [r.id for r in by_run["rl-oom"]]
