import json
from pathlib import Path

from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.config import RunConfig, settings
from rlpipe.storage import open_store
from rlpipe.tracking.mlflow_utils import Tracker
from rlpipe.storage.weights import file_weights_digest
from rlpipe.training.models import fetch_source, load_model

SMALL = [
    "model.hidden_size=64", "model.num_layers=2", "model.num_heads=2", "model.intermediate_size=128",
    "sft.steps=30", "sft.eval_every=10", "sft.batch_size=32", "data.test_size=50", "data.validation_size=20",
    "tracking.experiment=flow-test", "task.name=flowtest",
]


def test_sft_flow_end_to_end(prefect_harness):
    args = ["sft", "--run-id", "sft-flow-test"]
    for s in SMALL:
        args += ["--set", s]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    path = Path(res.stdout.strip().splitlines()[-1])  # the summary's path is the last line
    summary = json.loads(path.read_text())
    assert path == settings().run_dir("sft-flow-test") / "summary.json"
    assert summary["kind"] == "sft" and summary["run_id"] == "sft-flow-test"
    assert summary["sft_steps"] == 30 and summary["heldout_n"] == 50
    for key in ("config_fingerprint", "dataset_version", "wall_s", "heldout_accuracy_before", "heldout_accuracy_after"):
        assert key in summary

    # The checkpoint is in the store and is what the registry points at.
    cfg = RunConfig.model_validate({})
    from rlpipe.config import load_config

    cfg = load_config(None, SMALL)
    assert summary["config_fingerprint"] == cfg.fingerprint()
    tracker = Tracker(settings(), cfg)
    mv = tracker.version_by_alias("rlpipe-flowtest", "base")
    assert mv is not None and mv.version == summary["registered_model"]["version"]
    assert mv.tags["dataset_version"] == summary["dataset_version"]
    assert mv.tags["weights_sha256"] == file_weights_digest(fetch_source(mv.source, settings()))
    assert tracker.version_by_alias("rlpipe-flowtest", "latest").version == mv.version
    run = tracker.client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and "heldout_accuracy" in run.data.metrics
    assert [m.step for m in tracker.client.get_metric_history(run.info.run_id, "sft/loss")] == [10, 20, 30]

    # The dataset stage was stored under its version, and `models:/…@base` loads back.
    store = open_store()
    assert any(summary["dataset_version"][:16] in k for k in store.list("datasets"))
    model, tok, source = load_model("models:/rlpipe-flowtest@base", cfg, settings())
    assert source == mv.source and model.config.hidden_size == 64
