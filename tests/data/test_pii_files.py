"""`rlpipe data validate` on personal data and secrets: findings per row/field/kind, masked; `--redact OUT`."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.data import load_prompts
from rlpipe.data.pii_files import pii_findings, redact_file
from rlpipe.storage.schemas import PROMPT_SCHEMA, TRAJECTORY_SCHEMA

EMAIL = "jane.doe@uni-bonn.de"
KEY = "AKIALALEMEL33243OLIB"
ROWS = [
    {"id": "q1", "prompt": f"Write to {EMAIL} and compute 12+34.", "task": "math", "ground_truth": "46", "split": "train"},
    {"id": "q2", "prompt": "What is 7*6?", "task": "exact", "ground_truth": f"42 (key {KEY})", "split": "train"},
    {"id": "q3", "prompt": "What is 3.14159 rounded to 2 places?", "task": "math", "ground_truth": "3.14", "split": "test"},
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _trajectory(**over):
    row = {"run_id": "r", "iteration": 1, "prompt_id": "q1", "sample_index": 0, "policy_version": "ab" * 32,
           "prompt_token_ids": [1, 2], "response_token_ids": [3], "response_text": "12+34=46", "logprobs": [-0.1],
           "loss_mask": [1], "steps": None, "reward": None, "reward_status": "skipped", "reward_reason": None,
           "verifier": "math", "verifier_version": None, "isolation": None, "truncated": False, "generate_s": 0.1,
           "verify_s": None}
    return row | over


def test_findings_name_row_field_and_kind_never_the_value(tmp_path):
    res = CliRunner().invoke(app, ["data", "validate", str(_jsonl(tmp_path / "p.jsonl", ROWS))])
    assert res.exit_code == 1, res.output
    assert "row q1: prompt: email ja" in res.output and "row q2: ground_truth: aws access key AKIA" in res.output
    assert EMAIL not in res.output and KEY not in res.output
    assert "q3" not in res.output  # maths is not personal data
    res = CliRunner().invoke(app, ["data", "validate", "--json", str(tmp_path / "p.jsonl")])
    found = [json.loads(line) for line in res.stdout.splitlines()]
    assert {(f["row"], f["field"], f["kind"]) for f in found} == {("q1", "prompt", "email"), ("q2", "ground_truth", "aws_access_key")}


def test_redact_writes_a_clean_copy_in_the_same_format(tmp_path):
    src = _jsonl(tmp_path / "p.jsonl", ROWS)
    out = tmp_path / "clean" / "p.jsonl"
    res = CliRunner().invoke(app, ["data", "validate", str(src), "--redact", str(out)])
    assert res.exit_code == 1 and f"{out}: de-identified copy written, 2 value(s) replaced" in res.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["q1", "q2", "q3"]
    assert rows[0]["prompt"] == "Write to [EMAIL] and compute 12+34." and rows[1]["ground_truth"] == "42 (key [AWS_ACCESS_KEY])"
    assert rows[2] == ROWS[2]
    assert CliRunner().invoke(app, ["data", "validate", str(out)]).exit_code == 0


def test_redact_parquet_prompts_keeps_the_schema(tmp_path):
    src = tmp_path / "p.parquet"
    pq.write_table(load_prompts(_jsonl(tmp_path / "p.jsonl", ROWS)), src)
    assert redact_file(src, tmp_path / "c.parquet") == 2
    copy = pq.read_table(tmp_path / "c.parquet")
    assert copy.schema.equals(PROMPT_SCHEMA) and pii_findings(copy) == []
    assert copy.column("prompt").to_pylist()[0] == "Write to [EMAIL] and compute 12+34."


def test_trajectory_file_findings_and_redaction(tmp_path):
    steps = [{"action": "search()", "observation": f"owner: {EMAIL}", "reward": None, "env_s": 0.0, "info": "{}"}]
    table = pa.Table.from_pylist([_trajectory(), _trajectory(sample_index=1, response_text=f"mail {EMAIL}", steps=steps)],
                                 schema=TRAJECTORY_SCHEMA)
    src, out = tmp_path / "part-0.parquet", tmp_path / "redacted.parquet"
    pq.write_table(table, src)
    res = CliRunner().invoke(app, ["data", "validate", str(src), "--redact", str(out)])
    assert res.exit_code == 1, res.output
    assert "row q1#1: response_text: email" in res.output and "row q1#1: steps[0].observation: email" in res.output
    assert "q1#0" not in res.output and EMAIL not in res.output and "2 value(s) replaced" in res.output
    copy = pq.read_table(out, schema=TRAJECTORY_SCHEMA).to_pylist()
    assert copy[1]["response_text"] == "mail [EMAIL]" and copy[1]["steps"][0]["observation"] == "owner: [EMAIL]"
    assert copy[1]["policy_version"] == "ab" * 32 and copy[0] == table.to_pylist()[0]


def test_redact_refuses_to_overwrite_or_change_format(tmp_path):
    src = _jsonl(tmp_path / "p.jsonl", ROWS)
    res = CliRunner().invoke(app, ["data", "validate", str(src), "--redact", str(src)])
    assert res.exit_code == 2 and "that is the file being validated" in res.output
    res = CliRunner().invoke(app, ["data", "validate", str(src), "--redact", str(tmp_path / "x.parquet")])
    assert res.exit_code == 2 and "name it *.jsonl" in res.output and not (tmp_path / "x.parquet").exists()


def test_preference_file_findings_and_redaction(tmp_path):
    rows = [{"id": "hh", "chosen": "\n\nHuman: who?\n\nAssistant: call +44 20 7123 4567",
             "rejected": "\n\nHuman: who?\n\nAssistant: no idea"},
            {"id": "plain", "prompt": "12+34=", "chosen": "46", "rejected": "47"}]
    src, out = _jsonl(tmp_path / "prefs.jsonl", rows), tmp_path / "clean.jsonl"
    res = CliRunner().invoke(app, ["data", "validate", str(src), "--redact", str(out)])
    assert res.exit_code == 1 and "row hh: chosen: phone +4" in res.output and "7123 4567" not in res.output
    copy = [json.loads(line) for line in out.read_text().splitlines()]
    assert copy[0]["chosen"].endswith("Assistant: call [PHONE]") and copy[1] == rows[1]


def test_redact_file_keeps_gzip(tmp_path):
    import gzip

    src, out = tmp_path / "p.jsonl.gz", tmp_path / "c.jsonl.gz"
    with gzip.open(src, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in ROWS))
    assert redact_file(src, out) == 2
    with gzip.open(out, "rt") as f:
        assert json.loads(f.readline())["prompt"] == "Write to [EMAIL] and compute 12+34."


def test_validate_refuses_a_gzipped_file_by_name_not_with_a_traceback(tmp_path):
    import gzip

    src = tmp_path / "p.jsonl.gz"
    with gzip.open(src, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in ROWS))
    res = CliRunner().invoke(app, ["data", "validate", str(src)])
    assert res.exit_code == 2, res.output
    assert "unknown prompt file type '.gz'" in res.output and "Traceback" not in res.output
