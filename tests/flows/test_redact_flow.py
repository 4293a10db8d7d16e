"""data.redact through a whole run: personal data in the prompts and in a verifier's reasons reaches neither the
store, nor MLflow, nor the run's local files; the rollout and verify stages say how much they replaced."""

from __future__ import annotations

import json
from pathlib import Path

from rlpipe.config import load_config, settings
from rlpipe.storage import TRAJECTORY_SCHEMA, open_store
from rlpipe.storage.layout import stage_prefix
from rlpipe.tracking.mlflow_utils import Tracker
from tests.flows.test_train_flow import invoke, rl_overrides

ASKER = "jane.doe@uni-bonn.de"  # in every prompt
GRADER = "ops.grader@example-lab.org"  # in every reason the test_leaky verifier gives


def _prompts(tmp_path: Path) -> Path:
    from rlpipe.config import DataConfig
    from rlpipe.data import build_arithmetic

    rows = build_arithmetic(DataConfig(test_size=8, validation_size=0)).to_pylist()
    rows = [r for r in rows if r["split"] == "train"][:40] + [r for r in rows if r["split"] == "test"]
    path = tmp_path / "leaky.jsonl"
    path.write_text("\n".join(json.dumps(r | {"task": "test_leaky", "prompt": f"{ASKER} asks: {r['prompt']}"}) for r in rows))
    return path


def _files_with(root: Path, needles: list[bytes]) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and any(n in p.read_bytes() for n in needles)]


def test_a_redacting_run_keeps_the_addresses_out_of_everything_it_writes(prefect_harness, tiny_checkpoint, tmp_path):
    data = _prompts(tmp_path)
    sets = rl_overrides(tiny_checkpoint, "redactrun", "hf", data, 1) + ["data.redact=true"]  # rows name test_leaky
    summary = invoke(["run", "--run-id", "redact-run"] + [x for s in sets for x in ("--set", s)])
    assert summary["iterations_done"] == 1

    store = open_store()
    rollout_meta = store.read_manifest(stage_prefix("redact-run", 0, "rollout"))["meta"]
    verify_prefix = stage_prefix("redact-run", 0, "verify")
    assert "data/redacted_values" in rollout_meta  # the rollout stage wrote through the redacting writer
    rows = store.read_stage(verify_prefix, schema=TRAJECTORY_SCHEMA).to_pylist()
    assert len(rows) == 16 and all(r["reward_reason"] == "graded; questions to [EMAIL]" for r in rows)
    assert store.read_manifest(verify_prefix)["meta"]["data/redacted_values"] >= 16

    cfg = load_config(None, sets)
    tracker = Tracker(settings(), cfg)
    logged = Path(tracker.client.download_artifacts(summary["mlflow_run_id"], "generations.json", str(tmp_path / "dl")))
    samples = json.loads(logged.read_text())
    text = json.dumps(samples)
    assert "[EMAIL] asks:" in text and ASKER not in text

    home, needles = settings().home, [ASKER.encode(), GRADER.encode()]
    # GRADER is this test's alone: nowhere in the project's state; ASKER (the unit tests' address too) not in this run's.
    assert _files_with(home, [GRADER.encode()]) == []
    for root in (home / "store" / "runs" / "redact-run", settings().run_dir("redact-run"), settings().artifact_root):
        assert _files_with(root, needles) == []
