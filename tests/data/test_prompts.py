import json
import threading

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
    # The worked solution is kept for SFT, ending in the boxed reference.
    assert got[0]["solution"] == "In May she sold 48/2 = 24.\nIn all 48+24 = 72.\nThe answer is \\boxed{72}."
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


# -- references the verifier cannot use, and prompts that give their answer away -------------

CODE = {"id": "k1", "prompt": "Write f(x) = x + 1.", "task": "code", "split": "train",
        "solution": "```python\ndef f(x):\n    return x + 1\n```"}
FMT = {"id": "f1", "prompt": "Think, then answer 12+34.", "task": "format", "split": "train"}
JSN = {"id": "j1", "prompt": "Describe Ada as JSON.", "task": "json", "split": "train"}


@pytest.mark.parametrize(
    "bad,field,problem",
    [
        (FMT | {"ground_truth": '{"regex": "("}'}, "ground_truth", "regex '(' does not compile"),
        (FMT | {"ground_truth": '{"tagz": ["answer"]}'}, "ground_truth", "unknown key(s) ['tagz']"),
        (FMT | {"ground_truth": "{}"}, "ground_truth", "empty rule"),
        (FMT | {"ground_truth": "<answer>"}, "ground_truth", "rule is not JSON"),
        (JSN | {"ground_truth": '{"type": "objekt"}'}, "ground_truth", "invalid schema at type"),
        (JSN | {"ground_truth": '{"$ref": "#/definitions/person"}'}, "ground_truth", "invalid schema"),
        (OTHER | {"prompt": "7+7=14"}, "prompt", "contains its own reference answer '14'"),
        (OTHER | {"prompt": "What is 7+7?\nThe answer is 14."}, "prompt", "contains its own reference answer"),
        (OTHER | {"prompt": "Tom has 7 apples and gets 7 more. How many?\n#### 14"}, "prompt", "its own reference"),
        (OTHER | {"prompt": [{"role": "user", "content": "7 + 7 = 14"}], "id": "c1"}, "prompt", "its own reference"),
        # A code reference with a key the verifier does not read (MBPP's setup under another name), and asserts
        # copied out of a HumanEval check() without renaming `candidate`, or naming a function the solution lacks.
        (CODE | {"ground_truth": '{"tests": ["assert f(1) == 2"], "setup_code": "import math"}'}, "ground_truth",
         "key(s) ['setup_code'] are not read"),
        (CODE | {"ground_truth": '{"tests": ["assert candidate(1) == 2"]}'}, "ground_truth", 'no "entry_point"'),
        (CODE | {"ground_truth": '{"tests": ["assert g(1) == 2"]}'}, "ground_truth",
         "the tests use `g`, which neither the test code nor the row's solution defines"),
    ],
)
def test_unusable_references_and_leaked_answers_are_named(tmp_path, bad, field, problem):
    found = validate_prompts(load_prompts(jsonl(tmp_path, [GOOD, bad])))
    assert len(found) == 1, found
    f = found[0]
    assert (f.row, f.field) == (bad["id"], field) and problem in f.problem, f
    assert f.fix  # every finding says what to do


@pytest.mark.parametrize(
    "prompt,ground_truth",
    [
        ("14+3=", "17"), ("14+3=", "4"),  # '4' occurs inside 14, and as an operand of other rows
        ("8-4=", "4"), ("4*1=", "4"), ("0+4=", "4"),  # the answer equals an operand
        ("If x = 4, what is x + 1?", "5"), ("Let a = 5 and b = 5. What is a*b/5?", "5"),  # definitions
        ("12+34=46.5 is wrong; what is 12+34?", "46"), ("12+34=460?", "46"),  # not the whole number
        ("Q: 3+4=7\nQ: 2+5=", "7"),  # a few-shot example with the same answer
        ("Reply with yes or no. Answer: yes or no. Is 7 prime?", "yes"),
        ("A shop sold 1,250 cups. How many?", "1250"),
    ],
)
def test_no_false_alarm_on_operands_definitions_and_examples(tmp_path, prompt, ground_truth):
    assert validate_prompts(load_prompts(jsonl(tmp_path, [GOOD | {"prompt": prompt, "ground_truth": ground_truth}]))) == []


def test_builtin_arithmetic_has_no_findings():
    from rlpipe.config import DataConfig
    from rlpipe.data.arithmetic import build_arithmetic

    # One-digit operands over every operation: answers equal operands (0+4, 4*1, 8-4) and sit inside
    # other numbers (4 in 14) everywhere.
    small = DataConfig(digits=1, operations=["add", "sub", "mul"], test_size=60, validation_size=20)
    assert validate_prompts(build_arithmetic(small)) == []
    assert validate_prompts(build_arithmetic(DataConfig())) == []


@pytest.fixture
def checked(monkeypatch):
    """Record what reference checks are given, answering from a table: the math verifier's, and a
    tests-based verifier's (like ``code``) registered for this test only."""
    from rlpipe.rewards import base, get_verifier

    calls: list[tuple[str, str | None, dict]] = []

    def fake(name, verdicts):
        def check(reference, **options):
            calls.append((name, reference, options))
            if reference == "boom":
                raise RuntimeError("checker bug")
            return verdicts.get(reference)
        return check

    monkeypatch.setattr(get_verifier("math"), "check_reference", fake("math", {"\\frac{1}{": "cannot parse; write it as LaTeX"}))
    monkeypatch.setattr(base, "VERIFIERS", base.VERIFIERS.copy())
    base.register_verifier("test_tests", "1", options=("scoring",),
                           check_reference=fake("test_tests", {'["assert f(1) ==="]': "test 1 does not compile"}))(
        lambda response, ground_truth, **o: base.VerifyResult(1.0, "ok"))
    return calls


def test_each_reference_goes_to_its_verifier_through_the_registry(tmp_path, checked):
    rows = [
        GOOD,
        OTHER | {"ground_truth": "\\frac{1}{"},
        {"id": "c1", "prompt": "Write f.", "task": "test_tests", "ground_truth": None, "tests": ["assert f(1) ==="], "split": "train"},
        {"id": "c2", "prompt": "Write g.", "task": "test_tests", "ground_truth": None, "tests": ["assert g() == 1"], "split": "train"},
        GOOD | {"id": "b1", "prompt": "9+9=", "ground_truth": "boom"},
    ]
    found = {(f.row, f.field): f for f in validate_prompts(load_prompts(jsonl(tmp_path, rows)), options={"test_tests": {"scoring": "partial"}})}
    assert set(found) == {("q9", "ground_truth"), ("c1", "tests"), ("b1", "ground_truth")}
    assert "'math' verifier cannot use this ground_truth: cannot parse; write it as LaTeX" in found[("q9", "ground_truth")].problem
    assert "test 1 does not compile" in found[("c1", "tests")].problem  # rows without ground_truth: the tests are the reference
    assert "reference check crashed (RuntimeError: checker bug)" in found[("b1", "ground_truth")].problem
    assert ("test_tests", '["assert g() == 1"]', {"scoring": "partial"}) in checked  # the verifier's options go along


def test_a_reference_is_checked_once_per_distinct_value(tmp_path, checked):
    rows = [GOOD | {"id": f"q{i}", "prompt": f"{i}+0=", "ground_truth": str(i % 3)} for i in range(30)]
    assert validate_prompts(load_prompts(jsonl(tmp_path, rows))) == []
    assert sorted(ref for _, ref, _ in checked) == ["0", "1", "2"]


def test_json_rows_may_omit_the_schema(tmp_path):
    assert validate_prompts(load_prompts(jsonl(tmp_path, [JSN | {"ground_truth": None}]))) == []
    found = findings_for(tmp_path, [FMT | {"ground_truth": None}])
    assert found == [("f1", "ground_truth", "no ground truth and no tests")]


def test_cli_data_validate_names_reference_problems(tmp_path):
    bad = jsonl(tmp_path, [GOOD, FMT | {"ground_truth": '{"regex": "("}'}, OTHER | {"prompt": "7+7=14"}])
    res = CliRunner().invoke(app, ["data", "validate", str(bad), "--json"])
    assert res.exit_code == 1
    got = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [(f["row"], f["field"]) for f in got] == [("f1", "ground_truth"), ("q9", "prompt")]
    assert all(f["problem"] and f["fix"] for f in got)


def test_reference_checks_give_the_same_findings_off_the_main_thread(tmp_path):
    # prepare-dataset validates in a Prefect task thread, where math-verify's signal-based parse
    # timeout cannot run: the checks then run in a child process, with the same findings.
    table = load_prompts(jsonl(tmp_path, [GOOD, OTHER | {"ground_truth": "\\frac{1}{"}, FMT | {"ground_truth": '{"regex": "("}'}]))
    here = validate_prompts(table)
    there: list = []
    t = threading.Thread(target=lambda: there.append(validate_prompts(table)))
    t.start()
    t.join(120)
    assert [(f.row, f.field) for f in here] == [("q9", "ground_truth"), ("f1", "ground_truth")]
    assert "cannot be parsed by math-verify" in here[0].problem
    assert there == [here]
