"""Each operation that changes shared state, done for real (MLflow's registry, the object store, the Prefect test
API), then read back with ``rlpipe audit``: who did it, what it touched, when, the MLflow tag it left and the
Prefect event it sent."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlpipe.audit import AuditError, AuditLog
from rlpipe.cli import app
from rlpipe.config import RunConfig, settings
from rlpipe.progress import Progress
from rlpipe.storage import open_store
from rlpipe.tracking.mlflow_utils import Tracker


@pytest.fixture
def store_uri(tmp_path, monkeypatch) -> str:
    """This test's own store (every audit record it makes lands there), and an actor to find in the log."""
    monkeypatch.setenv("RLPIPE_STORAGE_URI", str(tmp_path / "store"))
    monkeypatch.setenv("RLPIPE_ACTOR", "ops-bot")
    return str(tmp_path / "store")


def audit_json(*args: str) -> list[dict]:
    res = CliRunner().invoke(app, ["audit", "--json", *args])
    assert res.exit_code == 0, res.output
    return [json.loads(line) for line in res.stdout.splitlines()]


def audit_table(*args: str) -> list[str]:
    res = CliRunner().invoke(app, ["audit", *args])
    assert res.exit_code == 0, res.output
    return res.stdout.splitlines()


def config(name: str) -> RunConfig:
    return RunConfig.model_validate({"task": {"name": name}, "tracking": {"experiment": name}})


def prefect_events(prefix: str, until, timeout: float = 30.0) -> list[dict]:
    """Events on the Prefect test API whose name starts with ``prefix``, once ``until(events)`` holds."""
    from prefect.client.orchestration import get_client
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            body = {"filter": {"event": {"prefix": [prefix]}, "order": "ASC"}, "limit": 50}
            got = client._client.post("/events/filter", json=body).json()["events"]
            if until(got) or time.monotonic() > deadline:
                return got
            time.sleep(0.5)


def register(cfg: RunConfig, run_id: str, iteration: int, source: str) -> dict:
    from tasks.tracking import register_checkpoint

    mlflow_run = Tracker(settings(), cfg).start_run(cfg, run_id, "rl")
    return register_checkpoint.fn(cfg, run_id, mlflow_run, {"checkpoint_uri": source, "weights_sha256": f"{iteration:064x}"},
                                  "d" * 64, iteration, ("latest",))


def test_registration_moves_latest_and_each_move_is_audited(prefect_harness, store_uri, tmp_path):
    cfg = config("auditreg")
    first = register(cfg, "audit-reg", 0, str(tmp_path))
    second = register(cfg, "audit-reg", 1, str(tmp_path))
    moves = audit_json("--action", "alias.move")
    assert [(m["target"]["version"], m["details"]["from"]) for m in moves] == [(first["version"], None),
                                                                               (second["version"], first["version"])]
    assert moves[1]["who"]["identity"] == "ops-bot" and moves[1]["target"]["alias"] == "latest"
    assert "registered run audit-reg iteration 1" in moves[1]["details"]["why"]
    tags = Tracker(settings(), cfg).client.get_model_version(cfg.registered_model, second["version"]).tags
    assert tags["rlpipe.audit.alias.move"].split()[1] == moves[1]["id"]
    line = audit_table()[-1]
    assert "alias.move" in line and f"model={cfg.registered_model}" in line and f"to={second['version']}" in line
    events = prefect_events("rlpipe.audit.alias.move", lambda e: moves[1]["id"] in json.dumps(e))
    event = next(e for e in events if e["payload"]["id"] == moves[1]["id"])
    assert event["resource"]["prefect.resource.id"] == f"rlpipe.model.{cfg.registered_model}"
    assert event["resource"]["rlpipe.identity"] == "ops-bot"


def test_promotion_is_audited_with_the_version_it_replaced(prefect_harness, store_uri, tmp_path):
    from flows.evaluate import _promote
    from tasks.evaluate import Candidate

    cfg = config("auditpromote")
    versions = [register(cfg, "audit-promote", k, str(tmp_path))["version"] for k in range(2)]
    name = cfg.registered_model
    for k, v in enumerate(versions):
        done, why = _promote(cfg, Candidate(f"models:/{name}/{v}", str(tmp_path), name, v), "best",
                             {"accuracy": 0.5 + k / 4}, {"accuracy": 0.4 + k / 4})
        assert done, why
    promotions = audit_json("--action", "alias.promote")
    assert [(p["details"]["from"], p["details"]["to"]) for p in promotions] == [(None, versions[0]),
                                                                                (versions[0], versions[1])]
    assert "validation accuracy 0.7500" in promotions[1]["details"]["why"]
    tags = Tracker(settings(), cfg).client.get_model_version(name, versions[1]).tags
    assert promotions[1]["id"] in tags["rlpipe.audit.alias.promote"]


def test_gc_deletions_are_audited_before_anything_goes(store_uri):
    cfg = config("auditgc")
    store = open_store()
    for k in range(3):
        store.put_bytes(f"runs/audit-gc/checkpoints/iter={k}/model.safetensors", b"w" * 1000)
    tracker = Tracker(settings(), cfg)
    run = tracker.start_run(cfg, "audit-gc", "rl")
    old = tracker.register_checkpoint(cfg.registered_model, store.url("runs/audit-gc/checkpoints/iter=0"), run,
                                      rlpipe_run_id="audit-gc", iteration=0, config_fingerprint="f", dataset_version="d",
                                      weights_sha256="0" * 64, aliases=())
    res = CliRunner().invoke(app, ["gc", "--set", "task.name=auditgc", "--set", "retention.keep_checkpoints=1"])
    assert res.exit_code == 0, res.output
    (rec,) = audit_json("--action", "gc")
    assert rec["action"] == "gc.delete" and rec["who"]["identity"] == "ops-bot"
    assert rec["target"]["model_versions"] == [f"{cfg.registered_model}/{old.version}"]
    assert sorted(rec["target"]["prefixes"]) == [f"runs/audit-gc/checkpoints/iter={k}" for k in (0, 1)]
    assert rec["details"]["freed_bytes"] == 2000 and not store.list("runs/audit-gc/checkpoints/iter=0")
    tags = tracker.client.get_registered_model(cfg.registered_model).tags
    assert rec["id"] in tags["rlpipe.audit.gc.delete"]

    # A store whose log cannot be written: gc refuses, and deletes nothing.
    store.delete("audit")
    store.put_bytes("audit", b"a file where the log's folder should be")
    store.put_bytes("runs/audit-gc/checkpoints/iter=3/model.safetensors", b"w")  # iter=2 is no longer the newest
    again = CliRunner().invoke(app, ["gc", "--set", "task.name=auditgc", "--set", "retention.keep_checkpoints=1"])
    assert again.exit_code == 1 and "the audit record could not be written" in again.output
    assert store.list("runs/audit-gc/checkpoints/iter=2")


def _context(run_id: str, cfg: RunConfig):
    from rlpipe.runtime import RunContext

    ctx = RunContext.resolve(cfg, run_id)
    return ctx, ctx.tracker.start_run(cfg, run_id, "rl")


def test_a_resume_with_a_config_change_is_audited_and_refused_when_it_cannot_be(store_uri):
    from flows.train import _record_change

    ctx, mlflow_run = _context("audit-resume", config("auditresume"))
    progress = Progress(completed_iteration=2, config={"train.lr": 1e-4})
    ctx.folder.write_progress(progress)
    _record_change(ctx, mlflow_run, progress, ["train.lr: 0.0001 → 0.0002"])
    (rec,) = audit_json("--action", "resume")
    assert rec["target"] == {"run_id": "audit-resume", "mlflow_run_id": mlflow_run}
    assert rec["details"] == {"iteration": 3, "changes": ["train.lr: 0.0001 → 0.0002"]}
    tags = ctx.tracker.client.get_run(mlflow_run).data.tags
    assert rec["id"] in tags["rlpipe.audit.resume.config_change"] and "rlpipe.config_change.iter3" in tags
    assert ctx.folder.read_progress().config_changes == [{"iteration": 3, "changes": ["train.lr: 0.0001 → 0.0002"]}]

    ctx.store.delete("audit")
    ctx.store.put_bytes("audit", b"not a folder")
    with pytest.raises(AuditError, match="resume.config_change on run_id=audit-resume"):
        _record_change(ctx, mlflow_run, progress.but(completed_iteration=4), ["train.lr: 0.0002 → 0.0003"])
    assert "rlpipe.config_change.iter5" not in ctx.tracker.client.get_run(mlflow_run).data.tags
    assert len(ctx.folder.read_progress().config_changes) == 1  # the change was not made


def test_a_cancel_the_run_honours_is_audited(prefect_harness, store_uri):
    from flows.train import _cancelled

    ctx, mlflow_run = _context("audit-cancel", config("auditcancel"))
    state = _cancelled(ctx, mlflow_run, 1, "cancelled by automation rlpipe-cancel-run-on-critical-alert")
    assert state.is_cancelled()
    (rec,) = audit_json("--action", "run.cancel")
    assert rec["details"] == {"after_iteration": 1, "reason": "cancelled by automation rlpipe-cancel-run-on-critical-alert"}
    run = ctx.tracker.client.get_run(mlflow_run)
    assert run.info.status == "KILLED" and rec["id"] in run.data.tags["rlpipe.audit.run.cancel"]
    events = prefect_events("rlpipe.audit.run.cancel", lambda e: any(x["payload"]["id"] == rec["id"] for x in e))
    assert [e["resource"]["prefect.resource.id"] for e in events if e["payload"]["id"] == rec["id"]] == \
        ["rlpipe.run.audit-cancel"]


def test_installing_the_automations_is_audited(prefect_harness, store_uri):
    from prefect.client.orchestration import get_client

    from tasks.alerts import AUTOMATIONS_FILE
    from tasks.audit import audit_log

    res = CliRunner().invoke(app, ["automations", "install"])
    try:
        assert res.exit_code == 0, res.output
        (rec,) = AuditLog(open_store()).read(action="automations")
        assert rec.target["file"] == str(AUTOMATIONS_FILE) and rec.target["prefect_api"].startswith("http")
        assert rec.details["automations"] == ["rlpipe-cancel-run-on-critical-alert",
                                              "rlpipe-pause-deployment-on-critical-alert"]
        assert rec.who["identity"] == "ops-bot" and audit_log().actor["identity"] == "ops-bot"
    finally:  # the session's other flows must not meet automations that cancel them
        with get_client(sync_client=True) as client:
            for auto in client.read_automations():
                if auto.name.startswith("rlpipe-"):
                    client.delete_automation(auto.id)
    assert Path(store_uri).is_dir()


def test_a_registration_whose_alias_move_could_not_be_audited_moves_it_on_the_retry(prefect_harness, store_uri, tmp_path):
    cfg = config("auditretry")
    store = open_store()
    store.put_bytes("audit", b"not a folder")
    with pytest.raises(AuditError, match="alias.move on model=rlpipe-auditretry"):
        register(cfg, "audit-retry", 0, str(tmp_path))
    tracker = Tracker(settings(), cfg)
    (mv,) = tracker.client.search_model_versions(f"name='{cfg.registered_model}'")
    assert tracker.version_by_alias(cfg.registered_model, "latest") is None  # registered, not moved: not audited

    store.delete("audit")  # the store is fixed; the task's retry finds its version and finishes the move
    again = register(cfg, "audit-retry", 0, str(tmp_path))
    assert again["version"] == str(mv.version) and "last" in again["aliases"]
    assert tracker.version_by_alias(cfg.registered_model, "latest").version == str(mv.version)
    (rec,) = audit_json("--action", "alias")
    assert rec["target"]["version"] == str(mv.version) and rec["details"]["from"] is None
