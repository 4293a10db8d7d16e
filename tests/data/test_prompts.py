import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.data import PromptFileError, dataset_version, load_prompts, validate_prompts
from rlpipe.storage.schemas import PROMPT_SCHEMA

GOOD = {"id": "q1", "prompt": "1+1=", "task": "math", "ground_truth": "2", "split": "train"}
OTHER = GOOD | {"id": "q9", "prompt": "7+7=", "ground_truth": "14"}


def jsonl(tmp_path, rows, name="p.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def findings_for(tmp_path, rows):
    table = load_prompts(jsonl(tmp_path, rows))
    assert table.num_rows == len(rows)  # nothing is dropped on load
    return [(f.row, f.field, f.problem) for f in validate_prompts(table)]


def test_good_file_has_no_findings(tmp_path):
    assert findings_for(tmp_path, [GOOD, GOOD | {"id": "q2", "prompt": "2+2=", "ground_truth": "4", "split": "test"}]) == []


@pytest.mark.parametrize(
    "bad,row,field,problem",
    [
        (OTHER | {"prompt": "   "}, "q9", "prompt", "empty prompt"),
        (OTHER | {"ground_truth": None}, "q9", "ground_truth", "no ground truth"),
        (OTHER | {"ground_truth": ""}, "q9", "ground_truth", "no ground truth"),
        (OTHER | {"task": "astrology"}, "q9", "task", "unknown verifier 'astrology'"),
        (OTHER | {"split": "dev"}, "q9", "split", "unknown split 'dev'"),
        (OTHER | {"prompt": [{"role": "wizard", "content": "x"}]}, "q9", "prompt", "chat prompt"),
    ],
)
def test_each_finding_names_its_row(tmp_path, bad, row, field, problem):
    found = findings_for(tmp_path, [GOOD, bad])
    assert len(found) == 1, found
    assert found[0][0] == row and found[0][1] == field and problem in found[0][2]


def test_duplicate_ids_and_prompts(tmp_path):
    found = findings_for(tmp_path, [GOOD, GOOD | {"prompt": "3+3=", "ground_truth": "6"}, GOOD | {"id": "q3", "prompt": " 1+1= "}])
    assert ("q1", "id", "id used by 2 rows") in found
    assert any(r == "q3" and f == "prompt" and "duplicate of row q1" in p for r, f, p in found)


def test_train_test_leakage_names_both_rows(tmp_path):
    found = findings_for(tmp_path, [GOOD, GOOD | {"id": "t1", "split": "test"}])
    assert found == [("t1", "split", "leak: the same prompt is row q1 in train")]


def test_gsm8k_style_file_loads_and_validates(tmp_path):
    rows = [
        {"question": "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in all?",
         "answer": "In May she sold 48/2 = 24.\nIn all 48+24 = 72.\n#### 72"},
        {"question": "Weng earns $12 an hour. How much for 50 minutes?", "answer": "12/60*50 = 10\n#### 1,000"},
    ]
    table = load_prompts(jsonl(tmp_path, rows, "gsm8k_train.jsonl"))
    got = table.to_pylist()
    assert [r["ground_truth"] for r in got] == ["72", "1000"]
    assert got[0]["task"] == "math" and got[0]["split"] == "train" and got[0]["id"] == "gsm8k_train-1"
    assert validate_prompts(table) == []


def test_chat_prompts_are_kept_as_messages(tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    table = load_prompts(jsonl(tmp_path, [GOOD | {"prompt": msgs}]))
    row = table.to_pylist()[0]
    assert row["chat"] is True and json.loads(row["prompt"]) == msgs
    assert validate_prompts(table) == []


def test_unreadable_files_say_where(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps(GOOD) + "\n{not json\n")
    with pytest.raises(PromptFileError, match="line 2"):
        load_prompts(p)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(PromptFileError, match="unknown prompt file type"):
        load_prompts(tmp_path / "x.csv")
    pq.write_table(pa.table({"question_text": ["1+1="]}), tmp_path / "bad.parquet")
    with pytest.raises(PromptFileError, match="'id' is missing"):
        load_prompts(tmp_path / "bad.parquet")


def test_parquet_round_trip_and_version_ignores_row_order(tmp_path):
    rows = [GOOD, GOOD | {"id": "q2", "prompt": "2+2=", "ground_truth": "4"}]
    t1 = load_prompts(jsonl(tmp_path, rows))
    pq.write_table(t1, tmp_path / "p.parquet")
    t2 = load_prompts(tmp_path / "p.parquet")
    assert t2.schema.equals(PROMPT_SCHEMA, check_metadata=False)
    assert dataset_version(t1) == dataset_version(t2) == dataset_version(load_prompts(jsonl(tmp_path, rows[::-1], "r.jsonl")))
    changed = load_prompts(jsonl(tmp_path, [GOOD | {"ground_truth": "3"}, rows[1]], "c.jsonl"))
    assert dataset_version(changed) != dataset_version(t1)


def test_cli_data_validate_and_build(tmp_path):
    runner = CliRunner()
    bad = jsonl(tmp_path, [GOOD, GOOD | {"id": "t1", "split": "test"}, GOOD | {"id": "q5", "prompt": "", "ground_truth": None}])
    res = runner.invoke(app, ["data", "validate", str(bad)])
    assert res.exit_code == 1
    assert "row t1: split: leak" in res.output and "row q5: prompt: empty prompt" in res.output
    assert "row q5: ground_truth" in res.output and "3 rows, 3 finding(s)" in res.output
    out = tmp_path / "arith.parquet"
    res = runner.invoke(app, ["data", "build", "--out", str(out), "--set", "data.test_size=100"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["data", "validate", str(out)])
    assert res.exit_code == 0 and "8100 rows, ok" in res.output
