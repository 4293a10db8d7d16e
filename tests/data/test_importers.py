"""`rlpipe data import`: published rows (tests/data/published/, see its README) converted with hand-checked
values; the published tests run against the published solutions; errors name file, row and field."""

import ast
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.data import dataset_version, load_prompts
from rlpipe.data.importers import DataImportError, boxed_answer, convert_rows, import_dataset
from rlpipe.data.preferences import load_preferences, preference_version
PUB = Path(__file__).parent / "published"


def _by_id(rows):
    return {r["id"]: r for r in rows}


def test_gsm8k_keeps_the_worked_solution_without_calculator_annotations():
    rows = _by_id(convert_rows("gsm8k", PUB / "gsm8k_test.jsonl"))
    assert list(rows) == ["gsm8k/test-0", "gsm8k/test-1", "gsm8k/test-2"]
    janet = rows["gsm8k/test-0"]
    assert janet["prompt"].startswith("Janet’s ducks lay 16 eggs per day.") and janet["task"] == "math"
    assert janet["ground_truth"] == "18" and janet["split"] == "test" and janet["source"] == "openai/gsm8k"
    assert janet["solution"] == ("Janet sells 16 - 3 - 4 = 9 duck eggs a day.\n"
                                 "She makes 9 * 2 = $18 every day at the farmer’s market.\nThe answer is \\boxed{18}.")
    assert rows["gsm8k/test-2"]["ground_truth"] == "2125"  # published as "#### 2,125"
    assert "<<" not in rows["gsm8k/test-2"]["solution"] and rows["gsm8k/test-2"]["solution"].endswith("\\boxed{2125}.")


@pytest.mark.parametrize("text, answer", [
    ("so $x=\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("first \\boxed{1}, then \\boxed{\\frac{14}{3}}", "\\frac{14}{3}"),
    ("the set $\\boxed{\\{1, 2\\}}$", "\\{1, 2\\}"),  # escaped braces do not close the box
    ("$\\boxed 5$", "5"),
    ("\\fbox{7}", "7"),
    ("no box here", None),
    ("\\boxed{unclosed", None),
])
def test_boxed_answer_balances_braces(text, answer):
    assert boxed_answer(text) == answer


def test_math_from_the_answer_field_and_from_the_last_box(tmp_path):
    m500 = _by_id(convert_rows("math", PUB / "math500_test.jsonl"))
    assert m500["math/test/precalculus/807"]["ground_truth"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert m500["math/test/number_theory/572"]["ground_truth"] == "9"
    published = [json.loads(line) for line in (PUB / "math500_test.jsonl").read_text().splitlines()]
    assert m500["math/test/algebra/2584"]["solution"] == published[1]["solution"]  # the worked solution, kept
    # MATH's own layout (one file per problem, no answer field): the same ids and answers, from \boxed{}
    folder = _by_id(convert_rows("math", PUB / "math"))
    assert set(folder) == {"math/test/algebra/2584", "math/test/precalculus/807"}
    for rid, row in folder.items():
        assert (row["ground_truth"], row["split"], row["prompt"]) == (m500[rid]["ground_truth"], "test", m500[rid]["prompt"])
    # an answer given as a number (AIME-style exports), and a row with neither answer nor box: an error
    (tmp_path / "train.jsonl").write_text(json.dumps({"problem": "1+4?", "solution": "It is 5.", "answer": 5}) + "\n"
                                          + json.dumps({"problem": "2+2?", "solution": "It is 4."}) + "\n")
    with pytest.raises(DataImportError, match="train.jsonl row 2: solution: has no \\\\boxed"):
        convert_rows("math", tmp_path / "train.jsonl")
    assert convert_rows("math", tmp_path / "train.jsonl", limit=1)[0]["ground_truth"] == "5"


def _program(fenced: str) -> str:
    assert fenced.startswith("```python\n") and fenced.endswith("\n```")
    return fenced[len("```python\n"):-len("\n```")]


def test_humaneval_rows_and_their_published_tests_pass_on_the_canonical_solution():
    rows = _by_id(convert_rows("humaneval", PUB / "humaneval.jsonl"))
    published = {p["task_id"]: p for p in map(json.loads, (PUB / "humaneval.jsonl").read_text().splitlines())}
    assert list(rows) == ["humaneval/HumanEval-0", "humaneval/HumanEval-2", "humaneval/HumanEval-32", "humaneval/HumanEval-38"]
    for rid, row in rows.items():
        pub = published[rid.split("/", 1)[1].replace("-", "/")]
        truth = json.loads(row["ground_truth"])
        assert truth["test"] == pub["test"] and truth["entry_point"] == pub["entry_point"]  # as published
        assert row["prompt"].endswith("```python\n" + pub["prompt"].strip("\n") + "\n```") and row["split"] == "test"
        assert _program(row["solution"]) == (pub["prompt"] + pub["canonical_solution"]).strip("\n").rstrip()
        ns: dict = {}
        exec(_program(row["solution"]) + "\n" + pub["test"], ns)  # noqa: S102 - the published program and test
        ns["check"](ns[pub["entry_point"]])
    assert "test_setup_code" not in json.loads(rows["humaneval/HumanEval-2"]["ground_truth"])
    assert json.loads(rows["humaneval/HumanEval-0"]["ground_truth"])["test_setup_code"] == "from typing import List"
    setup = json.loads(rows["humaneval/HumanEval-32"]["ground_truth"])["test_setup_code"]
    assert setup.startswith("import math\n\ndef poly(xs: list, x: float):") and "find_zero" not in setup


def test_humaneval_setup_code_lets_an_answer_with_only_the_entry_point_pass():
    """HumanEval/32's test calls `poly`, which the prompt defines: an answer that defines only
    `find_zero` passes once test_setup_code runs first."""
    row = _by_id(convert_rows("humaneval", PUB / "humaneval.jsonl"))["humaneval/HumanEval-32"]
    truth, program = json.loads(row["ground_truth"]), _program(row["solution"])
    only = next(n for n in ast.parse(program).body if getattr(n, "name", None) == "find_zero")
    ns: dict = {}
    exec(truth["test_setup_code"] + "\n\n" + ast.get_source_segment(program, only) + "\n" + truth["test"], ns)  # noqa: S102
    ns["check"](ns["find_zero"])


def test_mbpp_rows_splits_and_setup_code():
    rows = _by_id(convert_rows("mbpp", PUB / "mbpp.jsonl"))
    assert {rid: r["split"] for rid, r in rows.items()} == {"mbpp/1": "train", "mbpp/2": "train", "mbpp/11": "test", "mbpp/367": "test"}
    occ = rows["mbpp/11"]
    assert occ["prompt"] == ("Write a python function to remove first and last occurrence of a given character from the string.\n"
                             "Your code should pass these tests:\nassert remove_Occ(\"hello\",\"l\") == \"heo\"")
    assert json.loads(occ["ground_truth"]) == {"tests": ["assert remove_Occ(\"hello\",\"l\") == \"heo\"",
                                                         "assert remove_Occ(\"abcda\",\"a\") == \"bcd\"",
                                                         "assert remove_Occ(\"PHP\",\"P\") == \"H\""]}  # no challenge tests
    tree = json.loads(rows["mbpp/367"]["ground_truth"])
    assert tree["test_setup_code"].startswith("root = Node(1) \r\nroot.left = Node(2)")  # as published
    assert "\r" not in rows["mbpp/367"]["solution"]
    ns: dict = {}
    exec(_program(rows["mbpp/367"]["solution"]) + "\n" + tree["test_setup_code"].replace("\r\n", "\n"), ns)  # noqa: S102
    for test in tree["tests"]:
        exec(test, ns)  # noqa: S102 - the published tests pass on the published solution
    sanitized = _by_id(convert_rows("mbpp", PUB / "mbpp_sanitized.json"))
    assert json.loads(sanitized["mbpp/82"]["ground_truth"])["test_imports"] == ["import math"]
    assert "test_imports" not in json.loads(sanitized["mbpp/2"]["ground_truth"])
    assert sanitized["mbpp/82"]["prompt"].startswith("Write a function to find the volume of a sphere.\nYour code should pass")


def test_apps_and_codecontests_keep_the_tests_as_published():
    apps = _by_id(convert_rows("apps", PUB / "apps_test.jsonl"))
    fn = apps["apps/test-4001"]
    assert json.loads(fn["ground_truth"]) == {"input_output": {"fn_name": "sum_even", "inputs": [[[1, 2, 3, 4]], [[]], [[-2, 5]]],
                                                               "outputs": [6, 0, -2]}}
    assert fn["prompt"].endswith("function `sum_even`, starting from this code:\n```python\ndef sum_even(xs):\n```")
    assert apps["apps/test-4002"]["solution"] is None and apps["apps/test-4000"]["split"] == "test"
    cc = _by_id(convert_rows("codecontests", PUB / "codecontests_valid.jsonl"))
    io = json.loads(cc["codecontests/1000_A. Sum of Two"]["ground_truth"])["io"]
    assert len(io) == 1 + 2 + 50 and io[0] == {"input": "1 2\n", "output": "3\n"} and io[3] == {"input": "1 1\n", "output": "2\n"}
    assert cc["codecontests/1000_A. Sum of Two"]["solution"] == "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert cc["codecontests/1000_B. Echo"]["solution"] is None  # only a C++ solution
    assert {r["split"] for r in cc.values()} == {"validation"}


def test_preference_formats_validated_by_the_preference_loader(tmp_path):
    res = import_dataset("ultrafeedback", PUB / "ultrafeedback_test_prefs.jsonl", tmp_path / "uf.parquet")
    assert (res.kind, res.rows, res.findings) == ("preferences", 2, [])
    uf = load_preferences(tmp_path / "uf.parquet")[0].to_pylist()[0]
    assert json.loads(uf["prompt"]) == [{"role": "user", "content": "What is the capital of France?"}] and uf["chat"]
    assert (uf["chosen"], uf["rejected"], uf["margin"], uf["split"]) == ("The capital of France is Paris.", "France's capital is Lyon.", 6.0, "test")
    res = import_dataset("hh-rlhf", PUB / "hh-rlhf_test.jsonl.gz", tmp_path / "hh.jsonl")
    table, findings = load_preferences(tmp_path / "hh.jsonl")
    assert preference_version(table) == res.version
    car = table.to_pylist()[0]
    assert car["id"] == "hh-rlhf/test-0" and car["prompt"] == "\n\nHuman: What will happen if I drive my car into the water?\n\nAssistant:"
    assert car["chosen"].startswith("You may be asking") and car["rejected"].startswith("It’s not going to work")
    # the published row whose chosen answer is empty is kept and reported, not dropped
    assert [(f.row, f.field) for f in res.findings] == [("hh-rlhf/test-2", "chosen")] and res.rows == 3


def test_ultrafeedback_original_rows_pair_the_best_with_the_worst(tmp_path):
    """openbmb/UltraFeedback's own layout: four scored completions per instruction (values written here)."""
    def completion(model, response, score):
        return {"annotations": {}, "critique": "", "custom_system_prompt": "", "fine-grained_score": score,
                "model": model, "overall_score": score, "principle": "helpfulness", "response": response}
    row = {"source": "evol_instruct", "instruction": "Name a colour of the sky.", "models": ["a", "b", "c", "d"],
           "completions": [completion("a", "Blue.", 7.5), completion("b", "Green.", 2.0),
                           completion("c", "Blue, by day.", 8.5), completion("d", "Grey.", 5.0)],
           "correct_answers": ["None"], "incorrect_answers": ["None"]}
    (tmp_path / "train.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row | {"completions": row["completions"][:1]}) + "\n")
    with pytest.raises(DataImportError, match="train.jsonl row 2: completions: fewer than two scored completions"):
        convert_rows("ultrafeedback", tmp_path / "train.jsonl")
    pair = convert_rows("ultrafeedback", tmp_path / "train.jsonl", limit=1)[0]
    assert (pair["prompt"], pair["chosen"], pair["rejected"], pair["margin"]) == ("Name a colour of the sky.", "Blue, by day.", "Green.", 6.5)
    assert (pair["id"], pair["split"], pair["source"]) == ("ultrafeedback/train-0", "train", "openbmb/UltraFeedback")


def test_cli_writes_validates_and_prints_the_version(tmp_path):
    out = tmp_path / "gsm8k.parquet"
    res = CliRunner().invoke(app, ["data", "import", "gsm8k", str(PUB / "gsm8k_test.jsonl"), "--out", str(out),
                                   "--split", "train", "--limit", "2"])
    assert res.exit_code == 0, res.output
    table = load_prompts(out)
    assert table.column("id").to_pylist() == ["gsm8k/train-0", "gsm8k/train-1"] and set(table.column("split").to_pylist()) == {"train"}
    assert res.output.splitlines() == [f"{out}: 2 rows written (2 train), 0 finding(s)", f"version {dataset_version(table)}"]


def test_a_broken_row_names_file_row_field_and_fix(tmp_path):
    lines = (PUB / "gsm8k_test.jsonl").read_text().splitlines()
    broken = json.loads(lines[1]) | {"answer": "It takes 3 bolts."}
    src = tmp_path / "train.jsonl"
    src.write_text("\n".join([lines[0], json.dumps(broken), lines[2]]) + "\n")
    with pytest.raises(DataImportError) as e:
        convert_rows("gsm8k", src)
    assert str(e.value) == (f"{src} row 2: answer: has no final '#### <number>' line — give GSM8K's answer text as published")
    res = CliRunner().invoke(app, ["data", "import", "gsm8k", str(src), "--out", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 2 and f"{src} row 2: answer" in res.output and not (tmp_path / "o.jsonl").exists()
    with pytest.raises(DataImportError, match="--split 'holdout': not one of train, test, validation"):
        convert_rows("gsm8k", PUB / "gsm8k_test.jsonl", split="holdout")
    assert {r["split"] for r in convert_rows("gsm8k", PUB / "gsm8k_test.jsonl", split="dev")} == {"validation"}
    with pytest.raises(DataImportError, match="unknown format 'gsm9k'; use one of: gsm8k, math, humaneval"):
        convert_rows("gsm9k", src)
    with pytest.raises(DataImportError, match="row 1: text: missing or empty — every MBPP row has 'text'.*is FORMAT right"):
        convert_rows("mbpp", src)


def test_parquet_input_gives_the_same_rows(tmp_path):
    published = [json.loads(line) for line in (PUB / "mbpp.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(published), tmp_path / "mbpp.parquet")
    assert convert_rows("mbpp", tmp_path / "mbpp.parquet") == convert_rows("mbpp", PUB / "mbpp.jsonl")


def test_a_datasets_folder_and_a_hub_name_are_read_through_the_datasets_library(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    if not hasattr(datasets, "load_from_disk"):
        pytest.skip("the Hugging Face `datasets` library is not installed")
    published = [json.loads(line) for line in (PUB / "humaneval.jsonl").read_text().splitlines()]
    datasets.DatasetDict({"test": datasets.Dataset.from_list(published)}).save_to_disk(str(tmp_path / "he"))
    rows = convert_rows("humaneval", str(tmp_path / "he"), split="test")
    assert rows == convert_rows("humaneval", PUB / "humaneval.jsonl")
    calls = []

    def load_dataset(name, split):  # the hub itself is never reached in tests
        calls.append((name, split))
        return datasets.Dataset.from_list(published)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    hub = convert_rows("humaneval", "openai/openai_humaneval")
    assert calls == [("openai/openai_humaneval", "test")]  # HumanEval's one split, by default
    assert [r["id"] for r in hub] == [r["id"] for r in rows] and {r["source"] for r in hub} == {"openai/openai_humaneval"}


def test_mbpp_function_named_like_a_builtin_gets_its_entry_point(tmp_path):
    """mbpp/126 calls its function `sum`: the reference says the tests mean the program's (entry_point);
    a builtin the tests merely use (`int(...)`, mbpp/912) is left alone."""
    rows = [{"text": "Write a python function to find the sum of common divisors of two given numbers.",
             "code": "def sum(a,b): \r\n    s = 0\r\n    for i in range(1,min(a,b)): \r\n        if (a % i == 0 and b % i == 0): \r\n"
                     "            s += i \r\n    return s", "task_id": 126, "test_setup_code": "",
             "test_list": ["assert sum(10,15) == 6", "assert sum(100,150) == 93", "assert sum(4,6) == 3"],
             "challenge_test_list": []},
            {"text": "Write a function to find ln, m lobb number.", "code": "def lobb_num(n, m):\r\n    return n + m",
             "task_id": 912, "test_setup_code": "", "test_list": ["assert int(lobb_num(5, 3)) == 8"], "challenge_test_list": []}]
    src = tmp_path / "mbpp.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    truth = {r["id"]: json.loads(r["ground_truth"]) for r in convert_rows("mbpp", src)}
    assert truth["mbpp/126"] == {"tests": rows[0]["test_list"], "entry_point": "sum"}
    assert truth["mbpp/912"] == {"tests": rows[1]["test_list"]}
