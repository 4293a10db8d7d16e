import json
from pathlib import Path

import pytest

from rlpipe.config import load_config
from rlpipe.storage import PROMPT_SCHEMA, open_store
from rlpipe.storage.weights import file_weights_digest
from tasks.data import DatasetInvalid, prepare_dataset
from tasks.sft import train_sft_task

SAMPLE = Path(__file__).resolve().parents[2] / "datasets" / "samples" / "gsm8k_style.jsonl"


def test_invalid_user_dataset_stops_the_run_naming_rows(tmp_path):
    p = tmp_path / "mine.jsonl"
    rows = [{"id": "a", "prompt": "1+1=", "ground_truth": "2"}, {"id": "b", "prompt": "1+1=", "ground_truth": "2", "split": "test"},
            {"id": "c", "prompt": "2+2="}]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = load_config(None, [f"task.dataset={p}"])
    with pytest.raises(DatasetInvalid) as e:
        prepare_dataset.fn(cfg)
    msg = str(e.value)
    assert "2 invalid row(s); nothing was dropped" in msg
    assert "row b: split: leak" in msg and "row c: ground_truth" in msg


def test_sft_continues_from_a_users_hf_folder(tiny_checkpoint, tmp_path):
    """`task.policy_model` may name any HF causal-LM folder; SFT trains it and stores a new checkpoint."""
    cfg = load_config(None, [
        f"task.policy_model={tiny_checkpoint}", f"task.dataset={SAMPLE}",
        "sft.steps=3", "sft.batch_size=4", "sft.stop_at_accuracy=null", "rollout.max_new_tokens=4",
    ])
    ds = prepare_dataset.fn(cfg)
    assert ds["train_rows"] == 7 and ds["test_rows"] == 2
    table = open_store().read_stage(ds["prefix"], schema=PROMPT_SCHEMA)
    assert table.num_rows == 9
    out = train_sft_task.fn(cfg, ds, "sft-from-folder", None)
    assert out["steps"] == 3 and out["heldout_n"] == 2
    local = open_store().download_dir("runs/sft-from-folder/checkpoints/sft", tmp_path / "ck")
    assert file_weights_digest(local) == out["weights_sha256"] != file_weights_digest(tiny_checkpoint)
    assert out["checkpoint_uri"] == open_store().url("runs/sft-from-folder/checkpoints/sft")
