"""A real run pushes each iteration's metrics to a real Pushgateway (RLPIPE_PUSHGATEWAY_URL): afterwards the gateway
holds the run's last iteration, value for value what MLflow logged for it, and every metric key the run dashboard
(infra/grafana/dashboards/rlpipe-run.json) queries is one the run logs, so a renamed metric breaks this test
instead of leaving a panel empty."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlpipe.config import load_config, settings
from rlpipe.tracking.mlflow_utils import Tracker
from rlpipe.tracking.prom_push import ITERATION, JOB, METRIC
from tests.flows.test_train_flow import invoke, rl_overrides
from tests.helpers.pushgateway import needs_pushgateway, same, start_pushgateway

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "infra" / "grafana" / "dashboards" / "rlpipe-run.json"
SELECTOR = re.compile(r'\bkey\s*(=~|=)\s*"((?:[^"\\]|\\.)*)"')

# Keys the dashboard charts that this tiny CPU run cannot log, each with the key the code writes and where: the
# code is read, so renaming the metric there still breaks the test.
NOT_IN_A_CPU_RUN = {
    "resource/gpu[0-9]+_mem_bytes": ("resource/gpu0_mem_bytes", 'f"resource/gpu{i}_mem_bytes"', "src/rlpipe/tracking/resources.py"),
    "resource/gpu[0-9]+_util": ("resource/gpu0_util", 'f"resource/gpu{i}_util"', "src/rlpipe/tracking/resources.py"),
}


@pytest.fixture(scope="module")
def even_task_validated(tmp_path_factory) -> Path:
    """tests/flows/test_train_flow.py's even task (any policy earns reward: 1 for an even response length), with
    a validation split, so that the run logs validation_accuracy as the dashboard's accuracy panel charts it."""
    from rlpipe.config import DataConfig
    from rlpipe.data import build_arithmetic

    rows = build_arithmetic(DataConfig(test_size=16, validation_size=8)).to_pylist()
    keep = [r for r in rows if r["split"] == "train"][:400] + [r for r in rows if r["split"] != "train"]
    path = tmp_path_factory.mktemp("even-validated") / "even.jsonl"
    path.write_text("\n".join(json.dumps(r | {"task": "test_even"}) for r in keep))
    return path


def dashboard_keys() -> list[tuple[str, str, str]]:
    """(panel title, operator, key or regex) of every ``key`` matcher in the run dashboard's queries."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], op, value) for p in dash["panels"] for t in p.get("targets", [])
            for op, value in SELECTOR.findall(t["expr"])]


def test_the_dashboard_selectors_are_read():
    found = dashboard_keys()
    assert ("Reward", "=", "reward_mean") in found and ("GPU utilisation", "=~", "resource/gpu[0-9]+_util") in found
    assert len({k for _, _, k in found}) >= 15


@needs_pushgateway
def test_a_run_pushes_its_last_iteration_and_the_dashboard_reads_its_keys(prefect_harness, tiny_checkpoint,
                                                                         even_task_validated, tmp_path, monkeypatch):
    gateway = start_pushgateway(tmp_path / "pushgateway")
    try:
        monkeypatch.setenv("RLPIPE_PUSHGATEWAY_URL", gateway.url)
        # kl_coef > 0: the update computes (and logs) the KL to the reference that the dashboard charts.
        sets = rl_overrides(tiny_checkpoint, "rlpush", "hf", even_task_validated, iterations=2) + ["train.kl_coef=0.01"]
        summary = invoke(["run", "--run-id", "rl-push"] + [x for s in sets for x in ("--set", s)])
        assert summary["iterations_done"] == 2
        pushed = gateway.samples(METRIC, job=JOB, run_id="rl-push", experiment="rlpush")
        iteration = gateway.samples(ITERATION, job=JOB, run_id="rl-push")
    finally:
        gateway.stop()
    assert iteration == {"": 1.0}
    # What the gateway holds is iteration 1 as MLflow logged it: every pushed key, the same value.
    run = Tracker(settings(), load_config(None, sets)).client.get_run(summary["mlflow_run_id"])
    logged = run.data.metrics
    assert {"reward_mean", "accuracy", "loss", "kl", "entropy", "grad_norm", "time/generate_s", "validation_accuracy",
            "alerts/memory_growth"} <= set(pushed)
    assert set(pushed) <= set(logged) and [k for k in pushed if not same(pushed[k], logged[k])] == []
    # Every key the dashboard queries: a key the run logs, or (GPU) one the code writes on a CUDA machine.
    missing = []
    for title, op, key in dashboard_keys():
        if op == "=" and key not in pushed:
            missing.append(f"{title}: {key}")
        elif op == "=~" and not any(re.fullmatch(key, k) for k in pushed):
            example, code, path = NOT_IN_A_CPU_RUN.get(key, ("", "", ""))
            if not (example and re.fullmatch(key, example) and code in (ROOT / path).read_text()):
                missing.append(f"{title}: {key}")
    assert missing == [], f"the run dashboard queries keys the run does not log: {missing}"
