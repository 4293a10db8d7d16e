"""`rlpipe gc` on a real run's store and registry: with the strictest retention (one checkpoint, trajectories
gone at once) the run still resumes from the store on a machine with no local state, and the registry's
aliases still load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.config import load_config, settings
from rlpipe.storage import open_store
from rlpipe.tracking.mlflow_utils import Tracker
from tests.flows.test_train_flow import even_task, invoke, rl_overrides  # noqa: F401 - fixture re-used


def test_strict_gc_keeps_what_a_resume_and_the_aliases_need(prefect_harness, tiny_checkpoint, even_task, tmp_path,
                                                             monkeypatch):
    monkeypatch.setenv("RLPIPE_STORAGE_URI", str(tmp_path / "store"))  # this run's own store: gc touches nothing else
    sets = rl_overrides(tiny_checkpoint, "rlgc", "hf", even_task, iterations=3)
    run = ["run", "--run-id", "rl-gc"] + [x for s in sets for x in ("--set", s)]
    first = invoke(run)
    assert first["iterations_done"] == 3
    cfg = load_config(None, sets)
    tracker = Tracker(settings(), cfg)
    # The even task has no validation split, so nothing moved @best: a person promotes iteration 0's version.
    v0 = next(mv for mv in tracker.client.search_model_versions(f"name='{cfg.registered_model}'")
              if mv.tags.get("run_id") == "rl-gc" and mv.tags.get("iteration") == "0")
    tracker.set_alias(cfg.registered_model, "best", str(v0.version))
    best = tracker.version_by_alias(cfg.registered_model, "best")
    store = open_store()
    best_key = store.key_of(best.source)
    assert {k.split("/")[3] for k in store.list("runs/rl-gc/checkpoints")} == {"iter=0", "iter=1", "iter=2"}

    res = CliRunner().invoke(app, ["gc", "--set", "retention.keep_checkpoints=1", "--set", "retention.trajectory_days=0"])
    assert res.exit_code == 0, res.output
    left = {k.split("/")[3] for k in store.list("runs/rl-gc/checkpoints")}
    assert left == {"iter=2", "iter=0"} and best_key.endswith("iter=0"), res.output  # newest = resume point = latest, and best
    keys = store.list("runs/rl-gc")
    assert not [k for k in keys if "/iter=" in k and "/checkpoints/" not in k and "/history/" not in k]  # trajectories gone
    assert len([k for k in keys if "/history/" in k]) == 3  # the metric history a resume fetches is kept
    versions = {str(mv.version) for mv in tracker.client.search_model_versions(f"name='{cfg.registered_model}'")
                if mv.tags.get("run_id") == "rl-gc"}
    assert versions == {best.version, tracker.version_by_alias(cfg.registered_model, "latest").version}
    kept = next(line for line in res.output.splitlines() if line.startswith("keep   checkpoint    runs/rl-gc/checkpoints/iter=2"))
    assert "alias @" in kept and "resume point of run rl-gc (after iteration 2)" in kept

    # Another machine: no local state, only the store. The run goes on after its save point.
    shutil.rmtree(settings().run_dir("rl-gc"))
    more = invoke(run + ["--set", "train.total_iterations=4"])
    assert more["iterations_done"] == 4
    from rlpipe.training.models import fetch_source, resolve_source

    folder = fetch_source(resolve_source(f"models:/{cfg.registered_model}@best", settings(), cfg), settings())
    assert (Path(folder) / "model.safetensors").exists()
    assert json.loads((settings().run_dir("rl-gc") / "progress.json").read_text())["completed_iteration"] == 3
