"""Preference tables: the public conventions normalised, every bad row named, nothing dropped; the synthetic task."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlpipe.data import build_arithmetic
from rlpipe.data.preferences import (
    PreferenceFileError, build_synthetic_preferences, is_preference_file, load_preferences, preference_version,
)
from rlpipe.rewards.closeness import closeness_quality


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_plain_ultrafeedback_and_hh_rlhf_rows_normalise(tmp_path):
    conv = [{"role": "user", "content": "2+2?"}]
    rows = [
        {"id": "plain", "prompt": "12+34=", "chosen": "46", "rejected": "47", "margin": 0.5, "split": "validation"},
        {"id": "uf", "prompt": "2+2?", "chosen": conv + [{"role": "assistant", "content": "4"}],
         "rejected": conv + [{"role": "assistant", "content": "5"}]},
        {"id": "hh", "chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "\n\nHuman: hi\n\nAssistant: go away"},
        {"id": "answers-only", "prompt": "say hi", "chosen": [{"role": "assistant", "content": "hi"}],
         "rejected": [{"role": "assistant", "content": "no"}]},
    ]
    table, findings = load_preferences(_write(tmp_path / "p.jsonl", rows))
    assert findings == []
    got = {r["id"]: r for r in table.to_pylist()}
    assert got["plain"] | {} == {"id": "plain", "prompt": "12+34=", "chat": False, "chosen": "46", "rejected": "47",
                                 "margin": 0.5, "split": "validation", "source": None}
    assert got["uf"]["chat"] and json.loads(got["uf"]["prompt"]) == conv and (got["uf"]["chosen"], got["uf"]["rejected"]) == ("4", "5")
    assert got["hh"]["prompt"] == "\n\nHuman: hi\n\nAssistant:" and got["hh"]["chosen"] == "hello" and got["hh"]["rejected"] == "go away"
    assert got["answers-only"] | {} == got["answers-only"] and got["answers-only"]["prompt"] == "say hi"
    assert is_preference_file(tmp_path / "p.jsonl")

    pq.write_table(table, tmp_path / "p.parquet")  # the same pairs as Parquet: the same version
    again, _ = load_preferences(tmp_path / "p.parquet")
    assert preference_version(again) == preference_version(table)
    assert preference_version(table.take([3, 2, 1, 0])) == preference_version(table)  # order does not matter


BAD = [
    ({"id": "a", "prompt": "x", "rejected": "r"}, "a", "chosen", "missing"),
    ({"id": "b", "prompt": "x", "chosen": "same", "rejected": "same"}, "b", "rejected", "same text as chosen"),
    ({"id": "c", "prompt": "x", "chosen": " ", "rejected": "r"}, "c", "chosen", "empty"),
    ({"id": "d", "prompt": "x", "chosen": "c", "rejected": "r", "margin": -1}, "d", "margin", "≥ 0"),
    ({"id": "e", "prompt": "x", "chosen": "c", "rejected": "r", "margin": "big"}, "e", "margin", "≥ 0"),
    ({"id": "f", "prompt": "x", "chosen": "c", "rejected": "r", "split": "dev"}, "f", "split", "not one of"),
    ({"id": "g", "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "other q"}, {"role": "assistant", "content": "b"}]}, "g", "prompt", "different conversations"),
    ({"id": "h", "chosen": [{"role": "user", "content": "q"}],
      "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]},
     "h", "chosen", "not the assistant's answer"),
    ({"id": "i", "chosen": "just text", "rejected": "other text"}, "i", "chosen", "not Human/Assistant transcripts"),
    ({"id": "j", "chosen": "\n\nHuman: a\n\nAssistant: x", "rejected": "\n\nHuman: b\n\nAssistant: y"}, "j", "prompt", "differ"),
    ({"id": "k", "prompt": "q", "chosen": [{"role": "assistant"}], "rejected": [{"role": "assistant", "content": "b"}]},
     "k", "chosen", "not a list of"),
]


@pytest.mark.parametrize("row,rid,field,problem", BAD, ids=[b[1] for b in BAD])
def test_each_bad_row_is_named_with_its_field_and_kept(tmp_path, row, rid, field, problem):
    good = {"id": "ok", "prompt": "q", "chosen": "c", "rejected": "r"}
    table, findings = load_preferences(_write(tmp_path / "p.jsonl", [good, row]))
    assert [(f.row, f.field) for f in findings] == [(rid, field)]
    assert problem in findings[0].problem and findings[0].fix
    assert table.num_rows == 2  # nothing dropped


def test_duplicate_ids_and_unreadable_files(tmp_path):
    rows = [{"id": "x", "prompt": "q", "chosen": "c", "rejected": "r"}] * 2
    _, findings = load_preferences(_write(tmp_path / "d.jsonl", rows))
    assert [(f.row, f.field) for f in findings] == [("x", "id")]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "q"}\nnot json\n')
    with pytest.raises(PreferenceFileError, match="line 2: not valid JSON"):
        load_preferences(tmp_path / "bad.jsonl")
    with pytest.raises(PreferenceFileError, match="use .jsonl or .parquet"):
        load_preferences(_write(tmp_path / "p.csv", []))


def test_cli_validate_names_every_bad_row(tmp_path):
    f = _write(tmp_path / "prefs.jsonl", [{"id": "good", "prompt": "q", "chosen": "c", "rejected": "r"},
                                         {"id": "bad", "prompt": "q", "chosen": "c", "rejected": "c"}])
    out = subprocess.run([sys.executable, "-m", "rlpipe.cli", "data", "validate", str(f)], capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    assert "row bad: rejected: is the same text as chosen" in out.stdout
    assert "2 preference pairs, 1 finding(s)" in out.stdout


def test_synthetic_pairs_follow_the_hidden_quality_with_noise_only_in_training():
    prompts = build_arithmetic()
    table = build_synthetic_preferences(prompts, pairs_per_prompt=2, label_noise=0.2, seed=0)
    truth = {r["prompt"]: int(r["ground_truth"]) for r in prompts.to_pylist()}
    split_of = {r["prompt"]: r["split"] for r in prompts.to_pylist()}
    agree = {"train": [], "validation": [], "test": []}
    for r in table.to_pylist():
        assert r["split"] == split_of[r["prompt"]]  # a test prompt's pairs stay in test
        qc, qr = (closeness_quality(int(r[k]), truth[r["prompt"]]) for k in ("chosen", "rejected"))
        assert abs(qc - qr) >= 0.05
        agree[r["split"]].append(qc > qr)
    assert all(agree["validation"]) and all(agree["test"])  # held-out labels are the true order
    share = 1 - sum(agree["train"]) / len(agree["train"])
    assert 0.18 < share < 0.22  # label noise 0.2 on training pairs
    assert preference_version(table) == preference_version(build_synthetic_preferences(prompts, 2, 0.2, seed=0))
    assert isinstance(table, pa.Table) and table.num_rows == 2 * prompts.num_rows
