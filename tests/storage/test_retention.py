"""`rlpipe gc`'s plan on a real store (a local folder and the SeaweedFS S3 server) and a real MLflow
registry: it deletes what retention allows and keeps every aliased checkpoint, each run's resume point,
versions a run's config names and the trajectories of unfinished iterations."""

from __future__ import annotations

import time
import uuid

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.config import RetentionConfig, RunConfig, settings
from rlpipe.retention import DAY, apply, plan
from rlpipe.storage import open_store
from rlpipe.tracking.mlflow_utils import Tracker


def _store(kind: str, tmp_path, s3_server, monkeypatch):
    if kind == "local":
        return open_store(str(tmp_path / "store"))
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return open_store(f"s3://{s3_server.bucket}/gc-{uuid.uuid4().hex[:8]}", settings())


def build(store, client, name: str) -> dict:
    """Run A: checkpoints and trajectories of iterations 0–4, save point after 3 (iteration 4 in flight),
    registered as v1–v5 with @best on v1 and @newest on v5. Run B names A's v2 as its policy and has
    finished iteration 0 of 2."""
    a, b = f"{name}-a", f"{name}-b"
    client.create_registered_model(name)
    for k in range(5):
        store.put_bytes(f"runs/{a}/checkpoints/iter={k}/model.safetensors", b"w" * (1000 + k))
        store.put_bytes(f"runs/{a}/checkpoints/iter={k}/rng.pt", b"r")
        for stage in ("rollout", "verify"):
            store.write_stage(f"runs/{a}/iter={k}/{stage}", [pa.table({"x": [k]})])
        client.create_model_version(name, source=store.url(f"runs/{a}/checkpoints/iter={k}"))
    client.set_registered_model_alias(name, "best", "1")
    client.set_registered_model_alias(name, "newest", "5")
    store.put_json(f"runs/{a}/progress.json", {"completed_iteration": 3, "resume_state": f"runs/{a}/checkpoints/iter=3"})
    store.put_json(f"runs/{b}/progress.json", {"completed_iteration": 0, "config": {"task.policy_model": f"models:/{name}/2"}})
    for k in (0, 1):
        store.write_stage(f"runs/{b}/iter={k}/rollout", [pa.table({"x": [k]})])
    return {"a": a, "b": b}


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_gc_keeps_what_must_stay_and_deletes_the_rest(kind, tmp_path, s3_server, monkeypatch):
    store = _store(kind, tmp_path, s3_server, monkeypatch)
    client = Tracker(settings(), RunConfig()).client
    name = f"gc-{kind}-{uuid.uuid4().hex[:6]}"
    runs = build(store, client, name)
    a, b = runs["a"], runs["b"]
    cfg = RetentionConfig(keep_checkpoints=1, trajectory_days=7)
    later = time.time() + 10 * DAY
    before = store.list("runs")
    p = plan(cfg, store, client, now=later)
    deleted = {(i.kind, i.target) for i in p.delete}
    assert deleted == {("checkpoint", f"runs/{a}/checkpoints/iter=2"), ("model-version", f"{name}/3"),
                       *{("trajectories", f"runs/{a}/iter={k}") for k in range(4)}, ("trajectories", f"runs/{b}/iter=0")}
    why = {i.target: i.reason for i in p.keep}
    assert "alias @best" in why[f"runs/{a}/checkpoints/iter=0"]
    assert f"task.policy_model of run {b} names models:/{name}/2" in why[f"runs/{a}/checkpoints/iter=1"]
    assert "resume point" in why[f"runs/{a}/checkpoints/iter=3"]
    assert "alias @newest" in why[f"runs/{a}/checkpoints/iter=4"]
    assert "not finished" in why[f"runs/{a}/iter=4"] and "not finished" in why[f"runs/{b}/iter=1"]
    trajectories = sum(sum(store.sizes(t).values()) for k, t in deleted if k == "trajectories")
    assert trajectories > 0 and p.freed_bytes() == 1002 + 1 + trajectories  # iteration 2's weights and rng
    assert store.list("runs") == before  # planning deletes nothing

    apply(p, store, client)
    assert not store.list(f"runs/{a}/checkpoints/iter=2") and not store.list(f"runs/{a}/iter=0")
    assert store.list(f"runs/{a}/checkpoints/iter=1") and store.list(f"runs/{a}/iter=4") and store.list(f"runs/{b}/iter=1")
    versions = sorted(int(v.version) for v in client.search_model_versions(f"name='{name}'"))
    assert versions == [1, 2, 4, 5]
    assert str(client.get_model_version_by_alias(name, "best").version) == "1"
    assert plan(cfg, store, client, now=later).delete == []  # applied: nothing more to do


def test_young_trajectories_and_null_settings_keep_everything(tmp_path, s3_server, monkeypatch):
    store = _store("local", tmp_path, s3_server, monkeypatch)
    client = Tracker(settings(), RunConfig()).client
    build(store, client, f"gc-young-{uuid.uuid4().hex[:6]}")
    assert plan(RetentionConfig(trajectory_days=7), store, client).delete == []  # written just now
    assert plan(RetentionConfig(), store, client).delete == []


def test_gc_command_dry_run_then_apply(tmp_path, s3_server, monkeypatch):
    store = _store("local", tmp_path, s3_server, monkeypatch)
    monkeypatch.setenv("RLPIPE_STORAGE_URI", store.uri)
    client = Tracker(settings(), RunConfig()).client
    name = f"gc-cli-{uuid.uuid4().hex[:6]}"
    a = build(store, client, name)["a"]
    args = ["gc", "--set", "retention.keep_checkpoints=1"]
    res = CliRunner().invoke(app, args + ["--dry-run"])
    assert res.exit_code == 0, res.output
    assert f"would  checkpoint    runs/{a}/checkpoints/iter=2" in res.output and "dry run: nothing deleted" in res.output
    assert store.list(f"runs/{a}/checkpoints/iter=2")
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0 and "1 checkpoint(s)" in res.output and "1 registry version(s)" in res.output, res.output
    assert not store.list(f"runs/{a}/checkpoints/iter=2")
    res = CliRunner().invoke(app, ["gc"])
    assert res.exit_code == 2 and "nothing to do" in res.output
