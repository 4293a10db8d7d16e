import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.rewards.audit import LabelsError, audit, load_labels
from rlpipe.rewards.pool import VerifierPool

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(workers=2, timeout_s=20) as p:
        yield p


def test_audit_counts_false_positives_and_negatives(tmp_path, pool):
    f = tmp_path / "labels.jsonl"
    f.write_text("\n".join(json.dumps(c) for c in [
        {"task": "exact", "response": "46", "ground_truth": "46", "expected": 1},
        {"task": "exact", "response": "46.0", "ground_truth": "46", "expected": 1},  # exact says 0: FN
        {"task": "exact", "response": "45", "ground_truth": "46", "expected": 0},
        {"task": "exact", "response": "45", "ground_truth": "45", "expected": 0},  # exact says 1: FP
        {"task": "math", "response": "", "ground_truth": "1", "expected": 0},  # unparseable: not ok
    ]))
    report = audit(load_labels(f), pool)
    e, m = report["exact"], report["math"]
    assert (e["n"], e["agree"], e["false_positive"], e["false_negative"], e["agreement"]) == (4, 2, 1, 1, 0.5)
    assert [d["line"] for d in e["disagreements"]] == [2, 4]
    assert m["not_ok"] == 1 and m["agreement"] == 0.0


def test_bad_label_files_name_the_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"task": "math", "response": "1", "expected": 1}\n{"task": "math", "response": "1", "expected": 2}\n')
    with pytest.raises(LabelsError, match="line 2: expected must be 0 or 1"):
        load_labels(f)
    f.write_text('{"task": "math"}\n')
    with pytest.raises(LabelsError, match="line 1: missing"):
        load_labels(f)


def test_shipped_labelled_sets(tmp_path):
    out = tmp_path / "report.json"
    res = CliRunner().invoke(app, ["verifier", "audit", *(str(ROOT / "datasets/audit" / f) for f in
                                                          ("math.jsonl", "format.jsonl", "code.jsonl")), "--out", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    # The shipped verifiers never reward a case labelled wrong on these sets.
    assert all(r["false_positive"] == 0 for r in report.values())
    for name in ("format", "json", "code", "python_expr"):
        assert report[name]["agreement"] == 1.0, report[name]["disagreements"]
    assert report["math"]["agreement"] >= 0.9
