"""`rlpipe rescore` and `rlpipe lineage` on a real two-iteration run (HF engine, its own store, MLflow registry):
the run is scored by ``test_grade`` version 1, then re-scored by version 2 in a process that loads only version 2
(one name, one version per process, as after a verifier upgrade)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.config import load_config, settings
from rlpipe.rescore import advantage_change, advantages
from rlpipe.storage import TRAJECTORY_SCHEMA, open_store
from rlpipe.storage.layout import stage_prefix
from rlpipe.tracking.mlflow_utils import Tracker
from tests.flows.test_train_flow import invoke, rl_overrides
from tests.helpers import graded_rules

ROOT = Path(__file__).resolve().parents[2]
RUN = "rl-rescore"


@pytest.fixture(scope="module")
def graded_run(prefect_harness, tiny_checkpoint, tmp_path_factory):
    from rlpipe.config import DataConfig
    from rlpipe.data import build_arithmetic

    folder = tmp_path_factory.mktemp("rescore")
    data = folder / "graded.jsonl"
    rows = build_arithmetic(DataConfig(test_size=8, validation_size=0)).to_pylist()
    picked = [r for r in rows if r["split"] == "train"][:64] + [r for r in rows if r["split"] == "test"]
    data.write_text("\n".join(json.dumps(r | {"task": "test_grade"}) for r in picked))
    store_uri = str(folder / "store")
    os.environ["RLPIPE_STORAGE_URI"] = store_uri  # the run's own store, for the subprocesses too
    sets = [s.replace("tests.helpers.slow_verifiers", "tests.helpers.graded_verifiers")
            for s in rl_overrides(tiny_checkpoint, "rlrescore", "hf", data)]
    summary = invoke(["run", "--run-id", RUN] + [x for s in sets for x in ("--set", s)])
    assert summary["iterations_done"] == 2
    yield {"sets": sets, "store": store_uri, "base": str(tiny_checkpoint)}
    os.environ.pop("RLPIPE_STORAGE_URI", None)


def rlpipe(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a fresh process (which imports only the plugins it is given)."""
    return subprocess.run([sys.executable, "-m", "rlpipe.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=os.environ | {"PYTHONPATH": str(ROOT)})


def snapshot(store, prefix: str) -> dict[str, bytes]:
    return {k: store.get_bytes(k) for k in store.list(prefix)}


def test_rescore_writes_a_new_stage_and_reports_what_moved(graded_run):
    store = open_store(graded_run["store"])
    originals = {k: snapshot(store, stage_prefix(RUN, k, "verify")) for k in (0, 1)}
    assert all(originals.values())

    wrong = rlpipe("rescore", RUN, "--verifier", "test_grade@2")  # the run's plugin registers version 1
    assert wrong.returncode == 2 and "registered at version '1', not '2'" in wrong.stderr and "test_grade@1" in wrong.stderr
    unknown = rlpipe("rescore", RUN, "--verifier", "no_such_verifier")
    assert unknown.returncode == 2 and "no verifier 'no_such_verifier'" in unknown.stderr and "math@" in unknown.stderr

    done = rlpipe("rescore", RUN, "--verifier", "test_grade@2", "--plugin", "tests.helpers.graded_verifiers_v2", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["stage"] == "rescore-test_grade-2" and sorted(report["iterations"]) == ["0", "1"]
    assert json.loads(store.get_bytes(report["report_key"])) == report

    for k in (0, 1):
        assert snapshot(store, stage_prefix(RUN, k, "verify")) == originals[k]  # byte for byte
        before = store.read_stage(stage_prefix(RUN, k, "verify"), schema=TRAJECTORY_SCHEMA).to_pylist()
        after = store.read_stage(stage_prefix(RUN, k, "rescore-test_grade-2"), schema=TRAJECTORY_SCHEMA).to_pylist()
        assert [(r["prompt_id"], r["sample_index"]) for r in after] == [(r["prompt_id"], r["sample_index"]) for r in before]
        assert all((r["reward_status"], r["reward"]) == graded_rules.v1(r["response_text"] or "") for r in before)
        assert all((r["reward_status"], r["reward"]) == graded_rules.v2(r["response_text"] or "") for r in after)
        assert {(r["verifier"], r["verifier_version"]) for r in after} == {("test_grade", "2")}
        # The report's counts, by hand from the rules.
        new = [graded_rules.v2(r["response_text"] or "") for r in before]
        old = [graded_rules.v1(r["response_text"] or "") for r in before]
        entry = report["iterations"][str(k)]
        assert entry["rows"] == entry["rescored_rows"] == 16
        assert entry["status_changes"] == ({"ok→error": sum(s == "error" for s, _ in new)} if any(s == "error" for s, _ in new) else {})
        assert entry["verdicts_changed"] == sum(o != n for o, n in zip(old, new))
        assert entry["reward_changed"] == sum(o[1] != n[1] for o, n in zip(old, new))
        ok = [r for s, r in new if s == "ok"]
        assert entry["mean_reward_after"] == pytest.approx(sum(ok) / len(ok) if ok else None)
        assert entry["mean_reward_before"] == pytest.approx(sum(r for _, r in old) / len(old))
        # The advantage change is the run's estimator (GRPO) on the two stored stages.
        moved = advantage_change(advantages(before, "grpo", {}), advantages(after, "grpo", {}))
        assert entry["advantage_max_abs_delta"] == pytest.approx(moved["advantage_max_abs_delta"])
        assert entry["advantage_sign_flip_share"] == pytest.approx(moved["advantage_sign_flip_share"])
        if entry["verdicts_changed"] == 0:
            assert entry["advantage_max_abs_delta"] == 0.0
    assert sum(e["verdicts_changed"] for e in report["iterations"].values()) > 0  # the two versions disagreed somewhere

    # The docs' per-sample query, run as written on this run: it finds exactly the changed verdicts.
    page = (ROOT / "docs" / "operations.md").read_text()
    snippet = page.split("Which samples did version 2 score differently", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    first = 'run, iteration, stage = "my-run", 0, "rescore-math-2"'
    assert first in snippet
    scope: dict = {}
    k = max(report["iterations"], key=lambda i: report["iterations"][i]["verdicts_changed"])
    exec(snippet.replace(first, f'run, iteration, stage = "{RUN}", {k}, "rescore-test_grade-2"'), scope)  # noqa: S102
    assert len(scope["changed"]) == report["iterations"][k]["verdicts_changed"] > 0
    assert all(r["verifier_version"] == "2" for r in scope["changed"])

    again = rlpipe("rescore", RUN, "--verifier", "test_grade", "--plugin", "tests.helpers.graded_verifiers_v2")
    assert again.returncode == 2 and "already exists" in again.stderr and "--force-new" in again.stderr
    fresh = rlpipe("rescore", RUN, "--verifier", "test_grade", "--iterations", "1:1", "--plugin",
                   "tests.helpers.graded_verifiers_v2", "--force-new")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    print(fresh.stdout)
    assert "rescore-test_grade-2-2" in fresh.stdout and "iteration 1:" in fresh.stdout and "iteration 0:" not in fresh.stdout
    assert store.stage_done(stage_prefix(RUN, 1, "rescore-test_grade-2-2"))
    assert not store.list(stage_prefix(RUN, 0, "rescore-test_grade-2-2"))


def test_lineage_of_the_last_version(graded_run):
    cfg = load_config(None, graded_run["sets"])
    tracker = Tracker(settings(), cfg)
    latest = tracker.version_by_alias(cfg.registered_model, "latest")
    res = CliRunner().invoke(app, ["lineage", f"models:/{cfg.registered_model}@latest", "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    info = json.loads(res.stdout)
    chain = info["chain"]
    assert [n["iteration"] for n in chain] == [1, 0] and chain[0]["version"] == latest.version
    assert chain[0]["parent_version"] == chain[1]["version"] and chain[1]["parent_version"] is None
    assert {n["run_id"] for n in chain} == {RUN}
    assert info["base_model"] == graded_run["base"]
    for node, k in zip(chain, (1, 0)):
        (it,) = node["iterations"]
        assert it["iteration"] == k and it["verifiers"] == ["test_grade@1"]
        assert {stage_prefix(RUN, k, "rollout"), stage_prefix(RUN, k, "verify")} <= set(it["stages"])
        assert all(s["rows"] == 16 for p, s in it["stages"].items() if "/verify" in p)
        assert node["dataset_version"] == latest.tags["dataset_version"]
        assert node["dataset_prefix"].endswith(latest.tags["dataset_version"][:16])
    text = CliRunner().invoke(app, ["lineage", f"{cfg.registered_model}/{latest.version}"])
    print(text.stdout)
    assert text.exit_code == 0 and f"base model: {graded_run['base']}" in text.stdout
    assert stage_prefix(RUN, 0, "verify") in text.stdout and "scored by test_grade@1" in text.stdout
    missing = CliRunner().invoke(app, ["lineage", f"{cfg.registered_model}/999"])
    assert missing.exit_code == 2 and "no version 999" in missing.output
