import math

import pytest

from rlpipe.config import RunConfig, settings
from rlpipe.tracking.mlflow_utils import LINEAGE_TAGS, Tracker, mlflow_alias
from tasks.tracking import register_checkpoint


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    return RunConfig.model_validate({"task": {"name": "lineage"}, "tracking": {"experiment": "lineage-test"}})


def ckpt(n):
    return {"checkpoint_uri": f"/ckpts/{n}", "weights_sha256": f"{n:064x}"}


def test_run_params_and_metrics(cfg):
    tracker = Tracker(settings(), cfg)
    rid = tracker.start_run(cfg, "run-a", "sft", dataset_version="d" * 64)
    assert tracker.start_run(cfg, "run-a", "sft") == rid  # resuming finds the same MLflow run
    tracker.log_metrics(rid, {"loss": 0.5, "nan": float("nan"), "flag": True, "reward_by_task/rm+exact": 0.25}, step=3)
    run = tracker.client.get_run(rid)
    assert run.data.params["train.lr"] == str(cfg.train.lr)
    assert run.data.params["config_fingerprint"] == cfg.fingerprint()
    assert run.data.params["dataset_version"] == "d" * 64
    # A non-finite value is logged as it is (never dropped: a NaN loss must be seen); a bool is no metric.
    assert run.data.metrics["loss"] == 0.5 and math.isnan(run.data.metrics["nan"]) and "flag" not in run.data.metrics
    assert run.data.metrics["reward_by_task/rm_exact"] == 0.25  # a name MLflow refuses is made one it takes
    assert tracker.uri.startswith("sqlite:///") and str(settings().home) in tracker.uri



def test_system_metrics_of_a_run_shorter_than_one_interval_are_logged(cfg):
    # MLflow's monitor publishes once per interval and drops a partial one at finish: a short run had none.
    tracker = Tracker(settings(), cfg)
    rid = tracker.start_run(cfg, "run-sys", "rl")
    monitor = tracker.system_metrics(rid, 60.0)
    monitor.finish()  # well within the first 60 s interval
    metrics = tracker.client.get_run(rid).data.metrics
    assert "system/cpu_utilization_percentage" in metrics and "system/system_memory_usage_megabytes" in metrics
    monitor.finish()  # a second finish publishes nothing twice
    assert len(tracker.client.get_metric_history(rid, "system/cpu_utilization_percentage")) == 1

def test_versions_carry_lineage_and_aliases_move(cfg):
    tracker = Tracker(settings(), cfg)
    rid = tracker.start_run(cfg, "run-b", "rl")
    v1 = register_checkpoint.fn(cfg, "run-b", rid, ckpt(1), "d" * 64, 0, ("base", "latest"), accuracy=0.30)
    v2 = register_checkpoint.fn(cfg, "run-b", rid, ckpt(2), "d" * 64, 5, ("latest",), accuracy=0.55)
    v3 = register_checkpoint.fn(cfg, "run-b", rid, ckpt(3), "d" * 64, 10, ("latest",), accuracy=0.50)
    name = cfg.registered_model
    mv = tracker.client.get_model_version(name, v3["version"])
    for tag in LINEAGE_TAGS:
        assert tag in mv.tags
    assert mv.tags["iteration"] == "10" and mv.tags["run_id"] == "run-b"
    assert mv.tags["parent_version"] == v2["version"] and v2["tags"]["parent_version"] == v1["version"]
    assert v1["tags"]["parent_version"] == ""
    assert mv.tags["weights_sha256"] == f"{3:064x}" and mv.tags["config_fingerprint"] == cfg.fingerprint()
    assert mv.source == "/ckpts/3"
    assert tracker.version_by_alias(name, "base").version == v1["version"]
    assert tracker.version_by_alias(name, "latest").version == v3["version"]
    # A policy's `best` never moves on registration (the evaluate flow moves it), and cannot be asked to.
    assert tracker.version_by_alias(name, "best") is None
    with pytest.raises(ValueError, match="only through the evaluate flow"):
        register_checkpoint.fn(cfg, "run-b", rid, ckpt(7), "d" * 64, 20, ("latest", "best"), accuracy=0.9)
    v4 = register_checkpoint.fn(cfg, "run-b", rid, ckpt(4), "d" * 64, 15, ("latest",), accuracy=0.40, test_accuracy=0.99)
    assert v4["tags"]["test_accuracy"] == "0.990000" and v4["tags"]["validation_accuracy"] == "0.400000"
    assert v4["tags"]["kind"] == "policy" and v4["tags"]["mlflow_run_id"] == rid
    # An iteration redone after a kill registers nothing new and moves no alias.
    again = register_checkpoint.fn(cfg, "run-b", rid, ckpt(3), "d" * 64, 10, ("latest",), accuracy=0.50)
    assert again["version"] == v3["version"] and tracker.version_by_alias(name, "latest").version == v4["version"]
    assert len(tracker.client.search_model_versions(f"name='{name}'")) == 4
    with pytest.raises(RuntimeError, match="not deterministic"):
        register_checkpoint.fn(cfg, "run-b", rid, ckpt(9), "d" * 64, 10, ("latest",), accuracy=0.50)
    # Another run's version never becomes a parent: a run from @base starts its lineage at @base's version.
    other = cfg.model_copy(update={"task": cfg.task.model_copy(update={"policy_model": f"models:/{name}@base"})})
    w1 = register_checkpoint.fn(other, "run-c", rid, ckpt(8), "d" * 64, 3, ("latest",))
    w2 = register_checkpoint.fn(other, "run-c", rid, ckpt(9), "d" * 64, 6, ("latest",))
    assert w1["tags"]["parent_version"] == v1["version"] and w2["tags"]["parent_version"] == w1["version"]
    fresh = register_checkpoint.fn(cfg, "run-d", rid, ckpt(10), "d" * 64, 1, ("latest",))
    assert fresh["tags"]["parent_version"] == ""  # a tiny model started from config has no parent
    assert tracker.version_by_alias(name, "nope") is None
    assert mlflow_alias("latest") == "last" and "last" in tracker.client.get_model_version(name, fresh["version"]).aliases


def test_reward_model_best_follows_validation_accuracy(cfg):
    """The reward-model fit is the one caller that moves `best` on registration (promote_best): by validation
    pair accuracy, never by recency or the test split."""
    tracker = Tracker(settings(), cfg)
    rid = tracker.start_run(cfg, "run-rm", "rm")
    reg = lambda n, acc, test=None: register_checkpoint.fn(  # noqa: E731
        cfg, "run-rm", rid, ckpt(n), "d" * 64, n, ("latest",), accuracy=acc, test_accuracy=test,
        model_name="lineage-rm", extra_tags={"kind": "reward_model"}, promote_best=True)
    v1, v2 = reg(1, 0.30), reg(2, 0.55)
    reg(3, 0.50, test=0.99)
    assert tracker.version_by_alias("lineage-rm", "best").version == v2["version"] != v1["version"]
    assert tracker.client.get_model_version("lineage-rm", v2["version"]).tags["kind"] == "reward_model"


def test_config_loads_back_from_the_run(cfg):
    tracker = Tracker(settings(), cfg)
    rid = tracker.start_run(cfg, "run-cfg", "rl")
    assert tracker.run_config(rid) == cfg
    other = tracker.client.create_run(tracker.experiment_id("lineage-test")).info.run_id
    with pytest.raises(LookupError, match="pass the config explicitly"):
        tracker.run_config(other)
