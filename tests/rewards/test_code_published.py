"""Published code benchmarks' rows, as distributed, through the `code` verifier (tests/data/published/).

The verdicts must match the benchmark's own way of running its tests — program, test code and check in one
plain interpreter — on the canonical program and on wrong ones. The whole of HumanEval (164 problems) runs
in benchmarks/published_code.py; here a few rows of each form keep it in `make test`.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlpipe.rewards import get_verifier

code = get_verifier("code")
PUBLISHED = Path(__file__).resolve().parents[1] / "data" / "published"


def _rows(name):
    return [json.loads(line) for line in (PUBLISHED / name).read_text().splitlines() if line.strip()]


def _theirs(program, check):
    return subprocess.run([sys.executable, "-c", program + "\n" + check], capture_output=True, timeout=30).returncode == 0


def _wrong(program, entry_point):
    """The canonical program with its function redefined to return None (the mutants are benchmarks/published_code.py's)."""
    none = program + f"\n\ndef {entry_point}(*args, **kwargs):\n    return None\n"
    return [none]


def _humaneval(row):
    gt = json.dumps({"test": row["test"], "entry_point": row["entry_point"]})
    return gt, row["prompt"] + row["canonical_solution"], f"{row['test']}\ncheck({row['entry_point']})", row["entry_point"]


def _mbpp(row):
    ref = {"tests": row["test_list"]} | ({"test_setup_code": row["test_setup_code"]} if row["test_setup_code"] else {})
    name = row["test_list"][0].split("assert ", 1)[1].split("(", 1)[0].strip()
    return json.dumps(ref), row["code"], "\n".join([row["test_setup_code"], *row["test_list"]]), name


CASES = [(f"humaneval:{r['task_id']}", _humaneval(r)) for r in _rows("humaneval.jsonl")] + \
        [(f"mbpp:{r['task_id']}", _mbpp(r)) for r in _rows("mbpp.jsonl")]


@pytest.mark.parametrize("case", [c for _, c in CASES], ids=[i for i, _ in CASES])
def test_published_rows_are_accepted_and_judged_as_their_own_harness_judges(case):
    gt, canonical, check, entry_point = case
    assert code.check_reference(gt) is None
    for program in [canonical, *_wrong(canonical, entry_point)]:
        ours = code(f"```python\n{program}\n```", gt, scoring="all")
        assert ours.status == "ok", ours.reason
        assert (ours.reward == 1.0) == _theirs(program, check), (program[-200:], ours.reason)
    assert code(canonical, gt, scoring="all").reward == 1.0
