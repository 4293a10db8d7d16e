import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.rewards.audit import LabelsError, audit, load_labels, totals
from rlpipe.rewards.pool import VerifierPool

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(workers=2, grace_s=5) as p:
        yield p


def test_audit_counts_false_positives_and_negatives(tmp_path, pool):
    f = tmp_path / "labels.jsonl"
    f.write_text("\n".join(json.dumps(c) for c in [
        {"task": "exact", "category": "int", "response": "46", "ground_truth": "46", "expected": 1},
        {"task": "exact", "category": "dec", "response": "46.0", "ground_truth": "46", "expected": 1},  # exact says 0: FN
        {"task": "exact", "category": "int", "response": "45", "ground_truth": "46", "expected": 0},
        {"task": "exact", "category": "int", "response": "45", "ground_truth": "45", "expected": 0},  # exact says 1: FP
        {"task": "math", "response": "1", "ground_truth": "", "expected": 1},  # broken reference: not ok
    ]))
    report = audit(load_labels(f), pool)
    e, m = report["exact"], report["math"]
    assert (e["n"], e["agree"], e["false_positive"], e["false_negative"], e["agreement"]) == (4, 2, 1, 1, 0.5)
    assert [d["line"] for d in e["disagreements"]] == [2, 4]
    assert m["not_ok"] == 1 and m["agreement"] == 0.0
    cats = {k: (c["n"], c["agree"], c["false_positive"], c["false_negative"], c["not_ok"], c["agreement"])
            for k, c in e["categories"].items()}
    assert cats == {"int": (3, 2, 1, 0, 0, 0.6667), "dec": (1, 0, 0, 1, 0, 0.0)}
    assert list(m["categories"]) == ["-"] and m["categories"]["-"]["not_ok"] == 1
    assert totals(report) == {"n": 5, "agree": 2, "false_positive": 1, "false_negative": 1, "not_ok": 1,
                              "agreement": 0.4}


def test_bad_label_files_name_the_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"task": "math", "response": "1", "expected": 1}\n{"task": "math", "response": "1", "expected": 2}\n')
    with pytest.raises(LabelsError, match="line 2: expected must be 0 or 1"):
        load_labels(f)
    f.write_text('{"task": "math"}\n')
    with pytest.raises(LabelsError, match="line 1: missing"):
        load_labels(f)


def test_shipped_labelled_sets(pool):
    # code.jsonl runs sandboxed programs (over 10 s); the code verifier's tests audit it.
    cases = [c for f in ("math.jsonl", "format.jsonl") for c in load_labels(ROOT / "datasets/audit" / f)]
    report = audit(cases, pool)
    # The shipped verifiers never reward a case labelled wrong on these sets.
    assert all(r["false_positive"] == 0 for r in report.values()), {k: r["disagreements"] for k, r in report.items()}
    for name in ("format", "json"):
        assert report[name]["agreement"] == 1.0, report[name]["disagreements"]
    overall = totals(report)
    assert overall["agreement"] >= 0.98 and overall["false_positive"] == 0, overall
    math = report["math"]
    assert math["n"] >= 150 and math["agreement"] >= 0.98, math["disagreements"]
    # Every category the math set promises is there and has no false positive.
    for cat in ("integers", "decimals", "fractions", "latex", "intervals", "sets", "tuples", "matrices", "units",
                "percentages", "thousands", "expressions", "wrong_but_close", "negative", "text_around"):
        assert math["categories"][cat]["n"] >= 5 and math["categories"][cat]["false_positive"] == 0, cat


def test_cli_prints_verifier_category_and_total_rows(tmp_path):
    f, out = tmp_path / "labels.jsonl", tmp_path / "report.json"
    f.write_text("\n".join(json.dumps(c) for c in [
        {"task": "exact", "category": "integers", "response": "46", "ground_truth": "46", "expected": 1},
        {"task": "exact", "category": "decimals", "response": "46.0", "ground_truth": "46", "expected": 1},
        {"task": "exact", "category": "decimals", "response": "4.5", "ground_truth": "4.5", "expected": 1},
    ]))
    res = CliRunner().invoke(app, ["verifier", "audit", str(f), "--out", str(out), "--workers", "1", "--grace", "2"])
    assert res.exit_code == 0, res.output
    lines = [ln.split() for ln in res.output.splitlines()]
    assert ["exact", "3", "66.7%", "0", "1", "0"] in lines
    assert ["decimals", "2", "50.0%", "0", "1", "0"] in lines and ["integers", "1", "100.0%", "0", "0", "0"] in lines
    assert ["total", "3", "66.7%", "0", "1", "0"] in lines
    assert json.loads(out.read_text())["exact"]["categories"]["decimals"]["false_negative"] == 1


def test_math_verify_suite():
    # An independent check: cases from math-verify's own test suite, their maintainers' labels (relabelled
    # only where rlpipe's documented conventions differ, each with a note). One known miss: a reference with
    # \pm inside \frac that math-verify cannot parse (an error verdict, not a false positive).
    # ~15 CPU-seconds of math-verify: its own pool uses the machine's cores (under 10 s from 4 cores up).
    with VerifierPool(workers=max(2, min(8, os.cpu_count() or 2)), grace_s=5) as wide:
        report = audit(load_labels(ROOT / "datasets/audit/math_verify_suite.jsonl"), wide)["math"]
    assert report["n"] >= 150
    assert report["false_positive"] == 0, report["disagreements"]
    assert report["agreement"] >= 0.99, report["disagreements"]
