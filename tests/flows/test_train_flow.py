import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.config import load_config, settings
from rlpipe.history import read_history
from rlpipe.storage import TRAJECTORY_SCHEMA, open_store
from rlpipe.storage.layout import stage_prefix
from rlpipe.tracking.mlflow_utils import Tracker
from rlpipe.storage.weights import file_weights_digest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def even_task(tmp_path_factory) -> Path:
    """Arithmetic prompts scored by a plugin verifier any policy can earn reward from (1 for an even
    response length), so that even a barely trained model gets a learning signal."""
    from rlpipe.data import build_arithmetic
    from rlpipe.config import DataConfig

    path = tmp_path_factory.mktemp("even") / "even.jsonl"
    rows = build_arithmetic(DataConfig(test_size=40, validation_size=0)).to_pylist()
    path.write_text("\n".join(json.dumps(r | {"task": "test_even"}) for r in [r for r in rows if r["split"] == "train"][:400] + [r for r in rows if r["split"] == "test"]))
    return path


def rl_overrides(base: Path, name: str, engine: str, data: Path, iterations: int = 2) -> list[str]:
    return [
        f"task.policy_model={base}", f"task.dataset={data}", "reward.plugins=[tests.helpers.slow_verifiers]", f"task.name={name}", f"tracking.experiment={name}", f"rollout.engine={engine}",
        "rollout.batch_size=4", "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=6", "train.batch_size=8", "train.micro_batch_size=4", f"train.total_iterations={iterations}",
        "train.save_interval=1", "train.eval_interval=1", "train.lr=1e-4", "reward.workers=1",
    ]


def invoke(args: list[str]) -> dict:
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output[-4000:]
    return json.loads(Path(res.stdout.strip().splitlines()[-1]).read_text())


def test_two_iterations_end_to_end_on_vllm(prefect_harness, tiny_checkpoint, even_task):
    sets = rl_overrides(tiny_checkpoint, "rle2e", "vllm", even_task) + ["tracking.system_metrics_s=2"]
    args = ["run", "--run-id", "rl-e2e"] + [x for s in sets for x in ("--set", s)]
    summary = invoke(args)
    assert summary["iterations_done"] == 2 and summary["engine"] == "vllm" and summary["heldout_n"] == 40
    assert 0.0 <= summary["heldout_accuracy_base"] <= 1.0 and summary["heldout_accuracy_final"] is not None
    assert set(summary["stage_seconds"]) >= {"generate_s", "verify_s", "update_s", "sync_s", "overhead_s"}
    assert Path(summary["reward_curve_png"]).stat().st_size > 1000
    assert summary["cpu_s_total"] > 0 and summary["peak_rss_bytes"] > 2**28 and summary["store_bytes_written"] > 2**20

    store = open_store()
    base_sha = file_weights_digest(tiny_checkpoint)
    cfg = load_config(None, sets)
    tracker = Tracker(settings(), cfg)
    versions = {int(mv.tags["iteration"]): mv for mv in tracker.client.search_model_versions(f"name='{cfg.registered_model}'")}
    assert sorted(versions) == [0, 1]
    for k in (0, 1):
        table = store.read_stage(stage_prefix("rl-e2e", k, "verify"), schema=TRAJECTORY_SCHEMA)
        rows = table.to_pylist()
        assert len(rows) == 16 and {r["sample_index"] for r in rows} == {0, 1, 2, 3}
        assert all(r["reward_status"] == "ok" and r["verifier"] == "test_even" for r in rows)
        assert all(len(r["logprobs"]) == len(r["response_token_ids"]) for r in rows)
        # Each batch was sampled by the policy the previous update produced (weights synced, hash-checked).
        expected = base_sha if k == 0 else versions[0].tags["weights_sha256"]
        assert {r["policy_version"] for r in rows} == {expected}
    assert versions[1].tags["parent_version"] == str(versions[0].version)
    assert tracker.version_by_alias(cfg.registered_model, "latest").version == str(versions[1].version)
    assert versions[1].tags["weights_sha256"] == summary["final_policy_version"] != base_sha
    run = tracker.client.get_run(summary["mlflow_run_id"])
    for key in ("reward_mean", "reward_std", "accuracy", "status_ok", "status_timeout", "kl_coef", "entropy", "clip_frac",
                "grad_norm", "response_length_mean", "time/generate_s", "time/update_s", "time/overhead_share",
                "throughput/generate_tokens_per_s", "heldout_accuracy", "reward_by_task/test_even", "reward_length_corr",
                "advantage/p10", "advantage/p90", "advantage/zero_share", "ratio/max", "resource/cpu_s", "resource/rss_bytes",
                "resource/rss_peak_bytes/generate", "resource/rss_peak_bytes/update", "store/bytes_written",
                "alerts/memory_growth", "cost/cpu_s_total", "cost/cpu_s_per_iteration"):
        assert key in run.data.metrics, key
    assert [m.step for m in tracker.client.get_metric_history(run.info.run_id, "reward_mean")] == [0, 1]
    assert "system/cpu_utilization_percentage" in run.data.metrics  # MLflow's own system metrics, every 2 s
    gens = json.loads(Path(tracker.client.download_artifacts(run.info.run_id, "generations.json")).read_text())
    iters = [r[gens["columns"].index("iteration")] for r in gens["data"]]
    assert iters == [-1] * 8 + [0] * 8 + [1] * 8  # the base and each evaluation: 8 held-out generations each
    assert {"prompt", "response", "ground_truth", "status", "reward"} <= set(gens["columns"])
    # The run's HTML report, built at its end and logged to its MLflow run.
    report = Path(summary["report_html"])
    assert report.name == "report.html" and 'data-series="reward_mean"' in report.read_text()
    assert "report.html" in {a.path for a in tracker.client.list_artifacts(run.info.run_id)}


def _cli(args: list[str], env_extra: dict[str, str], api_url: str) -> subprocess.CompletedProcess:
    # Not the launcher variables of this process's own trainer (its MASTER_PORT is taken).
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env = inherited | {"PREFECT_API_URL": api_url, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"} | env_extra
    code = "import sys; from rlpipe.cli import main; sys.argv = ['rlpipe'] + sys.argv[1:]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=900)


def test_verifier_service_down_skips_samples_and_the_run_goes_on(prefect_harness, tiny_checkpoint, even_task, monkeypatch):
    """Scoring through RLPIPE_VERIFIER_URL while the service is down (it passed the preflight, then died):
    every sample gets 'skipped' (never a 0 reward), the update excludes them, an alert is recorded, the
    iteration logs the service's error rate, and the run completes."""
    from tests.helpers.gone import gone_after_preflight

    monkeypatch.setenv("RLPIPE_VERIFIER_URL", gone_after_preflight())
    sets = rl_overrides(tiny_checkpoint, "rldown", "hf", even_task, iterations=1)
    summary = invoke(["run", "--run-id", "rl-verifier-down"] + [x for s in sets for x in ("--set", s)])
    assert summary["iterations_done"] == 1
    rows = open_store().read_stage(stage_prefix("rl-verifier-down", 0, "verify"), schema=TRAJECTORY_SCHEMA).to_pylist()
    assert {r["reward_status"] for r in rows} == {"skipped"} and all(r["reward"] is None for r in rows)
    assert "unreachable" in rows[0]["reward_reason"]
    meta = open_store().read_manifest(stage_prefix("rl-verifier-down", 0, "verify"))["meta"]
    assert meta["status_skipped"] == 1.0 and any("unreachable" in a for a in meta["alerts"])
    history = read_history(settings().run_dir("rl-verifier-down"))
    assert history[0]["samples_excluded"] == 16 and history[0]["optimizer_steps"] == 0
    assert history[0]["service/verifier/error_rate"] == 1.0 and history[0]["service/verifier/calls"] >= 1
    assert summary["final_policy_version"] == file_weights_digest(tiny_checkpoint)  # nothing was learned from nothing
